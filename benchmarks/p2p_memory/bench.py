"""What a long segment costs a ``pipeline.transport=p2p`` stage in memory: messages waited on as they are
received (``P2POp.retire``) against held until the segment ends.

    python -m benchmarks.p2p_memory [--batches 4,64] [--runners gpipe,spectrain] [--quick]

Gloo reports a send finished only once it is waited on ([Note: finished sends] in ``rayspec/exec/ray/p2p_plan.py``).
A stage that waited only at the end of a segment kept every message it sent in the segment, with
its buffer: memory that grows with the segment (``train.eval_every`` or ``checkpoint.every``
updates). Per runner and segment length, this starts 2 fresh stage actors (the peer benchmark's
MLP, batch 256 in 8 micro-batches, 128 KiB per message), runs a segment of 8 batches to warm up,
and then one segment of ``--batches`` batches, and reports how far each stage actor's peak resident
memory (``VmHWM``) rose during it. ``held`` is the same run with every ``retire`` removed from the
driver's plan, which is how the stages behaved before sends were retired.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import ray

import rayspec.exec.ray.p2p
from benchmarks._shared.peer_setup import PeerConfig, build_parts
from benchmarks._shared.processes import start_ray
from benchmarks._shared.rayspec_peer import RayspecRunner
from benchmarks._shared.results import table, write


def _peak_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def _held(plan: Any) -> Any:
    """``plan_p2p`` without ``retire``: every send is waited on when the segment ends."""

    def planned(*args: Any, **kwargs: Any) -> Any:
        return [[[dataclasses.replace(op, retire=()) for op in ops] for ops in per] for per in plan(*args, **kwargs)]

    return planned


def measure(cfg: PeerConfig, runner: str, batches: int, held: bool) -> list[float]:
    """MiB by which each stage actor's peak resident memory rose during one segment of ``batches`` batches."""
    parts, _ = build_parts(cfg)
    plan = rayspec.exec.ray.p2p.plan_p2p
    if held:
        rayspec.exec.ray.p2p.plan_p2p = _held(plan)
    run = RayspecRunner(parts, cfg, runner, "p2p", cpus_per_stage=0.5)
    try:
        run.steps(8)  # the stages' buffers and allocator pools reach their steady size
        before = [_peak_mib(p) for p in run.stage_pids]
        run.steps(batches)
        return [_peak_mib(p) - b for p, b in zip(run.stage_pids, before)]
    finally:
        run.close()
        rayspec.exec.ray.p2p.plan_p2p = plan


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="4,64", help="segment lengths in batches")
    ap.add_argument("--runners", default="gpipe,spectrain")
    ap.add_argument("--quick", action="store_true", help="tiny MLP, segments of 2 and 4 batches (a smoke test)")
    args = ap.parse_args(argv)
    lengths = [2, 4] if args.quick else [int(v) for v in args.batches.split(",")]
    cfg = PeerConfig(size="tiny", batch=32) if args.quick else PeerConfig()
    start_ray()
    rows = []
    for runner in args.runners.split(","):
        for batches in lengths:
            row: dict[str, Any] = {"runner": runner, "batches": batches}
            for mode in ("retired", "held"):
                grew = measure(cfg, runner, batches, held=mode == "held")
                row[f"{mode}_mib"] = [round(g, 1) for g in grew]
            rows.append(row)
    ray.shutdown()
    print(table(rows, ["runner", "batches", "retired_mib", "held_mib"]))
    print("MiB by which the peak resident memory of stage 0, stage 1 rose during the segment")
    print(f"wrote {write('p2p_memory', {'config': dataclasses.asdict(cfg), 'rows': rows}, quick=args.quick)}")


if __name__ == "__main__":
    main()
