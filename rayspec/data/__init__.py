"""Data sets by name: each builder returns train and validation splits and a ``DataInfo``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch.utils.data import Dataset

from rayspec.errors import RayspecError, unknown

__all__ = ["DataInfo", "DataBundle", "DATASETS", "register", "build_data", "DataError"]


class DataError(RayspecError):
    """Missing files, an unknown data set name or a bad option."""


@dataclass(frozen=True)
class DataInfo:
    """What a model needs to know of its data.

    Attributes:
        kind: ``image`` (inputs ``(C, H, W)`` floats) or ``text`` (inputs ``(T,)`` token ids).
        num_classes: number of target classes.
        input_shape: shape of one input sample.
        vocab_size: size of the token vocabulary (text only; id 0 is padding).
    """

    kind: Literal["image", "text"]
    num_classes: int
    input_shape: tuple[int, ...]
    vocab_size: int | None = None


@dataclass
class DataBundle:
    """A training split, a validation split (None: no evaluation) and what a model needs to know of them."""

    train: Dataset
    val: Dataset | None
    info: DataInfo | None
    """None only for data given with a model of one's own (``rayspec.fit``, ``data._target_``)."""


DATASETS: dict[str, Callable[..., DataBundle]] = {}


def register(name: str) -> Callable[[Callable[..., DataBundle]], Callable[..., DataBundle]]:
    """Register ``fn(root, seed, **options) -> DataBundle`` under ``name``."""

    def wrap(fn: Callable[..., DataBundle]) -> Callable[..., DataBundle]:
        DATASETS[name] = fn
        return fn

    return wrap


def build_data(name: str, root: str | None = None, seed: int = 0, **options: Any) -> DataBundle:
    """Build data set ``name``; ``root`` is where its files are (ignored by synthetic sets)."""
    if name not in DATASETS:
        raise unknown("data", name, sorted(DATASETS))
    return DATASETS[name](root=root, seed=seed, **options)


# Importing a data module registers it.
from rayspec.data import cifar10, imdb, mnist, rt_reviews, synthetic, synthetic_text, text_csv  # noqa: E402,F401
