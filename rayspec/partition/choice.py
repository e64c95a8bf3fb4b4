"""A partition of a model into stages with per-stage costs, chosen by ``pipeline.partition`` or ``balance``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rayspec.errors import unknown
from rayspec.partition.profile import BlockProfile, profile_blocks
from rayspec.partition.split import PARTITIONS, PartitionError, block_parameters, check_balance, min_max_split, uniform

__all__ = ["StageRow", "PartitionPlan", "choose_partition", "human_count", "human_bytes"]


@dataclass(frozen=True)
class StageRow:
    """One stage of a ``PartitionPlan``: blocks ``first..last`` (inclusive) and what they cost.

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
class PartitionPlan:
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


def choose_partition(
    model: nn.Sequential,
    stages: int,
    partition: str = "uniform",
    balance: Sequence[int] | None = None,
    sample_input: Any = None,
    device: str | torch.device = "cpu",
    profiles: Sequence[BlockProfile] | None = None,
) -> PartitionPlan:
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
        raise unknown("pipeline.partition", partition, PARTITIONS)
    n = len(model)
    if balance is not None:
        counts, partition = check_balance(balance, n, stages), "balance"
    else:
        uniform(n, stages)
    profiles = _profiles(model, partition, sample_input, device, profiles)
    params = block_parameters(model)
    if partition == "uniform":
        counts = uniform(n, stages)
    elif partition == "parameters":
        counts = min_max_split(params, stages)
    elif partition == "profile":
        counts = min_max_split([p.seconds for p in profiles], stages)  # type: ignore[union-attr]
    return PartitionPlan(list(counts), partition, _rows(counts, params, profiles), profiles)


def _profiles(model: nn.Sequential, partition: str, sample_input: Any, device: str | torch.device,
              profiles: Sequence[BlockProfile] | None) -> list[BlockProfile] | None:
    """The blocks' profiles: those given (one per block), else measured on ``sample_input``, else none
    (``profile`` needs them)."""
    n = len(model)
    if profiles is not None:
        if len(profiles) != n:
            raise PartitionError(f"got {len(profiles)} block profiles for a model of {n} blocks; profile this model")
        return list(profiles)
    if sample_input is not None:
        return profile_blocks(model, sample_input, device)
    if partition == "profile":
        raise PartitionError(
            "pipeline.partition='profile' needs a sample_input (a batch of the model's input) to time the blocks; "
            "pass one, or choose uniform or parameters"
        )
    return None


def _rows(counts: Sequence[int], params: list[int], profiles: list[BlockProfile] | None) -> list[StageRow]:
    """One table row per stage: its blocks, parameters, and with profiles its time and output bytes."""
    rows, start = [], 0
    for k, count in enumerate(counts):
        end = start + count
        seconds = out = None
        if profiles is not None:
            seconds = sum(p.seconds for p in profiles[start:end])
            out = profiles[end - 1].output_bytes
        rows.append(StageRow(k, start, end - 1, sum(params[start:end]), seconds, out))
        start = end
    return rows
