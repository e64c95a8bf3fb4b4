"""How many consecutive blocks each pipeline stage gets: uniform, by parameters, by measured time."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from numbers import Real
from typing import Any

import torch
from torch import nn

from rayspec.errors import RayspecError
from rayspec.partition.profile import profile_blocks

__all__ = ["PartitionError", "PARTITIONS", "uniform", "check_balance", "split", "min_max_split", "block_parameters",
           "by_parameters", "by_profile"]

PARTITIONS = ("uniform", "parameters", "profile")


class PartitionError(RayspecError):
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


def min_max_split(costs: Sequence[float], stages: int) -> list[int]:
    """The contiguous split of ``costs`` into ``stages`` non-empty parts with the smallest largest part sum.

    Exact, by dynamic programming over prefix sums in O(stages * n^2). Among the splits with
    that optimal largest part, ties are broken deterministically by, in order: the smallest
    sum of squared part sums (the other stages as even as the bottleneck allows), the smallest
    sum of squared block counts, then the lexicographically largest counts (earlier stages
    take more). So equal (or all-zero) costs give exactly ``uniform(len(costs), stages)``.

    Args:
        costs: a non-negative finite cost per block (ints stay exact).
        stages: the number of parts, 1 to ``len(costs)``.

    Returns:
        Block counts per stage, each >= 1, summing to ``len(costs)``.

    Raises:
        PartitionError: for a negative, non-finite or non-numeric cost, or a bad ``stages``.
    """
    costs = _checked(costs, stages)
    prefix: list[float] = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    return _most_even(prefix, stages, _bottleneck(prefix, stages))


def _checked(costs: Sequence[float], stages: int) -> list[float]:
    """``costs`` as a list, each a finite number >= 0, with a valid ``stages`` for them."""
    costs = list(costs)
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, Real) or not math.isfinite(c) or c < 0:
            raise PartitionError(f"block cost costs[{i}]={c!r} must be a finite number >= 0")
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise PartitionError(f"pipeline.stages={stages!r} must be an integer")
    uniform(len(costs), stages)  # the same errors for stages < 1 or more stages than blocks
    return costs


def _bottleneck(prefix: list[float], stages: int) -> float:
    """The smallest largest part over every split into ``stages`` parts (``prefix``: the costs' prefix sums)."""
    n = len(prefix) - 1
    # best[i]: the smallest largest part splitting blocks i.. into k parts (k grows).
    best = [prefix[n] - prefix[i] for i in range(n + 1)]
    for k in range(2, stages + 1):
        best = [
            min((max(prefix[j] - prefix[i], best[j]) for j in range(i + 1, n - k + 2)), default=math.inf)
            if i <= n - k else math.inf
            for i in range(n + 1)
        ]
    return best[0]


def _most_even(prefix: list[float], stages: int, bound: float) -> list[int]:
    """Among the splits with every part <= ``bound``, the one with the smallest (sum of squared costs, sum of
    squared counts); scanning the first part from longest to shortest and keeping only strict improvements
    picks the lexicographically largest counts among exact ties."""
    n = len(prefix) - 1

    def part(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    none: tuple[float, int] | None = None
    score = [((part(i, n) ** 2, (n - i) ** 2) if part(i, n) <= bound else none) for i in range(n + 1)]
    choices: list[list[int]] = []
    for k in range(2, stages + 1):
        new, choice = [none] * (n + 1), [0] * (n + 1)
        for i in range(n - k + 1):
            for j in range(n - k + 1, i, -1):
                p, rest = part(i, j), score[j]
                if p > bound or rest is None:
                    continue
                total = (p * p + rest[0], (j - i) ** 2 + rest[1])
                kept = new[i]
                if kept is None or total < kept:
                    new[i], choice[i] = total, j
        score = new
        choices.append(choice)
    balance, i = [], 0
    for choice in reversed(choices):
        balance.append(choice[i] - i)
        i = choice[i]
    balance.append(n - i)
    return balance


def block_parameters(model: nn.Sequential) -> list[int]:
    """Scalars in each block's parameters."""
    return [sum(p.numel() for p in block.parameters()) for block in model]


def by_parameters(model: nn.Sequential, stages: int) -> list[int]:
    """Block counts that minimise the largest stage parameter count (``min_max_split`` over blocks)."""
    return min_max_split(block_parameters(model), stages)


def by_profile(
    model: nn.Sequential, sample_input: Any, stages: int, device: str | torch.device = "cpu", **profile_options: Any
) -> list[int]:
    """Block counts that minimise the slowest stage's measured forward + backward time.

    Args:
        model: an ``nn.Sequential`` of blocks.
        sample_input: a batch of the model's input (tensor or tuple of tensors).
        stages: the number of pipeline stages.
        device: where to time the blocks.
        **profile_options: ``warmup`` and ``repeats`` for ``profile_blocks``.
    """
    uniform(len(model), stages)
    profiles = profile_blocks(model, sample_input, device, **profile_options)
    return min_max_split([p.seconds for p in profiles], stages)
