"""A small convolutional image classifier with GroupNorm, as a block sequence.

Blocks: three convolution blocks (3x3 convolution, GroupNorm, ReLU, 2x2 max pooling; widths ``w``, ``2w``,
``4w``), a hidden linear layer of ``8w`` units (ReLU, dropout) on the flattened features, and the linear
classifier: five blocks, so up to five stages. GroupNorm normalizes each sample on its own, so a micro-batch
of any size trains like the whole batch (BatchNorm's statistics would change with the micro-batch size and
differ between a pipeline and sequential training). ``full`` has ``w = 64``, ``small`` 32, ``tiny`` 16.
"""

from __future__ import annotations

from torch import nn

from rayspec.data import DataInfo
from rayspec.models import ModelError, register
from rayspec.models._util import image_channels, pick

_SIZES = {"full": 64, "small": 32, "tiny": 16}
"""The first block's width per size."""


def conv_block(c_in: int, c_out: int, groups: int) -> nn.Sequential:
    """3x3 convolution (no bias: the norm's shift replaces it), GroupNorm, ReLU, 2x2 max pooling (floor)."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.GroupNorm(min(groups, c_out), c_out),
                         nn.ReLU(inplace=True), nn.MaxPool2d(2))


@register("cnn")
def cnn(size: str, info: DataInfo, width: int | None = None, groups: int = 8, dropout: float = 0.0) -> nn.Sequential:
    """A small CNN with GroupNorm; see the module docstring.

    Args:
        size: ``full``, ``small`` or ``tiny`` (the first block's width ``w``: 64, 32, 16).
        info: the image data set's description (``input_shape=(C, H, W)``, at least 8x8).
        width: ``w``, overriding the size's.
        groups: GroupNorm groups per convolution (at most its channel count).
        dropout: dropout probability before the classifier.
    """
    w = width or pick(_SIZES, size, "cnn")
    if w < 1 or groups < 1 or w % min(groups, w):
        raise ModelError(f"model=cnn needs width >= 1 divisible by groups >= 1 (or smaller than it), got "
                         f"width={w}, groups={groups}")
    if not 0 <= dropout < 1:
        raise ModelError(f"model.dropout={dropout} must be in [0, 1)")
    channels = image_channels("cnn", info, min_size=8)
    _, h, wd = info.input_shape
    blocks: list[nn.Module] = [conv_block(channels, w, groups), conv_block(w, 2 * w, groups),
                               conv_block(2 * w, 4 * w, groups)]
    features = 4 * w * (h // 8) * (wd // 8)
    blocks.append(nn.Sequential(nn.Flatten(), nn.Linear(features, 8 * w), nn.ReLU(inplace=True), nn.Dropout(dropout)))
    blocks.append(nn.Linear(8 * w, info.num_classes))
    return nn.Sequential(*blocks)
