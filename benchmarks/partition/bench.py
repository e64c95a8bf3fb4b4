"""Partitioners: per-block profiles of every model, and the slowest stage under profile, uniform and parameters.

    python -m benchmarks.partition [--quick] [--models a,b] [--size full] [--stages 4] [--device cpu] [--holdout]

Each registered model is built at ``--size`` for CIFAR-like images (a batch of 32 ``(3, 32, 32)``
floats) or, when it takes text, for 256-token sequences (a batch of 32, ids in ``[1, 20000)``).
Its blocks are profiled (forward and backward time, parameters, output activation size), then
split into ``--stages`` stages three ways; the slowest stage's forward + backward time is the
pipeline's bottleneck. By default each split is scored on the profile it was chosen from, which
flatters ``profile`` a little (it is fitted to that profile's noise); ``--holdout`` scores all
three on a second, independent profiling pass. ``--quick``: size tiny, fewer repeats.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from benchmarks._shared.models import build
from benchmarks._shared.results import table, write
from rayspec.data import DataInfo
from rayspec.models import MODELS, ModelError
from rayspec.partition import BlockProfile, human_bytes, human_count, min_max_split, profile_blocks, uniform

BATCH = 32


def sample(info: DataInfo, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if info.kind == "image":
        return torch.randn(BATCH, *info.input_shape, generator=g)
    if not info.vocab_size:
        raise ModelError(f"text sample needs DataInfo.vocab_size, got {info.vocab_size}")
    return torch.randint(1, info.vocab_size, (BATCH, *info.input_shape), generator=g)


def stage_times(costs: list[float], balance: list[int]) -> list[float]:
    out, start = [], 0
    for count in balance:
        out.append(sum(costs[start : start + count]))
        start += count
    return out


def block_rows(model: torch.nn.Sequential, profiles: list[BlockProfile]) -> list[dict]:
    return [
        {"block": i, "type": type(block).__name__, "fwd ms": f"{p.forward_s * 1e3:.3f}", "bwd ms": f"{p.backward_s * 1e3:.3f}",
         "params": human_count(p.parameters), "output": human_bytes(p.output_bytes)}
        for i, (block, p) in enumerate(zip(model, profiles))
    ]


def run_model(name: str, size: str, stages: int, device: str, warmup: int, repeats: int, holdout: bool) -> dict:
    torch.manual_seed(0)
    model, info = build(name, size)
    x = sample(info)
    t0 = time.perf_counter()
    profiles = profile_blocks(model, x, device, warmup=warmup, repeats=repeats)
    profile_s = time.perf_counter() - t0
    print(f"\n== {name} ({size}, {info.kind}, {len(model)} blocks, profiled in {profile_s:.1f} s)")
    print(table(block_rows(model, profiles), ["block", "type", "fwd ms", "bwd ms", "params", "output"]))
    k = min(stages, len(model))
    costs = [p.seconds for p in profiles]
    balances = {
        "profile": min_max_split(costs, k),
        "uniform": uniform(len(model), k),
        "parameters": min_max_split([p.parameters for p in profiles], k),
    }
    score = costs
    if holdout:
        score = [p.seconds for p in profile_blocks(model, x, device, warmup=warmup, repeats=repeats)]
    slowest = {m: max(stage_times(score, b)) for m, b in balances.items()}
    rows = [{"partition": m, "balance": str(b), "slowest ms": f"{slowest[m] * 1e3:.2f}",
             "vs profile": f"{slowest[m] / slowest['profile']:.2f}x"} for m, b in balances.items()]
    print(f"{k} stages, slowest stage forward+backward ({'held-out profile' if holdout else 'same profile'}):")
    print(table(rows, ["partition", "balance", "slowest ms", "vs profile"]))
    return {
        "model": name, "size": size, "kind": info.kind, "input_shape": [BATCH, *info.input_shape],
        "blocks": [
            {"type": type(b).__name__, "forward_ms": p.forward_s * 1e3, "backward_ms": p.backward_s * 1e3,
             "parameters": p.parameters, "output_bytes": p.output_bytes}
            for b, p in zip(model, profiles)
        ],
        "stages": k, "scored_on": "holdout" if holdout else "same", "balance": balances,
        "slowest_stage_ms": {m: s * 1e3 for m, s in slowest.items()},
        "ratio_uniform_over_profile": slowest["uniform"] / slowest["profile"],
        "ratio_parameters_over_profile": slowest["parameters"] / slowest["profile"],
        "profile_s": profile_s,
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="size tiny and fewer repeats")
    ap.add_argument("--models", default="", help="comma-separated model names (default: all registered)")
    ap.add_argument("--size", default=None, help="model size (default full; tiny with --quick)")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per block (default 5; 2 with --quick)")
    ap.add_argument("--holdout", action="store_true", help="score the splits on a second, independent profile")
    args = ap.parse_args(argv)
    size = args.size or ("tiny" if args.quick else "full")
    repeats = args.repeats or (2 if args.quick else 5)
    warmup = 1 if args.quick else 2
    names = [n for n in args.models.split(",") if n] or sorted(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: {', '.join(unknown)} not registered; choose from {', '.join(sorted(MODELS))}")
    results, skipped = [], {}
    for name in names:
        try:
            results.append(run_model(name, size, args.stages, args.device, warmup, repeats, args.holdout))
        except ModelError as err:
            skipped[name] = str(err)
            print(f"\n== {name}: skipped: {err}")
    if results:
        print("\nsummary (slowest stage ms):")
        print(table([{"model": r["model"], "stages": r["stages"], **{m: f"{v:.2f}" for m, v in r["slowest_stage_ms"].items()},
                      "uniform/profile": f"{r['ratio_uniform_over_profile']:.2f}",
                      "parameters/profile": f"{r['ratio_parameters_over_profile']:.2f}"} for r in results],
                    ["model", "stages", "profile", "uniform", "parameters", "uniform/profile", "parameters/profile"]))
    path = write("partition", {"size": size, "device": args.device, "batch": BATCH, "warmup": warmup, "repeats": repeats,
                               "threads": torch.get_num_threads(), "models": results, "skipped": skipped}, quick=args.quick)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
