"""Where an update per micro-batch pays: the micro-batch size above which ``spectrain`` (an update and a prediction
per micro-batch, no flush) beats torch's ``Schedule1F1B`` (one update per batch, a fill and a drain per batch),
predicted from measured compute, hop and update times, and the spread of a measured ratio.

Per batch of ``M`` micro-batches on 2 stages, from the schedule simulator (``Schedule.makespan``) over the
compute measured alone at each micro-batch size (``profile_stages``):

* torch's 1F1B: the flushed schedule's makespan, plus its step once per batch (the slower stage's), plus two
  hops of the activation that fill and drain put on the critical path (torch's gloo hop, measured per size);
* spectrain: the unflushed 1F1B's makespan with each stage's backward lengthened by its update and prediction
  per micro-batch (``U``, measured on the stage's parameters as the stage runs it, compiled or not).

Hops inside the steady state are taken as hidden by compute on both sides. The bound is the ratio of the two;
the crossover the smallest size at which it reaches 1. What it leaves out: the transports' per-message costs
beyond the hop, Ray's scheduling, and the cores the two sides share with the machine's other load.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from benchmarks._shared.peer_setup import IMAGE, PeerConfig, ideal_step_s, profile_stages
from rayspec.core.optim import Optimizer, OptimSpec


def median_spread(ratios: Sequence[float], draws: int = 2000, seed: int = 0) -> float:
    """Half the width of the 95 % bootstrap interval of the median of ``ratios`` (0 for one ratio)."""
    if len(ratios) < 2:
        return 0.0
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return (medians[int(0.975 * draws) - 1] - medians[int(0.025 * draws)]) / 2


def update_costs(parts: Sequence[nn.Module], cfg: PeerConfig, compiled: bool, repeats: int = 10) -> dict[int, dict]:
    """Per stage, seconds of torch's step alone (``step``: the flushed schedules' once per batch) and of the step
    with the prediction after it (``update``: spectrain's per micro-batch), at one thread, the fastest of
    ``repeats``."""
    out = {}
    for k, part in enumerate(parts):
        grads = [torch.randn_like(p) * 1e-4 for p in part.parameters()]  # made once: only the update is timed
        plain = Optimizer([nn.Parameter(p.detach().clone()) for p in part.parameters()],
                          OptimSpec(momentum=cfg.momentum))
        fast = Optimizer([nn.Parameter(p.detach().clone()) for p in part.parameters()],
                         OptimSpec(momentum=cfg.momentum, compile=compiled))
        scratch = [torch.empty_like(g) for g in grads]

        def step(opt: Optimizer = plain, grads: list[torch.Tensor] = grads) -> None:
            for p, g in zip(opt.params, grads):
                p.grad = g
            opt.step(cfg.lr)

        def update(opt: Optimizer = fast, grads: list[torch.Tensor] = grads,
                   scratch: list[torch.Tensor] = scratch) -> None:
            for p, g in zip(opt.params, grads):
                p.grad = g
            if not opt.step(cfg.lr, (1.0, -cfg.lr, scratch)):  # as the stage predicts without optim.compile
                for w, d, t in zip(opt.aliases, opt.direction(), scratch):
                    if d is not None:
                        torch.add(w, d, alpha=-cfg.lr, out=t)

        out[k] = {"step": _fastest(step, repeats), "update": _fastest(update, repeats)}
    return out


def _fastest(fn: Callable[[], object], repeats: int) -> float:
    fn()
    fn()  # the second call: a compiled update's state exists from the first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def predict(parts: Sequence[nn.Module], cfg: PeerConfig, sizes: Sequence[int], costs: dict[int, dict],
            hop_s: Callable[[tuple[int, ...]], float]) -> list[dict]:
    """Per micro-batch size: the compute, the hop, and the predicted ratio torch 1F1B seconds / spectrain seconds
    per batch (above 1: spectrain faster)."""
    m = cfg.microbatches
    rows = []
    for b in sizes:
        sized = dataclasses.replace(cfg, batch=b * m)
        compute = profile_stages(parts, sized, repeats=5)
        with torch.no_grad():
            act = tuple(copy.deepcopy(parts[0])(torch.zeros(b, *IMAGE.input_shape)).shape)
        hop = hop_s(act)
        step = max(c["step"] for c in costs.values())
        torch_s = ideal_step_s("1f1b", m, compute) + step + 2 * hop
        lengthened = {(k, kind): v + (costs[k]["update"] if kind == "B" else 0.0) for (k, kind), v in compute.items()}
        ours_s = ideal_step_s("spectrain", m, lengthened)
        rows.append({"microbatch_size": b, "compute_ms": round(sum(compute[k, kind] for k in (0, 1) for kind in "FB")
                                                              * 1e3, 2),
                     "hop_ms": round(hop * 1e3, 3), "torch_1f1b_ms": round(torch_s * 1e3, 2),
                     "spectrain_ms": round(ours_s * 1e3, 2), "predicted_ratio": round(torch_s / ours_s, 3)})
    return rows


def crossover(rows: Sequence[dict]) -> int | None:
    """The smallest micro-batch size from which on the predicted ratio stays at or above 1 (None: never)."""
    above = None
    for row in sorted(rows, key=lambda r: r["microbatch_size"], reverse=True):
        if row["predicted_ratio"] < 1.0:
            break
        above = row["microbatch_size"]
    return above
