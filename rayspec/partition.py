"""Partitioning: how many consecutive blocks each pipeline stage gets."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import torch
from torch import nn

from rayspec.profile import BlockProfile, profile_blocks

__all__ = [
    "PartitionError", "uniform", "check_balance", "split", "min_max_split", "by_parameters", "by_profile",
    "BlockProfile", "profile_blocks", "StageRow", "Plan", "plan", "PARTITIONS",
]

PARTITIONS = ("uniform", "parameters", "profile")


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
    costs = list(costs)
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, Real) or not math.isfinite(c) or c < 0:
            raise PartitionError(f"block cost costs[{i}]={c!r} must be a finite number >= 0")
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise PartitionError(f"pipeline.stages={stages!r} must be an integer")
    n = len(costs)
    uniform(n, stages)  # the same errors for stages < 1 or more stages than blocks
    prefix: list[float] = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def part(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    # best[i]: the smallest largest part splitting blocks i.. into k parts (k grows).
    best = [part(i, n) for i in range(n + 1)]
    for k in range(2, stages + 1):
        best = [
            min((max(part(i, j), best[j]) for j in range(i + 1, n - k + 2)), default=math.inf) if i <= n - k else math.inf
            for i in range(n + 1)
        ]
    bound = best[0]
    # Among splits with every part <= bound, minimise (sum of squared costs, sum of squared counts);
    # scanning the first part from longest to shortest and keeping only strict improvements
    # picks the lexicographically largest counts among exact ties.
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


@dataclass(frozen=True)
class StageRow:
    """One stage of a ``Plan``: blocks ``first..last`` (inclusive) and what they cost.

    Attributes:
        stage: the stage index.
        first: the stage's first block index.
        last: the stage's last block index.
        parameters: scalars in the stage's parameters.
        seconds: measured forward + backward seconds of its blocks, None when not profiled.
        output_bytes: bytes of the stage's output activation, None when not profiled.
    """

    stage: int
    first: int
    last: int
    parameters: int
    seconds: float | None = None
    output_bytes: int | None = None


@dataclass
class Plan:
    """A partition of a model into stages, with per-stage costs.

    Attributes:
        balance: block counts per stage.
        partition: how it was chosen: ``uniform``, ``parameters``, ``profile`` or ``balance``.
        rows: one ``StageRow`` per stage.
        profiles: the per-block profiles the costs came from, None when not profiled.
    """

    balance: list[int]
    partition: str
    rows: list[StageRow]
    profiles: list[BlockProfile] | None = field(default=None, repr=False)

    @property
    def slowest_s(self) -> float | None:
        """The slowest stage's seconds (the pipeline's bottleneck), None when not profiled."""
        times = [r.seconds for r in self.rows if r.seconds is not None]
        return max(times) if times else None

    def table(self) -> str:
        """A per-stage table: stage, blocks, parameters, time in ms and output activation size."""
        head = ("stage", "blocks", "params", "time ms", "output")
        body = [
            (
                str(r.stage),
                f"{r.first}" if r.first == r.last else f"{r.first}-{r.last}",
                human_count(r.parameters),
                "-" if r.seconds is None else f"{r.seconds * 1e3:.2f}",
                "-" if r.output_bytes is None else human_bytes(r.output_bytes),
            )
            for r in self.rows
        ]
        widths = [max(len(row[c]) for row in (head, *body)) for c in range(len(head))]
        return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)).rstrip() for row in (head, *body))


def human_count(n: float) -> str:
    """``1234567`` -> ``1.2M`` (K, M, G; plain below 1000)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:g}"


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB`` (B, KiB, MiB, GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:g} B"


def plan(
    model: nn.Sequential,
    stages: int,
    partition: str = "uniform",
    balance: Sequence[int] | None = None,
    sample_input: Any = None,
    device: str | torch.device = "cpu",
    profiles: Sequence[BlockProfile] | None = None,
) -> Plan:
    """Choose the block counts per stage and describe each stage.

    Args:
        model: an ``nn.Sequential`` of blocks.
        stages: the number of pipeline stages.
        partition: ``uniform`` (equal block counts), ``parameters`` (balance parameter counts)
            or ``profile`` (balance measured forward + backward time).
        balance: explicit block counts per stage; when given it wins over ``partition``.
        sample_input: a batch of the model's input; needed by ``profile``, and when given the
            other partitions are profiled once too, to fill the time and activation columns.
        device: where to profile.
        profiles: per-block profiles measured before (skips profiling).

    Raises:
        PartitionError: for an unknown ``partition``, ``profile`` without a sample input, an
            impossible ``balance`` or more stages than blocks.
    """
    if partition not in PARTITIONS:
        raise PartitionError(f"pipeline.partition={partition!r} is unknown; choose one of {', '.join(PARTITIONS)}")
    n = len(model)
    if balance is not None:
        counts, partition = check_balance(balance, n, stages), "balance"
    else:
        uniform(n, stages)
    if profiles is not None:
        profiles = list(profiles)
        if len(profiles) != n:
            raise PartitionError(f"got {len(profiles)} block profiles for a model of {n} blocks; profile this model")
    elif sample_input is not None:
        profiles = profile_blocks(model, sample_input, device)
    elif partition == "profile":
        raise PartitionError(
            "pipeline.partition='profile' needs a sample_input (a batch of the model's input) to time the blocks; "
            "pass one, or choose uniform or parameters"
        )
    params = block_parameters(model)
    if partition == "uniform":
        counts = uniform(n, stages)
    elif partition == "parameters":
        counts = min_max_split(params, stages)
    elif partition == "profile":
        counts = min_max_split([p.seconds for p in profiles], stages)  # type: ignore[union-attr]
    rows, start = [], 0
    for k, count in enumerate(counts):
        end = start + count
        seconds = out = None
        if profiles is not None:
            seconds = sum(p.seconds for p in profiles[start:end])
            out = profiles[end - 1].output_bytes
        rows.append(StageRow(k, start, end - 1, sum(params[start:end]), seconds, out))
        start = end
    return Plan(list(counts), partition, rows, profiles)
