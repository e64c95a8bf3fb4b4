"""The selection split: part of the training data held out for choosing settings, so the test split is read only
by the runs that report.

``data.selection`` holds out part of a data set's training split (a share in ``(0, 1)`` or a count of samples;
0: none, the default); those samples are never trained on. ``data.eval_split`` picks what a run evaluates on:
``test`` (the data set's own validation or test split, the default) or ``selection`` (the held-out part).
Probes that choose a model, a budget or a rate evaluate on ``selection``; the runs that report evaluate on
``test`` with the same ``data.selection``, so they train on exactly the data the probes trained on.
"""

from __future__ import annotations

from typing import Any

import torch

from rayspec.data import DataError

__all__ = ["EVAL_SPLITS", "SELECTION_SEED", "held_out", "split_indices", "check_selection"]

EVAL_SPLITS = ("test", "selection")
"""What a run evaluates on (``data.eval_split``)."""
SELECTION_SEED = 1_000_003
"""Seeds which samples are held out: fixed (not the run's seed), so every seed selects on the same samples."""


def check_selection(name: str, selection: Any, eval_split: Any) -> None:
    """Check ``data.selection`` and ``data.eval_split`` before any file is read.

    Raises:
        DataError: a selection that is neither a share in [0, 1) nor a count, an unknown ``eval_split``, or
            ``eval_split=selection`` without a selection.
    """
    if isinstance(selection, bool) or not isinstance(selection, (int, float)) or selection < 0 \
            or (isinstance(selection, float) and selection >= 1):
        raise DataError(f"{name}: data.selection={selection!r} must be a share of the training split in [0, 1) or a "
                        f"count of training samples (an integer >= 1), e.g. data.selection=5000; 0 holds out none")
    if eval_split not in EVAL_SPLITS:
        raise DataError(f"{name}: data.eval_split={eval_split!r} must be one of {', '.join(EVAL_SPLITS)} (test: the "
                        f"data set's own test split; selection: the part of the training split data.selection holds "
                        f"out)")
    if eval_split == "selection" and not selection:
        raise DataError(f"{name}: data.eval_split=selection needs a selection split: set data.selection, e.g. "
                        f"data.selection=0.1 (a share of the training split) or data.selection=5000 (samples)")


def held_out(name: str, selection: int | float, n: int) -> int:
    """How many of ``n`` training samples ``selection`` holds out (a share is rounded); at least one stays.

    Raises:
        DataError: the count leaves no training sample.
    """
    count = round(selection * n) if isinstance(selection, float) else int(selection)
    if count >= n:
        raise DataError(f"{name}: data.selection={selection!r} holds out {count} of the {n} training samples, "
                        f"leaving none to train on; hold out fewer")
    return count


def split_indices(name: str, selection: int | float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted indices of the ``n`` training samples that stay for training, and those held out.

    The held-out samples are the first ``held_out(...)`` of a permutation seeded with :data:`SELECTION_SEED`.
    """
    count = held_out(name, selection, n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SELECTION_SEED))
    return order[count:].sort().values, order[:count].sort().values
