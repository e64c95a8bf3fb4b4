"""The bubble of each schedule on sleep-timed stages, measured against its formula, rayspec and torch in one run.

    python -m benchmarks.efficiency --schedules gpipe,1f1b,zb1p,interleaved [--microbatches 8,16] [--stages 4]
                                    [--virtual 2] [--forward-ms 20] [--backward-ms 40] [--repeats 3]

Each stage is one ``SplitSleepBlock``: F sleeps ``--forward-ms``, the backward ``--backward-ms`` split in two
equal halves, I (input gradient) and W (weight gradient), so that F = I = W with the defaults and B = I + W.
rayspec runs each method (``pipeline.method``: its schedule, flushed every batch of M micro-batches) on the Ray
executor with the ``p2p`` transport and stages built with ``trace=True``; torch runs ``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` (one stage per rank) and ``ScheduleInterleaved1F1B`` on the same
blocks, one spawned process per rank over gloo, each action timed around ``forward_one_chunk`` / ``backward_one_chunk`` /
``backward_weight_one_chunk``. The measured bubble is ``rayspec.core.orders.measured_bubble`` of one batch's
actions (idle over busy time of the N ranks, from the first start to the last end); the formula is
``bubble_formula``'s, which assumes F = I = W. ``interleaved`` runs ``--virtual`` blocks per rank (stages
``k, k+N, ...``), each block a stage of its own (rayspec: ``RayExecutor(virtual=v)``; torch: ``v`` ``PipelineStage``
objects per rank), so a rank's work per micro-batch is ``v`` times the others'.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from benchmarks._shared.processes import free_port
from benchmarks.efficiency._sleep import SplitSleepBlock
from rayspec.core.methods import METHODS
from rayspec.core.optim import OptimSpec
from rayspec.core.orders import bubble_formula, measured_bubble
from rayspec.core.schedule import build_schedule
from rayspec.core.stage import make_stages
from rayspec.core.stage_spec import StageSpec

__all__ = ["TORCH_PEERS", "SplitSleepBlock", "formula", "measure_rayspec", "measure_torch"]

TORCH_PEERS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zb1p": "ScheduleInterleavedZeroBubble",
               "interleaved": "ScheduleInterleaved1F1B"}
"""rayspec method -> the torch schedule of the same order."""
CHUNKED = ("interleaved",)
"""Methods that run several blocks (model chunks) per rank."""


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


def chunks(method: str, virtual: int) -> int:
    """Blocks per rank that ``method`` runs: ``virtual`` for the interleaved schedule, else 1."""
    return virtual if method in CHUNKED else 1


def _schedule(method: str, n: int, m: int, virtual: int) -> Any:
    return build_schedule(METHODS[method].schedule or method, n, m, group=m, virtual=chunks(method, virtual))


def formula(method: str, n: int, m: int, virtual: int = 1) -> float:
    """``bubble_formula`` of ``method``'s schedule at ``n`` ranks, ``m`` micro-batches per batch and ``virtual``
    chunks per rank (interleaved)."""
    return bubble_formula(METHODS[method].schedule or method, n, m, chunks(method, virtual))


def _row(side: str, method: str, n: int, m: int, bubbles: list[float], times: list[float], ideal: float,
         virtual: int) -> dict:
    med = statistics.median(bubbles)
    v = chunks(method, virtual)
    want = formula(method, n, m, v)
    return {"side": side, "method": method, "torch": TORCH_PEERS[method] if side == "torch" else "-",
            "stages": n, "virtual": v, "microbatches": m, "formula": round(want, 4), "bubble_median": round(med, 4),
            "bubble_min": round(min(bubbles), 4), "bubble_max": round(max(bubbles), 4),
            "off_by": round(med - want, 4), "within_0.02": abs(med - want) <= 0.02,
            "ideal_s": round(ideal, 4), "median_s": round(statistics.median(times), 4)}


def _durations(f: float, i: float, w: float) -> dict[str, float]:
    return {"F": f, "I": i, "W": w, "B": i + w}


def measure_rayspec(method: str, n: int, m: int, f: float, i: float, w: float, repeats: int, width: int = 16,
                    transport: str = "p2p", virtual: int = 2) -> dict:
    """``method`` over ``n`` sleep stage actors on a ``RayExecutor`` (``virtual`` blocks each for interleaved): the
    measured bubble of each of ``repeats`` batches of ``m`` micro-batches (after one to warm up); needs
    ``ray.init()`` first."""
    from rayspec.exec.ray import RayExecutor

    v = chunks(method, virtual)
    schedule = _schedule(method, n, m, virtual)
    spec = StageSpec(lr=1e-3, optim=OptimSpec(momentum=0.9), group=m, loss_fn=_loss, trace=True)
    stages = make_stages([nn.Sequential(SplitSleepBlock(f, i, w)) for _ in range(n * v)], method, spec)
    x, y = torch.randn(8, width), torch.zeros(8)
    ex = RayExecutor(stages, method, transport=transport, cpus_per_stage=0.01, virtual=v)
    bubbles, times = [], []
    try:
        ex.run(schedule, [(x, y)] * m)  # warm-up
        for _ in range(repeats):
            before = [len(t) for t in ex.timeline()]
            t0 = time.perf_counter()
            ex.run(schedule, [(x, y)] * m)
            times.append(time.perf_counter() - t0)
            bubbles.append(measured_bubble([t[k:] for t, k in zip(ex.timeline(), before)], ranks=n))
    finally:
        ex.close()
    return _row(f"rayspec {transport}", method, n, m, bubbles, times, schedule.makespan(_durations(f, i, w)), virtual)


def _timed(stage: Any, timeline: list) -> None:
    """Wrap ``stage``'s action methods to append ``(kind, chunk, start, end)`` to ``timeline``."""
    def wrap(attr: str, kind_of: Any) -> None:
        inner = getattr(stage, attr)

        def timed(chunk: int, *a: Any, **kw: Any) -> Any:
            t0 = time.time()
            try:
                return inner(chunk, *a, **kw)
            finally:
                timeline.append((kind_of(kw), chunk, t0, time.time()))

        setattr(stage, attr, timed)

    wrap("forward_one_chunk", lambda kw: "F")
    wrap("backward_one_chunk", lambda kw: "B" if kw.get("full_backward", True) else "I")
    wrap("backward_weight_one_chunk", lambda kw: "W")


def _torch_rank(rank: int, world: int, port: int, methods: Sequence[str], ms: Sequence[int], f: float, i: float,
                w: float, repeats: int, width: int, results: Any, virtual: int = 2) -> None:
    """One rank: each (method, m) once to warm up, then ``repeats`` timed batches; puts ``(rank, {key: [..]})``."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out: dict[str, list] = {}
        for method in methods:
            for m in ms:
                x, y = torch.randn(8 * m, width), torch.zeros(8 * m)
                v = chunks(method, virtual)
                stages = [PipelineStage(nn.Sequential(SplitSleepBlock(f, i, w)), rank + world * j, world * v,
                                        torch.device("cpu")) for j in range(v)]
                timeline: list = []
                for stage in stages:
                    _timed(stage, timeline)
                cls = getattr(schedules, TORCH_PEERS[method])
                sched = cls(stages if method in ("zb1p", *CHUNKED) else stages[0], m, loss_fn=_loss)
                runs = []
                for r in range(repeats + 1):  # the first step infers shapes and warms up
                    timeline.clear()
                    dist.barrier()
                    t0 = time.perf_counter()
                    if rank == 0:
                        sched.step(x)
                    elif rank == world - 1:
                        sched.step(target=y)
                    else:
                        sched.step()
                    dist.barrier()
                    if r:
                        runs.append((time.perf_counter() - t0, list(timeline)))
                out[f"{method}/{m}"] = runs
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def measure_torch(methods: Sequence[str], n: int, ms: Sequence[int], f: float, i: float, w: float, repeats: int,
                  width: int = 16, timeout_s: float = 600.0, virtual: int = 2) -> list[dict]:
    """The torch peers of ``methods`` on the same sleep stages: one row per (method, m), as ``measure_rayspec``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_torch_rank, args=(r, n, port, methods, ms, f, i, w, repeats, width, results, virtual),
                         daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    try:
        per_rank = dict(results.get(timeout=timeout_s) for _ in range(n))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    rows = []
    for method in methods:
        for m in ms:
            runs = [per_rank[r][f"{method}/{m}"] for r in range(n)]
            times = [max(run[j][0] for run in runs) for j in range(repeats)]
            bubbles = [measured_bubble([run[j][1] for run in runs], ranks=n) for j in range(repeats)]
            ideal = _schedule(method, n, m, virtual).makespan(_durations(f, i, w))
            rows.append(_row("torch", method, n, m, bubbles, times, ideal, virtual))
    return rows
