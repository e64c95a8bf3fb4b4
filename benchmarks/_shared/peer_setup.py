"""What the peer benchmarks train: the model cut into 2 stages (4 chunks for interleaved), the batches, and the
schedules of each runner."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rayspec.core.methods import METHODS
from rayspec.core.schedule import Schedule, build_schedule
from rayspec.data import DataInfo
from rayspec.models import build_model
from rayspec.partition import by_parameters, split

IMAGE = DataInfo("image", 10, (3, 32, 32))
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zb1p": "ScheduleInterleavedZeroBubble",
                   "interleaved": "ScheduleInterleaved1F1B"}
"""The torch schedules the runners are paired with, by the name the rows give them."""
RAYSPEC_RUNNERS = ("gpipe", "1f1b", "zb1p", "interleaved", "spectrain", "spectrain-grouped")
"""The runners the Ray executor runs."""
NOT_ON_RAY: tuple[str, ...] = ()
"""Runners whose row says why they are not run on Ray (the executor's refusal), rather than missing: none now."""
CHUNKS_PER_RANK = {"interleaved": 2}
"""Model chunks per rank of the runners (and torch schedules) that run several: rank r holds chunks r, r + 2."""
ALIASES = {"1f1b-flushed": "1f1b"}
"""Former runner names (results files name them): the same runner."""
# rayspec runner -> torch schedule
PEER_OF = {"gpipe": "gpipe", "1f1b": "1f1b", "zb1p": "zb1p", "interleaved": "interleaved", "spectrain": "1f1b",
           "spectrain-grouped": "1f1b"}
LIKE_FOR_LIKE = {"gpipe": True, "1f1b": True, "zb1p": True, "interleaved": True, "spectrain": False,
                 "spectrain-grouped": False}


@dataclass(frozen=True)
class PeerConfig:
    """What both sides train: the model, the batches and SGD.

    Attributes:
        model, size: ``rayspec.models`` name and size (image data, ``(3, 32, 32)``, 10 classes).
        batch: samples per batch (one update each for the flushed schedules).
        microbatches: ``M``, micro-batches per batch.
        lr, momentum: SGD settings of both sides.
        compile: rayspec's ``optim.compile`` (its predicting runners' update and prediction in one compiled pass).
        pool: distinct batches generated up front and cycled (no data loading in the timings).
        seed: seeds the weights and the batches.
    """

    model: str = "mlp"
    size: str = "full"
    batch: int = 256
    microbatches: int = 8
    lr: float = 0.01
    momentum: float = 0.9
    pool: int = 4
    seed: int = 0
    compile: bool = False


# ----------------------------------------------------------------------------- shared set-up
def build_parts(cfg: PeerConfig, chunks: int = 2) -> tuple[list[nn.Sequential], list[int]]:
    """The model of ``cfg`` cut into ``chunks`` stages by parameters (2, or 4 for 2 chunks per rank), and the block
    counts."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, IMAGE, cfg.size)
    balance = by_parameters(model, chunks)
    return split(model, balance), balance


def chunks_per_rank(runner: str) -> int:
    """Model chunks per rank of ``runner`` (``CHUNKS_PER_RANK``, 1 for the others)."""
    return CHUNKS_PER_RANK.get(runner_name(runner), 1)


def make_batches(cfg: PeerConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``cfg.pool`` deterministic ``(images, labels)`` batches of ``cfg.batch`` samples."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return [(torch.randn(cfg.batch, *IMAGE.input_shape, generator=g),
             torch.randint(0, IMAGE.num_classes, (cfg.batch,), generator=g)) for _ in range(cfg.pool)]


def microbatches(batches: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int, count: int,
                 m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches ``start .. start + count - 1`` (cycling the pool), each cut into ``m`` micro-batches in order."""
    out = []
    for i in range(start, start + count):
        x, y = batches[i % len(batches)]
        out += list(zip(x.tensor_split(m), y.tensor_split(m)))
    return out


def runner_name(runner: str) -> str:
    """``runner`` with a former name (``ALIASES``) replaced; ``ValueError`` for an unknown one."""
    runner = ALIASES.get(runner, runner)
    if runner not in RAYSPEC_RUNNERS + NOT_ON_RAY:
        raise ValueError(f"runner={runner!r} is unknown; choose one of {', '.join(RAYSPEC_RUNNERS + NOT_ON_RAY)}")
    return runner


def runner_method(runner: str) -> str:
    """The ``pipeline.method`` a runner trains with."""
    runner = runner_name(runner)
    return "spectrain" if runner.startswith("spectrain") else runner


def rayspec_schedule(runner: str, m: int, batches: int) -> Schedule:
    """The schedule a rayspec runner trains ``batches`` batches with: the flushed methods' own schedule with one
    flush and update per batch (``1f1b``: torch's ``Schedule1F1B`` order and semantics; ``interleaved``: 2 chunks
    per rank), ``spectrain`` one update per micro-batch, ``spectrain-grouped`` one per batch, no flush."""
    runner = runner_name(runner)
    if runner == "spectrain":
        return build_schedule("1f1b", 2, m * batches)
    if runner == "spectrain-grouped":
        return build_schedule("1f1b", 2, m * batches, group=m)
    return build_schedule(METHODS[runner].schedule or runner, 2, m * batches, group=m, virtual=chunks_per_rank(runner))


def profile_stages(parts: Sequence[nn.Module], cfg: PeerConfig, repeats: int = 10) -> dict[tuple[int, str], float]:
    """Median seconds of each stage's F and B on one micro-batch, alone, at 1 thread (loss included on the last),
    and of the backward split as zero-bubble schedules run it: I (input gradient) then W (weight gradient; on
    stage 0, which needs no input gradient, the whole backward)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        parts = [copy.deepcopy(p) for p in parts]
        x, y = make_batches(cfg)[0]
        x, y = x[: cfg.batch // cfg.microbatches], y[: cfg.batch // cfg.microbatches]
        out: dict[tuple[int, str], float] = {}
        inp = x
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            times: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
            for _ in range(repeats + 2):
                for split in (False, True):
                    xi = inp.detach().requires_grad_(k > 0)
                    t0 = time.perf_counter()
                    o = part(xi)
                    if last:
                        o = nn.functional.cross_entropy(o, y)
                    t1 = time.perf_counter()
                    grad = None if last else torch.ones_like(o)
                    if not split:
                        o.backward(grad)
                        times["F"].append(t1 - t0)
                        times["B"].append(time.perf_counter() - t1)
                        continue
                    if k > 0:
                        torch.autograd.backward([o], None if grad is None else [grad], inputs=[xi], retain_graph=True)
                    t2 = time.perf_counter()
                    torch.autograd.backward([o], None if grad is None else [grad], inputs=list(part.parameters()))
                    times["I"].append(t2 - t1)
                    times["W"].append(time.perf_counter() - t2)
            out.update({(k, kind): statistics.median(v[2:]) for kind, v in times.items()})
            inp = part(inp).detach()
        return out
    finally:
        torch.set_num_threads(threads)


def ideal_step_s(runner: str, m: int, durations: dict[tuple[int, str], float], batches: int = 4) -> float:
    """Ideal seconds per batch of a runner's schedule (no communication cost) under ``durations`` of its stages
    (``profile_stages`` of the parts it runs: 4 chunks for interleaved)."""
    schedule = rayspec_schedule(runner, m, batches)
    if {k for k, _ in durations} != set(range(schedule.stages)):
        raise ValueError(f"runner={runner!r} runs {schedule.stages} stages; give the durations of those "
                         f"(profile_stages of build_parts(cfg, {schedule.stages}))")
    return schedule.makespan(durations) / batches
