"""Deterministic batching: the same seed gives every method the same batches in the same order."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, Subset, default_collate


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch, fixed by ``(seed, epoch)``."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def epoch_batches(dataset: Dataset, batch_size: int, seed: int, epoch: int, skip: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
    """Full batches of one epoch in the order fixed by ``(seed, epoch)``, from batch ``skip`` on (the ones
    before are not loaded); a trailing partial batch is dropped."""
    n = len(dataset)  # type: ignore[arg-type]
    order = epoch_order(n, seed, epoch)
    tensors = getattr(dataset, "tensors", None)
    for i in range(skip * batch_size, n - batch_size + 1, batch_size):
        idx = order[i : i + batch_size]
        if tensors is not None:
            yield tuple(t[idx] for t in tensors)
        else:
            yield tuple(default_collate([dataset[int(j)] for j in idx]))


def train_batches(dataset: Dataset, batch_size: int, seed: int, start: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
    """An endless stream of training batches, epoch after epoch, starting at batch number ``start``.

    Batch ``start`` and every one after it are exactly those of a stream started at 0, so a resumed
    run sees the same data: a dataset whose augmentation depends on how often a sample was drawn
    (it has ``rewind(draws)``, as ``cifar10``'s) is first told the draws of the batches before ``start``.
    """
    n = len(dataset)  # type: ignore[arg-type]
    per_epoch = n // batch_size
    if per_epoch == 0:
        raise ValueError(f"train.batch_size={batch_size} exceeds the training set ({n} samples); lower it")
    epoch, skip = divmod(start, per_epoch)
    _rewind(dataset, batch_size, seed, epoch, skip)
    while True:
        yield from epoch_batches(dataset, batch_size, seed, epoch, skip)
        epoch, skip = epoch + 1, 0


def _rewind(dataset: Dataset, batch_size: int, seed: int, epochs: int, skip: int) -> None:
    """Tell a dataset with ``rewind`` (possibly under a ``Subset``) the draws of ``epochs`` epochs and ``skip`` batches."""
    base, index = dataset, None
    if isinstance(dataset, Subset):
        base, index = dataset.dataset, torch.as_tensor(list(dataset.indices))
    rewind = getattr(base, "rewind", None)
    if rewind is None:
        return
    n = len(dataset)  # type: ignore[arg-type]
    used = (n // batch_size) * batch_size  # samples of the full batches of an epoch
    counts = torch.zeros(n, dtype=torch.int64)
    for e in range(epochs):
        counts[epoch_order(n, seed, e)[:used]] += 1
    counts[epoch_order(n, seed, epochs)[: skip * batch_size]] += 1
    draws = torch.zeros(len(base), dtype=torch.int64)  # type: ignore[arg-type]
    if index is None:
        draws = counts
    else:
        draws.index_add_(0, index, counts)
    rewind(draws.numpy())


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
