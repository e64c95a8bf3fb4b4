"""A self-normalizing fully connected network (Klambauer et al. 2017) as a block sequence.

The image is flattened; each hidden block is ``Linear + SELU + AlphaDropout`` with LeCun-normal
weights (``std = 1/sqrt(fan_in)``) and zero biases, so activations stay near zero mean and unit
variance through depth; the last block is the classifier ``Linear`` (same init). ``full`` has 16
hidden layers of 1024 units (the paper's CIFAR-10 learning curves compare 8, 16 and 32 layers),
``small`` 8 of 256 and ``tiny`` 8 of 64.
"""

from __future__ import annotations

import math

from torch import nn

from rayspec.data import DataInfo
from rayspec.models import ModelError, register
from rayspec.models._util import image_channels, pick

# (hidden width, hidden layers) per size
_SIZES = {"full": (1024, 16), "small": (256, 8), "tiny": (64, 8)}


def lecun_linear(fan_in: int, fan_out: int) -> nn.Linear:
    """A ``Linear`` with LeCun-normal weights (``N(0, 1/fan_in)``) and zero bias."""
    layer = nn.Linear(fan_in, fan_out)
    nn.init.normal_(layer.weight, 0.0, 1.0 / math.sqrt(fan_in))
    nn.init.zeros_(layer.bias)
    return layer


@register("snn")
def snn(
    size: str, info: DataInfo, width: int | None = None, depth: int | None = None, dropout: float = 0.05
) -> nn.Sequential:
    """A self-normalizing MLP; see the module docstring.

    Args:
        size: ``full``, ``small`` or ``tiny``.
        info: the image data set's description.
        width: hidden units per layer (default per size).
        depth: number of hidden layers (default per size).
        dropout: AlphaDropout probability after each hidden SELU (the paper uses 0.05 or 0.1).
    """
    w, d = pick(_SIZES, size, "snn")
    width, depth = width or w, depth or d
    if depth < 1 or width < 1:
        raise ModelError(f"model=snn needs width >= 1 and depth >= 1, got width={width}, depth={depth}")
    if not 0 <= dropout < 1:
        raise ModelError(f"model.dropout={dropout} must be in [0, 1)")
    image_channels("snn", info)
    fan_in = math.prod(info.input_shape)
    blocks: list[nn.Module] = []
    for i in range(depth):
        layers = [lecun_linear(fan_in if i == 0 else width, width), nn.SELU(), nn.AlphaDropout(dropout)]
        blocks.append(nn.Sequential(nn.Flatten(), *layers) if i == 0 else nn.Sequential(*layers))
    blocks.append(lecun_linear(width, info.num_classes))
    return nn.Sequential(*blocks)
