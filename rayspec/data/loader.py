"""Deterministic batching: the same seed gives every method the same batches in the same order."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, default_collate


def epoch_batches(dataset: Dataset, batch_size: int, seed: int, epoch: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Full batches of one epoch in the order fixed by ``(seed, epoch)``; a trailing partial batch is dropped."""
    n = len(dataset)  # type: ignore[arg-type]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    tensors = getattr(dataset, "tensors", None)
    for i in range(0, n - batch_size + 1, batch_size):
        idx = order[i : i + batch_size]
        if tensors is not None:
            yield tuple(t[idx] for t in tensors)
        else:
            yield tuple(default_collate([dataset[int(j)] for j in idx]))


def train_batches(dataset: Dataset, batch_size: int, seed: int, start: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
    """An endless stream of training batches, epoch after epoch, starting at batch number ``start``."""
    n = len(dataset)  # type: ignore[arg-type]
    per_epoch = n // batch_size
    if per_epoch == 0:
        raise ValueError(f"train.batch_size={batch_size} exceeds the training set ({n} samples); lower it")
    epoch, skip = divmod(start, per_epoch)
    while True:
        for j, batch in enumerate(epoch_batches(dataset, batch_size, seed, epoch)):
            if j >= skip:
                yield batch
        epoch, skip = epoch + 1, 0


def eval_batches(dataset: Dataset, batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """The whole split in order, in batches (the last may be smaller)."""
    n = len(dataset)  # type: ignore[arg-type]
    tensors = getattr(dataset, "tensors", None)
    for i in range(0, n, batch_size):
        idx = list(range(i, min(n, i + batch_size)))
        if tensors is not None:
            yield tuple(t[i : i + len(idx)] for t in tensors)
        else:
            yield tuple(default_collate([dataset[j] for j in idx]))
