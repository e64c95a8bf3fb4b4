"""GPU check: every transport and method the machine's GPUs allow trains on CUDA stage actors as the local executor
does on the CPU; samples/s, against torch.distributed.pipelining where there are two GPUs or more; stage memory.

    python -m benchmarks.gpu_check [--stages 2] [--transports all] [--updates 16] [--timed 8] [--device cuda]
                                   [--torch auto] [--out DIR] [--quick]

Placement: with at least ``--stages`` GPUs each stage actor holds one (``p2p_nccl``, ``p2p``, ``object_store``,
``nccl``, ``compiled``); with fewer the stages share them, ``1/stages`` of a GPU each, and the transports that
share a device run (``p2p`` through host memory, ``object_store``, ``compiled``), while the NCCL ones are
refused up front (a row says so). For each transport, one ``RayExecutor`` is reloaded with every method:

* equality: the weights after ``--updates`` updates of the tiny MLP and every loss, against ``LocalExecutor`` on
  the CPU from the same start, with TF32 off and cuDNN deterministic in the stage actors and here (tolerance
  1e-4: float summation order on the GPU differs);
* samples/s of ``gpipe`` and ``spectrain`` on the full MLP (batch 256; ``--timed`` updates after 2 of warm-up,
  timed until every stage's device is done), and each stage's peak GPU memory;
* ``torch gpipe``: ``torch.distributed.pipelining``'s GPipe on the same stages, a process and a GPU each, NCCL
  (``--torch auto``: with a GPU per stage).

A transport that fails is reported with its error and does not stop the others. ``--device cpu`` runs the same
checks with CPU stage actors: a dry run of this script without a GPU; ``--quick`` is that dry run, short
(``--device cpu --updates 4 --transports p2p,nccl --torch on``, written to a scratch folder). It prints one table, exits 1 if an
equality check fails, and writes ``gpu_check.json`` (to ``--out``, else ``benchmarks/results/`` on CUDA).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._shared.results import machine, results_dir, table, write
from rayspec.core.device import deterministic
from rayspec.core.methods import METHODS
from rayspec.core.optim import OptimSpec
from rayspec.core.schedule import build_schedule
from rayspec.core.stage import Stage
from rayspec.core.stage import make_stages as stages_for
from rayspec.core.stage_spec import StageSpec
from rayspec.core.transports import TRANSPORTS, resolve_transport
from rayspec.data import build_data
from rayspec.errors import ConfigError
from rayspec.exec import LocalExecutor
from rayspec.models import build_model
from rayspec.partition import split, uniform

COMPARED = ("vanilla", "gpipe", "async", "pipedream", "spectrain")
TIMED = ("gpipe", "spectrain")
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
BATCH, SMALL_BATCH, WARMUP = 256, 32, 2
QUICK = (("device", "cuda", "cpu"), ("updates", 16, 4), ("transports", "all", "p2p,nccl"), ("torch", "auto", "on"))
"""Options ``--quick`` sets when not given: (option, full run's default, quick run's)."""
COLUMNS = ["transport", "placement", "method", "equal", "max |w diff|", "samples/s", "vs torch", "peak MiB", "error"]


def make_stages(model: torch.nn.Sequential, method: str, n: int, group: int) -> list[Stage]:
    parts = split(copy.deepcopy(model), uniform(len(model), n))
    return stages_for(parts, method, StageSpec(lr=0.05, optim=OptimSpec(momentum=0.9, weight_decay=1e-4), group=group))


def batches(data: Any, updates: int, batch: int, group: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = data.train.tensors
    if updates * batch > len(x):
        raise ValueError(f"{updates} updates of {batch} samples need {updates * batch}; the data has {len(x)}")
    x, y = x[: updates * batch], y[: updates * batch]
    return list(zip(x.split(batch // group), y.split(batch // group)))


def run(executor: Any, model: torch.nn.Sequential, data: Any, method: str, n: int, updates: int,
        batch: int) -> tuple[float, list[float], dict[str, torch.Tensor]]:
    """Load fresh stages for ``method`` and train ``updates`` updates: seconds (until every device is done), losses,
    merged weights."""
    group = 4 if method == "gpipe" else 1
    stages = make_stages(model, method, n, group)
    if isinstance(executor, LocalExecutor):
        executor.stages, executor.method = stages, method
    else:
        executor.load(stages)
        executor.method = method
    schedule = build_schedule(METHODS[method].schedule, n, updates * group, group=group)
    feed = batches(data, updates, batch, group)
    t0 = time.perf_counter()
    losses = executor.run(schedule, iter(feed))
    executor.synchronize()
    return time.perf_counter() - t0, losses, executor.state_dict()


def check_transport(transport: str, args: argparse.Namespace, gpus: float, data: Any,
                    models: dict[str, torch.nn.Sequential]) -> list[dict[str, Any]]:
    from rayspec.exec.ray import RayExecutor

    n = args.stages
    rows: list[dict[str, Any]] = []
    ex = RayExecutor(make_stages(models["tiny"], "vanilla", n, 1), "vanilla", transport=transport,
                     cpus_per_stage=args.cpus_per_stage, gpus_per_stage=gpus)
    try:
        import ray

        ray.get([a.deterministic.remote(True) for a in ex.actors])
        place = _placement(ex, gpus)
        for method in COMPARED:
            _, losses, got = run(ex, models["tiny"], data, method, n, args.updates, SMALL_BATCH)
            _, ref_losses, want = run(LocalExecutor(make_stages(models["tiny"], method, n, 1), method), models["tiny"],
                                      data, method, n, args.updates, SMALL_BATCH)
            diff = max(float((got[k] - want[k]).abs().max()) for k in want)
            try:
                for k in want:
                    torch.testing.assert_close(got[k], want[k], **TOLERANCE)
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOLERANCE)
                equal = True
            except AssertionError:
                equal = False
            rows.append({"transport": ex.transport, "placement": place, "method": method, "equal": equal,
                         "max |w diff|": f"{diff:.1e}"})
        for method in TIMED:
            run(ex, models["full"], data, method, n, WARMUP, BATCH)  # warm-up: kernels, allocator, actor code paths
            seconds, _, _ = run(ex, models["full"], data, method, n, args.timed, BATCH)
            peak = max(st.get("cuda_peak_bytes", 0) for st in ex.stage_stats())
            for row in rows:
                if row["method"] == method:
                    row["samples/s"] = round(args.timed * BATCH / seconds)
                    row["peak MiB"] = round(peak / 2**20, 1) if peak else "-"
    finally:
        ex.close()
    return rows


def _placement(ex: Any, gpus: float) -> str:
    devices = sorted({st["device"] for st in ex.stage_stats()})
    share = "own GPU" if gpus >= 1 else f"{gpus:g} GPU" if gpus else "CPU"
    return f"{share} ({','.join(devices)})"


def torch_row(args: argparse.Namespace, data: Any, models: dict[str, torch.nn.Sequential]) -> dict[str, Any]:
    from benchmarks.gpu_check._torch_pipe import torch_gpipe_samples_per_s

    parts = split(copy.deepcopy(models["full"]), uniform(len(models["full"]), args.stages))
    got = torch_gpipe_samples_per_s(parts, batches(data, WARMUP + args.timed, BATCH, 1), 4, WARMUP, args.device)
    peak = max(got["peak_bytes"])
    return {"transport": "torch gpipe", "placement": "own GPU" if args.device == "cuda" else "CPU",
            "method": "gpipe", "samples/s": round(got["samples_per_s"]),
            "peak MiB": round(peak / 2**20, 1) if peak else "-"}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--transports", default=None,
                    help="comma-separated, or all that the placement allows (the default; --quick: p2p,nccl)")
    ap.add_argument("--updates", type=int, default=None, help="updates of the equality runs (batch 32; default 16, "
                    "--quick 4)")
    ap.add_argument("--timed", type=int, default=8, help="updates of the timed runs (batch 256)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda; --quick: cpu")
    ap.add_argument("--torch", choices=("auto", "on", "off"), default=None,
                    help="torch.distributed.pipelining on the same stages (auto, the default: with a GPU per stage; "
                    "--quick: on)")
    ap.add_argument("--cpus-per-stage", type=float, default=0.5)
    ap.add_argument("--out", default=None, help="folder for gpu_check.json (default: benchmarks/results on CUDA)")
    ap.add_argument("--quick", action="store_true", help="a short dry run on CPU stage actors, into a scratch folder")
    args = ap.parse_args(argv)
    for option, full, quick in QUICK:
        if getattr(args, option) is None:
            setattr(args, option, quick if args.quick else full)
    if args.quick and args.out is None:
        args.out = str(results_dir(True))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; run on a machine with a GPU, or --device cpu for a dry run", file=sys.stderr)
        return 2
    deterministic(True)
    torch.set_num_threads(1)
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    gpus_total = ray.cluster_resources().get("GPU", 0.0) if args.device == "cuda" else 0.0
    gpus = 0.0 if not gpus_total else 1.0 if gpus_total >= args.stages else 1.0 / args.stages
    data = build_data("synthetic_image", seed=0, train_size=max(2048, (WARMUP + args.timed) * BATCH), val_size=64)
    torch.manual_seed(0)
    models = {size: build_model("mlp", data.info, size) for size in ("tiny", "full")}
    names = [t for t in TRANSPORTS if t != "auto"] if args.transports == "all" else args.transports.split(",")
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        for transport in names:
            t0 = time.perf_counter()
            try:
                resolve_transport(transport, gpus)
                got = check_transport(transport, args, gpus, data, models)
            except ConfigError as err:  # refused for this placement, before any actor started
                got = [{"transport": transport, "method": "-", "error": f"refused: {err}"[:160]}]
            except Exception as err:  # noqa: BLE001 - reported, the next transport still runs
                got = [{"transport": transport, "method": "-", "error": f"{type(err).__name__}: {err}"[:300]}]
            rows += got
            print(f"{transport}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            if args.out:  # what was measured so far, should the run be cut short
                _save(args, rows, gpus_total, gpus)
        if args.torch == "on" or (args.torch == "auto" and gpus >= 1):
            try:
                rows.append(torch_row(args, data, models))
            except Exception as err:  # noqa: BLE001
                rows.append({"transport": "torch gpipe", "method": "gpipe", "error": f"{type(err).__name__}: {err}"[:300]})
    finally:
        ray.shutdown()
    reference = next((r.get("samples/s") for r in rows if r["transport"] == "torch gpipe"), None)
    for r in rows:
        if reference and r.get("samples/s") and r["method"] == "gpipe":
            r["vs torch"] = round(r["samples/s"] / reference, 2)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none"
    print(f"gpu_check: {args.stages} stages, {gpu} x {gpus_total:g}, {time.perf_counter() - started:.0f} s")
    print(table([{c: r.get(c, "") for c in COLUMNS} for r in rows], COLUMNS))
    if args.out:
        print(f"wrote {_save(args, rows, gpus_total, gpus)}")
    elif args.device == "cuda":
        print(f"wrote {write('gpu_check', _payload(args, rows, gpus_total, gpus))}")
    return 1 if any(r.get("equal") is False for r in rows) else 0


def _payload(args: argparse.Namespace, rows: list[dict[str, Any]], gpus_total: float, gpus: float) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none"
    return {"gpu": gpu, "gpus": gpus_total, "stages": args.stages, "gpus_per_stage": gpus, "rows": rows}


def _save(args: argparse.Namespace, rows: list[dict[str, Any]], gpus_total: float, gpus: float) -> Path:
    path = Path(args.out) / "gpu_check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = _payload(args, rows, gpus_total, gpus)
    path.write_text(json.dumps({"benchmark": "gpu_check", "machine": machine(), **payload}, indent=2))
    return path


if __name__ == "__main__":
    sys.exit(main())
