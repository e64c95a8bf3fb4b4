"""Pipeline efficiency: ideal schedule makespan over measured time, with sleep-timed stages and with real compute.

    python -m benchmarks.efficiency [--quick] [--stages 2,4] [--transports p2p,compiled,object_store] [--no-torch]
                                    [--microbatches 32] [--forward-ms 20] [--backward-ms 40]
                                    [--real-stages 2] [--real-model mlp] [--real-size full] [--real-batch 64]
    python -m benchmarks.efficiency --schedules gpipe,1f1b,zb1p,interleaved [--microbatches 8,16] [--stages 4]

``--schedules``: each schedule's measured bubble against its formula, rayspec beside torch
(``benchmarks.efficiency.schedules``), into ``efficiency_schedules.json``; the rest of this text is the default mode.

Sleep-timed: each stage is one ``SleepBlock`` (F and B sleep, so CPU contention on a small
machine does not mix into the figure); what remains above the ideal makespan is framework
overhead on the critical path. The same sleep stages also run under
``torch.distributed.pipelining`` in the same run (``transport`` ``torch``: one spawned process
per stage, gloo, ``ScheduleGPipe`` / ``Schedule1F1B`` over one batch of M micro-batches, whose
ideal makespan is the same), as the peer to compare with.

Real compute: a real model cut into ``--real-stages`` stages (one thread per stage actor; keep
the stage count at most the number of cores, or the stages share cores and cannot overlap). The
ideal makespan is the schedule's, with each stage's forward and backward times as that stage
measured them in the same run (its busy seconds per action), so the ratio again isolates what the
framework adds: waiting on transfers and on the driver. Repeated runs; best and median reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from benchmarks._shared.processes import free_port, start_ray
from benchmarks._shared.results import table, write
from benchmarks.efficiency import schedules as bubbles
from benchmarks.efficiency._sleep import SleepBlock
from rayspec.core.optim import OptimSpec
from rayspec.core.schedule import build_schedule
from rayspec.core.stage import Stage
from rayspec.core.stage_spec import StageSpec
from rayspec.exec.ray import RayExecutor


def _stages(n: int, f: float, b: float, group: int) -> list[Stage]:
    spec = StageSpec(lr=1e-3, optim=OptimSpec(momentum=0.9), group=group, loss_fn=lambda out, y: out.float().mean())
    return [Stage(nn.Sequential(SleepBlock(f, b)), spec, k, n) for k in range(n)]


def measure(schedule_name: str, n: int, m: int, f: float, b: float, repeats: int, width: int,
            transport: str = "object_store") -> dict:
    group = m if schedule_name == "gpipe" else 1
    schedule = build_schedule(schedule_name, n, m, group=group)
    ideal = schedule.makespan({"F": f, "B": b})
    x, y = torch.randn(8, width), torch.zeros(8)
    ex = RayExecutor(_stages(n, f, b, group), "async", transport=transport, cpus_per_stage=0.01)
    times = []
    try:
        ex.run(schedule, [(x, y)] * m)  # warm-up (and, compiled, the graph's compilation)
        for _ in range(repeats):
            t0 = time.perf_counter()
            ex.run(schedule, [(x, y)] * m)
            times.append(time.perf_counter() - t0)
    finally:
        ex.close()
    return _sleep_row(schedule_name, transport, n, m, ideal, times)


def _sleep_row(schedule_name: str, transport: str, n: int, m: int, ideal: float, times: list[float]) -> dict:
    """One row of the sleep-timed table from the measured seconds of its repeats."""
    best, med = min(times), statistics.median(times)
    return {"schedule": schedule_name, "transport": transport, "stages": n, "microbatches": m, "ideal_s": round(ideal, 4),
            "best_s": round(best, 4), "median_s": round(med, 4), "efficiency_best": round(ideal / best, 3),
            "efficiency_median": round(ideal / med, 3),
            "overhead_ms_per_action": round((med - ideal) / (2 * m) * 1e3, 2)}


def _torch_rank(rank: int, world: int, port: int, f: float, b: float, m: int, width: int, repeats: int,
                results: Any) -> None:
    """One ``torch.distributed.pipelining`` rank of the sleep pipeline: each schedule once to warm up, then
    ``repeats`` timed steps between barriers; rank 0 reports ``{schedule: [seconds]}``."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x, y = torch.randn(8 * m, width), torch.zeros(8 * m)
        out: dict[str, list[float]] = {}
        for name, cls in (("1f1b", Schedule1F1B), ("gpipe", ScheduleGPipe)):
            stage = PipelineStage(nn.Sequential(SleepBlock(f, b)), rank, world, torch.device("cpu"))
            schedule = cls(stage, m, loss_fn=lambda o, t: o.float().mean())
            times = []
            for i in range(repeats + 1):  # the first step infers shapes and warms up
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    schedule.step(x)
                elif rank == world - 1:
                    schedule.step(target=y)
                else:
                    schedule.step()
                dist.barrier()
                if i:
                    times.append(time.perf_counter() - t0)
            out[name] = times
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


def measure_torch(n: int, m: int, f: float, b: float, repeats: int, width: int, timeout_s: float = 600.0) -> list[dict]:
    """The sleep pipeline under ``torch.distributed.pipelining``: one row per schedule, as ``measure`` gives."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_torch_rank, args=(r, n, port, f, b, m, width, repeats, results), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    try:
        times = results.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [_sleep_row(name, "torch", n, m, build_schedule(name, n, m, group=m if name == "gpipe" else 1)
                       .makespan({"F": f, "B": b}), ts) for name, ts in times.items()]


def measure_real(schedule_name: str, n: int, m: int, model_name: str, size: str, batch: int, repeats: int,
                 transport: str = "object_store") -> dict:
    from rayspec.data import DataInfo
    from rayspec.models import build_model
    from rayspec.partition import by_parameters, split

    torch.manual_seed(0)
    info = DataInfo("image", 10, (3, 32, 32))
    model = build_model(model_name, info, size)
    group = m if schedule_name == "gpipe" else 1
    parts = split(model, by_parameters(model, n))
    spec = StageSpec(lr=1e-3, optim=OptimSpec(momentum=0.9), group=group)
    stages = [Stage(p, spec, k, n) for k, p in enumerate(parts)]
    schedule = build_schedule(schedule_name, n, m, group=group)
    x, y = torch.randn(batch, *info.input_shape), torch.randint(10, (batch,))
    ex = RayExecutor(stages, "async", transport=transport, cpus_per_stage=1.0)
    times, ratios = [], []
    try:
        ex.run(schedule, [(x, y)] * m)  # warm-up (and, compiled, the graph's compilation)
        for _ in range(repeats):
            before = ex.stage_stats()
            t0 = time.perf_counter()
            ex.run(schedule, [(x, y)] * m)
            took = time.perf_counter() - t0
            after = ex.stage_stats()
            durations = {(k, kind): (a["busy_s"][kind] - b["busy_s"][kind]) / (a["actions"][kind] - b["actions"][kind])
                         for k, (a, b) in enumerate(zip(after, before)) for kind in "FB"}
            times.append(took)
            ratios.append((schedule.makespan(durations), took, durations))
    finally:
        ex.close()
    ideal, took, durations = sorted(ratios, key=lambda r: r[0] / r[1])[len(ratios) // 2]  # the median run
    best = max(r[0] / r[1] for r in ratios)
    ms = {f"{kind}{k}_ms": round(durations[(k, kind)] * 1e3, 2) for k in range(n) for kind in "FB"}
    return {"schedule": schedule_name, "transport": transport, "model": f"{model_name}/{size}", "stages": n, "microbatches": m,
            "batch": batch, "ideal_s": round(ideal, 4), "median_s": round(took, 4),
            "efficiency_median": round(ideal / took, 3), "efficiency_best": round(best, 3),
            "overhead_ms_per_action": round((took - ideal) / (2 * m) * 1e3, 2), **ms}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stages", default=None, help="stage counts of the sleep-timed runs (default 2,4; --schedules: 4)")
    ap.add_argument("--transports", default="p2p,compiled,object_store")
    ap.add_argument("--microbatches", default=None, help="micro-batches per run (default 32; --schedules: 8,16)")
    ap.add_argument("--schedules", default=None,
                    help="methods whose bubble to measure against its formula, beside torch's (e.g. gpipe,1f1b,zb1p,"
                         "interleaved)")
    ap.add_argument("--virtual", type=int, default=2, help="--schedules: blocks per rank of interleaved")
    ap.add_argument("--out", default=None,
                    help="result name: benchmarks/results/OUT.json (default efficiency, --schedules: efficiency_schedules)")
    ap.add_argument("--forward-ms", type=float, default=20.0)
    ap.add_argument("--backward-ms", type=float, default=40.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kib", default="16,512", help="activation sizes per micro-batch in KiB")
    ap.add_argument("--no-torch", dest="torch", action="store_false",
                    help="skip the torch.distributed.pipelining rows of the sleep-timed runs")
    ap.add_argument("--real-stages", type=int, default=2, help="stages of the real-compute run (<= CPU cores)")
    ap.add_argument("--real-model", default="mlp")
    ap.add_argument("--real-size", default="full")
    ap.add_argument("--real-batch", type=int, default=64)
    args = ap.parse_args(argv)
    if args.schedules:
        return schedule_bubbles(args)
    m, repeats = (8, 2) if args.quick else (int(args.microbatches or 32), args.repeats)
    start_ray()
    rows = []
    transports = [t for t in args.transports.split(",") if t]
    f, b = args.forward_ms / 1e3, args.backward_ms / 1e3
    for n in (int(v) for v in (args.stages or "2,4").split(",")):
        for kib in (int(v) for v in args.kib.split(",")):
            width = kib * 1024 // 32
            peer = {r["schedule"]: r for r in measure_torch(n, m, f, b, repeats, width)} if args.torch else {}
            for s in ("1f1b", "gpipe"):
                for transport in transports:
                    rows.append({"activation_kib": kib, **measure(s, n, m, f, b, repeats, width, transport)})
                if s in peer:
                    rows.append({"activation_kib": kib, **peer[s]})
    cols = ["activation_kib", "schedule", "transport", "stages", "microbatches", "ideal_s", "median_s", "efficiency_median",
            "efficiency_best", "overhead_ms_per_action"]
    print("sleep-timed stages:")
    print(table(rows, cols))
    real = [measure_real(s, args.real_stages, m, args.real_model, "tiny" if args.quick else args.real_size,
                         args.real_batch, repeats, transport) for s in ("1f1b", "gpipe") for transport in transports]
    print(f"real compute ({real[0]['model']}, batch {args.real_batch}, one thread per stage):")
    print(table(real, ["schedule", "transport", "model", "stages", "microbatches", "ideal_s", "median_s", "efficiency_median",
                       "efficiency_best", "overhead_ms_per_action", *[k for k in real[0] if k.endswith("_ms")]]))
    path = write(args.out or "efficiency", {"forward_ms": args.forward_ms, "backward_ms": args.backward_ms,
                                "rows": rows, "real": real}, quick=args.quick)
    print(f"wrote {path}")


def schedule_bubbles(args: argparse.Namespace) -> None:
    """``--schedules``: rayspec's and torch's measured bubble of each schedule against its formula, one run."""
    methods = [s for s in args.schedules.split(",") if s]
    n = int((args.stages or "4").split(",")[-1])
    ms = [int(v) for v in (args.microbatches or "8,16").split(",")]
    repeats = 1 if args.quick else args.repeats
    if args.quick:
        ms = [min(ms)]
    f, i = args.forward_ms / 1e3, args.backward_ms / 2e3
    load = os.getloadavg()
    rows = bubbles.measure_torch(methods, n, ms, f, i, i, repeats, virtual=args.virtual) if args.torch else []
    start_ray()
    rows += [bubbles.measure_rayspec(s, n, m, f, i, i, repeats, virtual=args.virtual) for s in methods for m in ms]
    rows.sort(key=lambda r: (r["microbatches"], methods.index(r["method"]), r["side"] != "torch"))
    print(f"N={n} sleep stages, F={args.forward_ms:g} ms, I=W={args.backward_ms / 2:g} ms (B=I+W), "
          f"{repeats} batches each; bubble = idle/busy of the ranks:")
    print(table(rows, ["microbatches", "method", "side", "torch", "virtual", "formula", "bubble_median", "bubble_min",
                       "bubble_max", "off_by", "ideal_s", "median_s"]))
    path = write(args.out or "efficiency_schedules", {
        "forward_ms": args.forward_ms, "input_ms": args.backward_ms / 2, "weight_ms": args.backward_ms / 2,
        "stages": n, "virtual": args.virtual, "repeats": repeats, "loadavg_before": [round(v, 2) for v in load],
        "loadavg_after": [round(v, 2) for v in os.getloadavg()], "cpu_count": os.cpu_count(), "rows": rows},
        quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
