"""Training throughput (samples/s) of every method, data parallelism included, through ``rayspec.training.train``.

    python -m benchmarks.throughput [--quick] [--models mlp,vgg16] [--stages 2,4] [--methods ...] [--steps 40]
                                    [--transports auto,p2p] [--out throughput]

Every trial is a real run on Ray, the same as ``python -m rayspec.train``: ``pipeline.method=M`` with
``pipeline.stages=N`` stage actors (``dataparallel``: N Ray Train workers), the config composed from
``conf/`` with ``train.max_steps=--steps``, ``train.eval_every=0``, a small validation split, and
``pipeline.cpus_per_stage`` = the Ray cluster's CPUs / N (2/N on a 2-core machine), so every method
gets the same CPUs. On a machine with CUDA each stage or worker gets ``pipeline.gpus_per_stage=1``
(``GPUs/N`` when there are fewer GPUs than stages; ``dataparallel`` then is skipped: NCCL needs one GPU
per worker). Image models train on ``data=synthetic_image`` with ``data.image_size=32``, text models on
``data=synthetic_text``. The figure is the run summary's ``samples_per_s``: updates x batch over the
time the pipeline (or the Ray Train loop) ran, excluding start-up and evaluation but including the
pipeline's fill and drain; ``steady_samples_per_s`` in the result file leaves out the first logging
window too. Ray starts once for all trials, which run one at a time.

Defaults for a 2-core CPU machine: ``--quick`` = mlp tiny on 2 stages, 20 updates; otherwise mlp small,
vgg16 tiny and resnet50 tiny on 2 and 4 stages, 40 updates. Short runs on a shared small machine are
noisy: compare the methods' ratios to ``dataparallel`` within one run. ``--transports`` gives one row per
``pipeline.transport`` (``dataparallel`` runs once per row group). Results: ``benchmarks/results/OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import logging.handlers
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._shared.processes import start_ray
from benchmarks._shared.results import table, write
from rayspec.config import from_mapping
from rayspec.config.compose import compose
from rayspec.core.methods import METHODS
from rayspec.models import MODELS, SIZES

ORDER = ("dataparallel", "vanilla", "gpipe", "async", "pipedream", "spectrain")
TEXT_MODELS = frozenset({"transformer", "residual_lstm"})
DEFAULT_SIZE = {"mlp": "small"}  # others: tiny (what a 2-core CPU trains in seconds)


def compose_config(overrides: Sequence[str]) -> dict[str, Any]:
    """The run configuration with ``overrides``, as a plain resolved mapping."""
    return compose(list(overrides))


def trial_overrides(model: str, size: str, method: str, stages: int, *, steps: int, batch: int, cpus: float,
                    gpus: float, image_size: int, transport: str = "auto") -> list[str]:
    """The training overrides of one trial (what ``python -m rayspec.train`` would take)."""
    data = ["data=synthetic_text"] if model in TEXT_MODELS else ["data=synthetic_image", f"data.image_size={image_size}"]
    samples = max(batch * steps, 2 * batch)
    return [
        f"model={model}", f"model.size={size}", *data, f"data.train_size={samples}", "data.val_size=64",
        f"pipeline.method={method}", f"pipeline.stages={stages}", f"pipeline.cpus_per_stage={cpus:g}",
        f"pipeline.gpus_per_stage={gpus:g}", "pipeline.executor=ray", f"pipeline.transport={transport}",
        f"train.max_steps={steps}",
        f"train.batch_size={batch}", f"train.log_every={max(1, steps // 4)}", "train.eval_every=0",
        "++train.val_samples=64", "ray.log_to_driver=false",
    ]


def steady_rate(run_dir: Path, batch: int) -> float | None:
    """Samples/s between the first and the last logged step of ``metrics.jsonl`` (the first window left out)."""
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    if len(steps) < 2 or steps[-1]["elapsed_s"] <= steps[0]["elapsed_s"]:
        return None
    return (steps[-1]["step"] - steps[0]["step"]) * batch / (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"])


def run_trial(overrides: Sequence[str]) -> dict[str, Any]:
    """Train one trial into a temporary run directory; its throughput figures, or its error."""
    from rayspec.training import run_training
    from rayspec.training.console import relayed_to

    lines = logging.handlers.BufferingHandler(capacity=1 << 20)  # the trial's log lines, for an error's tail
    t0 = time.perf_counter()
    try:
        config = from_mapping(compose_config(overrides))
        with tempfile.TemporaryDirectory() as run_dir, relayed_to(lines):
            summary = run_training(config, run_dir)
            steady = steady_rate(Path(run_dir), config.train.batch_size)
    except Exception as err:  # one failed trial must not end the benchmark
        tail = [lines.format(record) for record in lines.buffer[-5:]]
        return {"error": f"{type(err).__name__}: {err}", "log_tail": tail, "wall_s": time.perf_counter() - t0}
    return {"samples_per_s": summary["samples_per_s"], "steady_samples_per_s": steady,
            "final_train_loss": summary["final_train_loss"], "bytes_per_update": summary.get("bytes_per_update"),
            "bubble_fraction": summary.get("bubble_fraction"), "wall_s": time.perf_counter() - t0}


def _ints(text: str, name: str, ap: argparse.ArgumentParser) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s]
    except ValueError:
        ap.error(f"{name}={text!r} must be comma-separated integers, e.g. {name} 2,4")
    if not values or min(values) < 1:
        ap.error(f"{name}={text!r} needs at least one count >= 1")
    return values


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="mlp tiny on 2 stages, 20 updates")
    ap.add_argument("--models", default=None, help="comma-separated model names (default mlp,vgg16,resnet50)")
    ap.add_argument("--size", default=None, choices=SIZES, help="size of every model (default: mlp small, others tiny)")
    ap.add_argument("--stages", default=None, help="comma-separated stage counts (default 2,4; 2 with --quick)")
    ap.add_argument("--methods", default=",".join(ORDER), help="comma-separated methods (default: all)")
    ap.add_argument("--steps", type=int, default=None, help="updates per trial (default 40; 20 with --quick)")
    ap.add_argument("--batch", type=int, default=64, help="samples per update (train.batch_size)")
    ap.add_argument("--image-size", type=int, default=32, help="data.image_size of the image models")
    ap.add_argument("--transports", default="auto", help="comma-separated pipeline.transport values, one row each")
    ap.add_argument("--out", default="throughput", help="result name: benchmarks/results/OUT.json")
    args = ap.parse_args(argv)
    names = [n for n in (args.models or ("mlp" if args.quick else "mlp,vgg16,resnet50")).split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: {', '.join(unknown)} not registered; choose from {', '.join(sorted(MODELS))}")
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: {', '.join(bad)} unknown; choose from {', '.join(METHODS)}")
    stage_counts = _ints(args.stages or ("2" if args.quick else "2,4"), "--stages", ap)
    steps = args.steps or (20 if args.quick else 40)
    if steps < 1 or args.batch < 1:
        ap.error(f"--steps={steps} and --batch={args.batch} must be >= 1")
    transports = [t for t in args.transports.split(",") if t]
    sizes = {n: args.size or ("tiny" if args.quick else DEFAULT_SIZE.get(n, "tiny")) for n in names}

    import ray

    start_ray()
    cluster = ray.cluster_resources()
    total_cpus = cluster.get("CPU", 1.0)
    total_gpus = int(cluster.get("GPU", 0)) if torch.cuda.is_available() else 0
    results: list[dict[str, Any]] = []
    try:
        for name in names:
            for n in stage_counts:
                cpus = max(0.01, math.floor(total_cpus / n * 100) / 100)
                gpus = 0.0 if not total_gpus else (1.0 if total_gpus >= n else total_gpus / n)
                dataparallel: dict[str, Any] | None = None  # one run per model and N, whatever the transport
                for transport in transports:
                    row: dict[str, Any] = {"model": name, "size": sizes[name], "stages": n, "transport": transport,
                                           "cpus_per_stage": cpus, "gpus_per_stage": gpus, "methods": {}}
                    for method in methods:
                        if method == "dataparallel" and dataparallel is not None:
                            row["methods"][method] = dataparallel
                            continue
                        if method == "dataparallel" and 0 < total_gpus < n:
                            row["methods"][method] = {"error": f"skipped: {n} NCCL workers need {n} GPUs, "
                                                               f"the cluster has {total_gpus}"}
                            continue
                        over = trial_overrides(name, sizes[name], method, n, steps=steps, batch=args.batch, cpus=cpus,
                                               gpus=gpus if method != "dataparallel" else float(bool(gpus)),
                                               image_size=args.image_size, transport=transport)
                        res = run_trial(over)
                        row["methods"][method] = {**res, "overrides": over}
                        if method == "dataparallel":
                            dataparallel = row["methods"][method]
                        shown = (f"{res['samples_per_s']:.1f} samples/s" if "error" not in res
                                 else f"failed: {res['error'][:300]}")
                        print(f"{name} ({sizes[name]}) N={n} {method} ({transport}): {shown} ({res['wall_s']:.0f} s)",
                              flush=True)
                    results.append(row)
    finally:
        ray.shutdown()

    def rate(row: dict, method: str) -> float | None:
        res = row["methods"].get(method, {})
        return res.get("samples_per_s")

    rows = []
    for row in results:
        base = rate(row, "dataparallel")
        cells: dict[str, str] = {"model": f"{row['model']} ({row['size']})", "N": str(row["stages"]),
                                 "transport": row["transport"]}
        for method in methods:
            r = rate(row, method)
            cells[method] = "-" if r is None else f"{r:.0f}"
        for method in methods:
            r = rate(row, method)
            if method != "dataparallel" and "dataparallel" in methods:
                cells[f"{method}/dp"] = "-" if r is None or not base else f"{r / base:.2f}"
            if r is not None and base:
                row["methods"][method]["ratio_to_dataparallel"] = r / base
        rows.append(cells)
    device = "GPU" if total_gpus else "CPU"
    print(f"\nsamples/s ({steps} updates of {args.batch} samples per trial, {device}, {total_cpus:g} CPUs shared "
          "among the stages; method/dp = that method's samples/s over dataparallel's in the same row):")
    if rows:
        print(table(rows, list(rows[0])))
    path = write(args.out, {"steps": steps, "batch": args.batch, "image_size": args.image_size,
                                "cpus": total_cpus, "gpus": total_gpus, "methods": methods, "results": results}, quick=args.quick)
    print(f"\nwrote {path}")
    trials = [res for row in results for res in row["methods"].values()]
    if trials and all("error" in res for res in trials):
        raise SystemExit(f"every trial failed; the first: {trials[0]['error']}")


if __name__ == "__main__":
    main()
