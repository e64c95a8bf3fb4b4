"""GPU check: stage actors computing on CUDA train like the local executor on the CPU, and how fast they go.

    python -m benchmarks.gpu_check [--stages 2] [--transports object_store,nccl,compiled] [--updates 16] [--device cuda]

For each transport, one ``RayExecutor`` whose stage actors hold a GPU each (a fraction of one when the
machine has fewer GPUs than stages; then they share it) is reloaded with every method in turn:

* equality: the weights after ``--updates`` updates of the tiny MLP and the losses, against
  ``LocalExecutor`` on the CPU from the same start (TF32 off; tolerance 1e-4, float summation order
  on the GPU differs);
* throughput: samples/s of ``gpipe`` and ``spectrain`` on the full MLP (batch 256), timed after a
  warm-up run, with the same stages on the CPU through ``LocalExecutor`` in this process as the
  reference figure (ratio = GPU / CPU).

A transport that cannot run on this machine (``nccl`` needs a GPU per stage: two ranks of one
communicator on one device are refused) is reported with its error and does not stop the others.
``--device cpu`` runs the same checks with CPU stage actors: a dry run of this script on a machine
without a GPU (it writes no result file). It prints a table, exits 1 if an equality check fails, and
writes ``benchmarks/results/gpu_check.json``. On one GPU it should take 2-3 minutes: Ray's start, the
actors' CUDA start and 14 short runs per transport (the dry run takes 30 s on 2 CPU cores); it has not
yet run on a GPU.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Any

import torch

from benchmarks._common import table, write
from rayspec.core.methods import METHODS
from rayspec.core.schedule import build_schedule
from rayspec.core.stage import Stage
from rayspec.core.stage import make_stages as stages_for
from rayspec.data import build_data
from rayspec.exec import LocalExecutor
from rayspec.models import build_model
from rayspec.partition import split, uniform

COMPARED = ("vanilla", "gpipe", "async", "pipedream", "spectrain")
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def make_stages(model: torch.nn.Sequential, method: str, n: int, group: int) -> list[Stage]:
    parts = split(copy.deepcopy(model), uniform(len(model), n))
    return stages_for(parts, method, lr=0.05, momentum=0.9, weight_decay=1e-4, group=group)


def batches(data: Any, updates: int, batch: int, group: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = data.train.tensors
    x, y = x[: updates * batch], y[: updates * batch]
    return list(zip(x.split(batch // group), y.split(batch // group)))


def run(executor: Any, model: torch.nn.Sequential, data: Any, method: str, n: int, updates: int,
        batch: int) -> tuple[float, list[float], dict[str, torch.Tensor]]:
    """Load fresh stages for ``method`` and train ``updates`` updates: seconds, losses, merged weights."""
    group = 4 if method == "gpipe" else 1
    stages = make_stages(model, method, n, group)
    if isinstance(executor, LocalExecutor):
        executor.stages, executor.method = stages, method
    else:
        executor.load(stages)
        executor.method = method
    schedule = build_schedule(METHODS[method].schedule, n, updates * group, group=group)
    t0 = time.perf_counter()
    losses = executor.run(schedule, iter(batches(data, updates, batch, group)))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, losses, executor.state_dict()


def check_transport(transport: str, args: argparse.Namespace, gpus: float) -> list[dict[str, Any]]:
    from rayspec.exec.ray import RayExecutor

    n = args.stages
    tiny_data = build_data("synthetic_image", seed=0, train_size=2048, val_size=64)
    torch.manual_seed(0)
    tiny = build_model("mlp", tiny_data.info, "tiny")
    full = build_model("mlp", tiny_data.info, "full")
    rows: list[dict[str, Any]] = []
    ex = RayExecutor(make_stages(tiny, "vanilla", n, 1), "vanilla", transport=transport, cpus_per_stage=0.5,
                     gpus_per_stage=gpus)
    try:
        devices = ray_devices(ex)
        for method in COMPARED:
            _, losses, got = run(ex, tiny, tiny_data, method, n, args.updates, 32)
            _, ref_losses, want = run(LocalExecutor(make_stages(tiny, method, n, 1), method), tiny, tiny_data,
                                      method, n, args.updates, 32)
            diff = max(float((got[k] - want[k]).abs().max()) for k in want)
            try:
                for k in want:
                    torch.testing.assert_close(got[k], want[k], **TOLERANCE)
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOLERANCE)
                equal = True
            except AssertionError:
                equal = False
            rows.append({"transport": transport, "method": method, "stage devices": devices, "equal": equal,
                         "max |w diff|": f"{diff:.1e}"})
        for method in ("gpipe", "spectrain"):
            run(ex, full, tiny_data, method, n, 2, 256)  # warm-up: kernels, allocator, actor code paths
            seconds, _, _ = run(ex, full, tiny_data, method, n, args.timed, 256)
            local_s, _, _ = run(LocalExecutor(make_stages(full, method, n, 1), method), full, tiny_data, method, n,
                                args.timed, 256)
            for row in rows:
                if row["method"] == method:
                    row["samples/s"] = round(args.timed * 256 / seconds)
                    row["cpu local samples/s"] = round(args.timed * 256 / local_s)
                    row["vs cpu local"] = round(local_s / seconds, 2)
    finally:
        ex.close()
    return rows


def ray_devices(ex: Any) -> str:

    return ",".join(st["device"] for st in ex.stage_stats())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--transports", default="object_store,nccl,compiled")
    ap.add_argument("--updates", type=int, default=16, help="updates of the equality runs")
    ap.add_argument("--timed", type=int, default=20, help="updates of the timed runs (batch 256)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; run on a machine with a GPU, or --device cpu for a dry run", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(1)
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    gpus_total = ray.cluster_resources().get("GPU", 0.0)
    gpus = 0.0 if args.device == "cpu" else min(1.0, gpus_total / args.stages)
    columns = ["transport", "method", "stage devices", "equal", "max |w diff|", "samples/s", "cpu local samples/s",
               "vs cpu local", "error"]
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none"
    rows: list[dict[str, Any]] = []
    try:
        for transport in args.transports.split(","):
            if transport == "nccl" and args.device == "cpu":
                transport = "gloo"  # the CPU counterpart of a two-sided RDT
            t0 = time.perf_counter()
            try:
                got = check_transport(transport, args, gpus)
            except Exception as err:  # noqa: BLE001 - reported, the next transport still runs
                got = [{"transport": transport, "method": "-", "error": f"{type(err).__name__}: {err}"[:300]}]
            rows += got
            # each transport's rows as soon as it is done: a run cut short keeps what it measured
            print(f"{transport}: {time.perf_counter() - t0:.0f} s", flush=True)
            print(table([{c: r.get(c, "") for c in columns} for r in got], columns), flush=True)
            if args.device == "cuda":
                write("gpu_check", {"gpu": gpu, "gpus": gpus_total, "stages": args.stages, "rows": rows})
    finally:
        ray.shutdown()
    print(table([{c: r.get(c, "") for c in columns} for r in rows], columns))
    if args.device == "cuda":
        print(f"wrote {write('gpu_check', {'gpu': gpu, 'gpus': gpus_total, 'stages': args.stages, 'rows': rows})}")
    return 1 if any(r.get("equal") is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
