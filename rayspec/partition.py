"""Partitioning: how many consecutive blocks each pipeline stage gets."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

__all__ = ["PartitionError", "uniform", "check_balance", "split"]


class PartitionError(ValueError):
    """An impossible partition: wrong sum, an empty stage, more stages than blocks."""


def uniform(num_blocks: int, stages: int) -> list[int]:
    """Block counts as equal as possible, earlier stages taking the remainder."""
    if stages < 1:
        raise PartitionError(f"pipeline.stages={stages} must be >= 1")
    if stages > num_blocks:
        raise PartitionError(
            f"pipeline.stages={stages} but the model has {num_blocks} blocks; "
            f"lower pipeline.stages to at most {num_blocks} or pick a deeper model"
        )
    q, r = divmod(num_blocks, stages)
    return [q + (1 if k < r else 0) for k in range(stages)]


def check_balance(balance: Sequence[int], num_blocks: int, stages: int | None = None) -> list[int]:
    """Validate an explicit ``pipeline.balance`` of block counts."""
    balance = list(balance)
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in balance):
        raise PartitionError(f"pipeline.balance={balance} must be a list of integers")
    if stages is not None and len(balance) != stages:
        raise PartitionError(
            f"pipeline.balance={balance} has {len(balance)} entries but pipeline.stages={stages}; "
            "give one block count per stage"
        )
    if any(b < 1 for b in balance):
        raise PartitionError(f"pipeline.balance={balance} gives a stage no blocks; every count must be >= 1")
    if sum(balance) != num_blocks:
        raise PartitionError(
            f"pipeline.balance={balance} sums to {sum(balance)} but the model has {num_blocks} blocks; "
            "the counts must add up to the number of blocks"
        )
    return balance


def split(model: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``model`` into consecutive stage modules that keep the original child names.

    Keeping names ("3.weight" stays "3.weight") makes the union of the stage state_dicts the
    state_dict of the whole model.
    """
    balance = check_balance(balance, len(model))
    children = list(model.named_children())
    parts, start = [], 0
    for count in balance:
        parts.append(nn.Sequential(OrderedDict(children[start : start + count])))
        start += count
    return parts
