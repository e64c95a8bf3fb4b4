"""Helpers shared by the model builders: input checks, size tables and parameter counts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from torch import nn

from rayspec.data import DataInfo
from rayspec.errors import unknown
from rayspec.models import SIZES, ModelError

T = TypeVar("T")


def count_parameters(model: nn.Module) -> int:
    """The number of scalars in ``model``'s parameters (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


def pick(table: Mapping[str, T], size: str, name: str) -> T:
    """The entry of a per-size ``table`` for ``size``, or a ``ConfigError`` naming the choices."""
    if size not in table:
        raise unknown("model.size", size, SIZES, f" for model={name}")
    return table[size]


def no_options(name: str, options: Mapping[str, Any]) -> None:
    """Reject builder options for a model that takes none."""
    if options:
        raise ModelError(
            f"model={name} takes no options, got {', '.join(sorted(options))}; "
            f"remove them from the model config (keep only name and size)"
        )


def image_channels(name: str, info: DataInfo, min_size: int = 1) -> int:
    """The channel count of ``info``'s images, after checking ``name`` can take them.

    Args:
        name: the model name, for error messages.
        info: the data set description.
        min_size: the smallest image height and width the model accepts.

    Raises:
        ModelError: for text data, a shape that is not ``(C, H, W)`` or images below ``min_size``.
    """
    if info.kind != "image":
        raise ModelError(f"model={name} takes image data, got a {info.kind} data set; pick an image data set")
    if len(info.input_shape) != 3:
        raise ModelError(f"model={name} needs image inputs of shape (C, H, W), got input_shape={info.input_shape}")
    _, h, w = info.input_shape
    if min(h, w) < min_size:
        raise ModelError(
            f"model={name} needs images of at least {min_size}x{min_size}, got {h}x{w}; "
            f"use larger images (e.g. data.image_size={min_size}) or another model"
        )
    return info.input_shape[0]


def text_vocab(name: str, info: DataInfo) -> tuple[int, int]:
    """``(vocab_size, sequence_length)`` of ``info``'s text, after checking ``name`` can take it.

    Raises:
        ModelError: for image data, a shape that is not ``(T,)`` or a missing vocabulary size.
    """
    if info.kind != "text":
        raise ModelError(f"model={name} takes text data, got a {info.kind} data set; pick a text data set")
    if len(info.input_shape) != 1:
        raise ModelError(f"model={name} needs token inputs of shape (T,), got input_shape={info.input_shape}")
    if not info.vocab_size or info.vocab_size < 2:
        raise ModelError(
            f"model={name} needs DataInfo.vocab_size >= 2 (id 0 is padding), got {info.vocab_size}; "
            f"set vocab_size in the text data set's DataInfo"
        )
    return info.vocab_size, info.input_shape[0]
