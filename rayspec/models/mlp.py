"""A multi-layer perceptron as a block sequence: the quickstart model."""

from __future__ import annotations

import math

from torch import nn

from rayspec.data import DataInfo
from rayspec.models import ModelError, register

# (hidden width, hidden blocks) per size
_SIZES = {"full": (1024, 8), "small": (256, 6), "tiny": (64, 6)}


@register("mlp")
def mlp(size: str, info: DataInfo, width: int | None = None, depth: int | None = None) -> nn.Sequential:
    """``Flatten+Linear+ReLU``, ``depth-1`` hidden ``Linear+ReLU`` blocks, then the classifier ``Linear``."""
    w, d = _SIZES[size]
    width, depth = width or w, depth or d
    if depth < 1:
        raise ModelError(f"model.depth={depth} must be >= 1")
    if info.kind != "image":
        raise ModelError(f"model=mlp takes image data, got a {info.kind} data set; pick an image data set")
    in_features = math.prod(info.input_shape)
    blocks: list[nn.Module] = [nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.ReLU())]
    blocks += [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 1)]
    blocks.append(nn.Linear(width, info.num_classes))
    return nn.Sequential(*blocks)
