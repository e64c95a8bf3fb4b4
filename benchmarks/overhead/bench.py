"""Framework overhead: time per micro-batch per hop of ``RayExecutor`` against a bare chain of Ray actor calls.

    python -m benchmarks.overhead [--quick] [--stages 4] [--microbatches 64] [--kib 256,4096]

Both move the same tensors through the same number of actors, forward then backward, with all
micro-batches submitted at once: the bare chain's actors just return a fresh tensor of the
input's size, rayspec's stages run a one-parameter scaling block with its optimizer step
(1F1B, asynchronous). A hop is one actor call that receives one activation or gradient:
``2 * N * M`` hops per run. Reported: ms per hop each way, and the ratio rayspec / bare.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import ray
import torch
from torch import nn

from benchmarks._shared.processes import start_ray
from benchmarks._shared.results import table, write
from rayspec.core.optim import OptimSpec
from rayspec.core.schedule import build_schedule
from rayspec.core.stage import Stage
from rayspec.core.stage_spec import StageSpec
from rayspec.exec.ray import RayExecutor


@ray.remote(num_cpus=0.01)
class Bare:
    def fwd(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    def bwd(self, g: torch.Tensor) -> torch.Tensor:
        return g * 1.0


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def bare_chain(actors: list, x: torch.Tensor, m: int) -> float:
    t0 = time.perf_counter()
    outs = []
    for _ in range(m):
        r = x
        for a in actors:
            r = a.fwd.remote(r)
        for a in reversed(actors):
            r = a.bwd.remote(r)
        outs.append(r)
    ray.get(outs)
    return time.perf_counter() - t0


def rayspec_chain(ex: RayExecutor, x: torch.Tensor, m: int, n: int) -> float:
    schedule = build_schedule("1f1b", n, m)
    y = torch.zeros(x.shape[0])
    t0 = time.perf_counter()
    ex.run(schedule, [(x, y)] * m)
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--kib", default="256,4096", help="activation sizes in KiB")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    n = args.stages
    m, repeats = (16, 2) if args.quick else (args.microbatches, args.repeats)
    start_ray()
    env = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}
    bare = [Bare.options(runtime_env=env).remote() for _ in range(n)]
    spec = StageSpec(lr=1e-6, optim=OptimSpec(momentum=0.9), loss_fn=lambda o, y: o.mean())
    stages = [Stage(nn.Sequential(Scale()), spec, k, n) for k in range(n)]
    ex = RayExecutor(stages, "async", transport="object_store", cpus_per_stage=0.01)
    rows = []
    try:
        for kib in (int(v) for v in args.kib.split(",")):
            x = torch.randn(8, kib * 1024 // 32)
            bare_chain(bare, x, 4), rayspec_chain(ex, x, 4, n)  # warm-up
            tb, tr = [], []
            for _ in range(repeats):  # interleaved, so drifts in machine load hit both alike
                tb.append(bare_chain(bare, x, m))
                tr.append(rayspec_chain(ex, x, m, n))
            hops = 2 * n * m
            b, r = statistics.median(tb) / hops * 1e3, statistics.median(tr) / hops * 1e3
            rows.append({"activation_kib": kib, "bare_ms_per_hop": round(b, 3), "rayspec_ms_per_hop": round(r, 3),
                         "ratio": round(r / b, 3)})
    finally:
        ex.close()
    print(table(rows, ["activation_kib", "bare_ms_per_hop", "rayspec_ms_per_hop", "ratio"]))
    print(f"wrote {write('overhead', {'stages': n, 'microbatches': m, 'repeats': repeats, 'rows': rows}, quick=args.quick)}")


if __name__ == "__main__":
    main()
