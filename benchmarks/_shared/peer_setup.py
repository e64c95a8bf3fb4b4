"""What the peer benchmarks train: the model cut into 2 stages, the batches, and the schedules of each runner."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rayspec.core.schedule import Action, Schedule, build_schedule
from rayspec.data import DataInfo
from rayspec.models import build_model
from rayspec.partition import by_parameters, split

IMAGE = DataInfo("image", 10, (3, 32, 32))
TORCH_SCHEDULES = ("gpipe", "1f1b")
RAYSPEC_RUNNERS = ("gpipe", "1f1b-flushed", "spectrain", "spectrain-grouped")
# rayspec runner -> torch schedule
PEER_OF = {"gpipe": "gpipe", "1f1b-flushed": "1f1b", "spectrain": "1f1b", "spectrain-grouped": "1f1b"}
LIKE_FOR_LIKE = {"gpipe": True, "1f1b-flushed": True, "spectrain": False, "spectrain-grouped": False}


@dataclass(frozen=True)
class PeerConfig:
    """What both sides train: the model, the batches and SGD.

    Attributes:
        model, size: ``rayspec.models`` name and size (image data, ``(3, 32, 32)``, 10 classes).
        batch: samples per batch (one update each for the flushed schedules).
        microbatches: ``M``, micro-batches per batch.
        lr, momentum: SGD settings of both sides.
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


# ----------------------------------------------------------------------------- shared set-up
def build_parts(cfg: PeerConfig) -> tuple[list[nn.Sequential], list[int]]:
    """The model of ``cfg`` cut into 2 stages by parameters, and the block counts."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, IMAGE, cfg.size)
    balance = by_parameters(model, 2)
    return split(model, balance), balance


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


def flushed_1f1b(stages: int, m: int, batches: int) -> Schedule:
    """``batches`` flushed 1F1B batches of ``m`` micro-batches, one update each: ``Schedule1F1B``'s order and semantics."""
    one = build_schedule("1f1b", stages, m, group=m)
    actions = tuple(
        tuple(Action(a.stage, a.kind, a.microbatch + b * m, a.update) for b in range(batches) for a in one.actions[k])
        for k in range(stages)
    )
    schedule = Schedule("1f1b", stages, m * batches, m, actions)
    schedule.validate()
    return schedule


def rayspec_schedule(runner: str, m: int, batches: int) -> Schedule:
    """The schedule a rayspec runner trains ``batches`` batches with."""
    if runner == "gpipe":
        return build_schedule("gpipe", 2, m * batches, group=m)
    if runner == "1f1b-flushed":
        return flushed_1f1b(2, m, batches)
    if runner == "spectrain":
        return build_schedule("1f1b", 2, m * batches)
    if runner == "spectrain-grouped":
        return build_schedule("1f1b", 2, m * batches, group=m)
    raise ValueError(f"runner={runner!r} is unknown; choose one of {', '.join(RAYSPEC_RUNNERS)}")


def profile_stages(parts: Sequence[nn.Module], cfg: PeerConfig, repeats: int = 10) -> dict[tuple[int, str], float]:
    """Median seconds of each stage's F and B on one micro-batch, alone, at 1 thread (loss included on the last)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        parts = [copy.deepcopy(p) for p in parts]
        x, y = make_batches(cfg)[0]
        x, y = x[: cfg.batch // cfg.microbatches], y[: cfg.batch // cfg.microbatches]
        out: dict[tuple[int, str], float] = {}
        inp = x
        for k, part in enumerate(parts):
            f, b = [], []
            for _ in range(repeats + 2):
                xi = inp.detach().requires_grad_(k > 0)
                t0 = time.perf_counter()
                o = part(xi)
                if k == len(parts) - 1:
                    o = nn.functional.cross_entropy(o, y)
                t1 = time.perf_counter()
                if k == len(parts) - 1:
                    o.backward()
                else:
                    o.backward(torch.ones_like(o))
                t2 = time.perf_counter()
                f.append(t1 - t0)
                b.append(t2 - t1)
            out[(k, "F")], out[(k, "B")] = statistics.median(f[2:]), statistics.median(b[2:])
            inp = part(inp).detach()
        return out
    finally:
        torch.set_num_threads(threads)


def ideal_step_s(runner: str, m: int, durations: dict[tuple[int, str], float], batches: int = 4) -> float:
    """Ideal seconds per batch of a runner's schedule (no communication cost) under ``durations``."""
    return rayspec_schedule(runner, m, batches).makespan(durations) / batches
