"""A user's own data: what a ``data._target_`` builder returns, and the checks that a data set fits the trainer.

A builder returns a ``DataBundle`` or a tuple ``(train, val, info)``: ``train`` a map-style data set whose items
are ``(input, label)`` pairs with integer class labels (the loss is cross-entropy), ``val`` another one or
None (no evaluation), ``info`` the ``DataInfo`` that rayspec's own models need (None will do for a model of
your own). A pair of tensors ``(inputs, labels)`` stands for a ``TensorDataset`` of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from rayspec.data import DataBundle, DataError, DataInfo
from rayspec.targets import call_target

__all__ = ["build_target_data", "as_dataset", "EXPECTED"]

EXPECTED = "a DataBundle or a tuple (train, val, info) of two data sets of (input, label) pairs and a DataInfo or None"


def build_target_data(cfg: Mapping[str, Any], seed: int) -> DataBundle:
    """The data that ``cfg["_target_"]`` builds from ``cfg``'s other keys (and ``seed=`` if it takes it)."""
    where = f"data._target_={cfg['_target_']}"
    built = call_target("data", cfg, DataError, seed=seed)
    if isinstance(built, DataBundle):
        train, val, info = built.train, built.val, built.info
    elif isinstance(built, tuple) and len(built) == 3:
        train, val, info = built
    else:
        raise DataError(f"{where} returned {_kind(built)}; expected {EXPECTED}")
    if info is not None and not isinstance(info, DataInfo):
        raise DataError(f"{where} returned {_kind(info)} as its info; expected a rayspec.data.DataInfo or None")
    return DataBundle(as_dataset(train, f"{where} (train)"), None if val is None else as_dataset(val, f"{where} (val)"),
                      info)


def as_dataset(data: Any, where: str) -> Dataset:
    """``data`` as a map-style data set of ``(input, label)`` pairs, checked on its first item; ``DataError`` else.

    A pair of tensors ``(inputs, labels)`` with as many rows each becomes a ``TensorDataset``.
    """
    if (isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data)):
        inputs, labels = data
        if len(inputs) != len(labels):
            raise DataError(f"{where}: {len(inputs)} inputs but {len(labels)} labels; give one label per input")
        data = TensorDataset(inputs, labels)
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise DataError(f"{where} is {_kind(data)}; expected a map-style data set (with __len__ and __getitem__) "
                        "of (input, label) pairs, or a pair of tensors (inputs, labels)")
    if len(data) == 0:
        raise DataError(f"{where} is empty; give it at least one batch of samples")
    item = data[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise DataError(f"{where}: its items must be (input, label) pairs, but item 0 is {_kind(item)}")
    label = torch.as_tensor(item[1])
    if label.is_floating_point() or label.dim() != 0:
        raise DataError(f"{where}: labels must be integer class ids (the loss is cross-entropy), but item 0's label "
                        f"is a {label.dtype} tensor of shape {tuple(label.shape)}")
    return data  # type: ignore[return-value]


def _kind(obj: Any) -> str:
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"
