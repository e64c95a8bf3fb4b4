"""Recovery from a dead stage actor and a dead driver actor: detection and restart times, updates lost, and
what checkpoints cost.

    python -m benchmarks.recovery [--quick] [--every 10] [--steps 60] [--kill-at 25] [--transport auto]
                                  [--parts actors,nodes] [--node-loss stage,driver,elastic]

Four Ray runs of the same spectrain pipeline (4 stages, one process per stage) in one Ray instance:
no checkpoints; a checkpoint every ``--every`` updates; the same, with the last stage actor's
process killed (SIGKILL) at update ``--kill-at`` and ``fault.max_restarts=1``; the same with the
driver actor's process killed instead. Reported for each kill: seconds from the kill to the run
noticing it (the driver actor for a stage, the calling process for the driver), from noticing to the
stages running again (a stage: the dead actor replaced and every stage reloaded; the driver: a new
driver actor and new stage actors, every stage loaded), the updates lost (done since the last
checkpoint, redone), the wall-time ratios, and whether the recovered run's weights equal the
uninterrupted one's. ``--transport p2p`` (the CPU default) recreates every stage actor after a stage
dies, as its gloo group cannot be rebuilt around a new member; ``object_store`` replaces only the dead one.

``--parts nodes``: the node-loss rows instead (``benchmarks/recovery/node_loss.py``): a node removed under a running
pipeline on a multi-node Ray cluster of this machine, per scenario of ``--node-loss``; minutes each, so ``--quick``
leaves them out and says so.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks._shared.processes import KillActor, start_ray
from benchmarks._shared.results import table, write
from benchmarks.recovery.node_loss import SCENARIOS, node_loss
from rayspec.config import from_mapping
from rayspec.training import run_training


def settings(steps: int, every: int, size: str, restarts: int = 0, transport: str = "auto") -> dict:
    return {
        "model": {"name": "mlp", "size": size},
        "data": {"name": "synthetic_image", "train_size": 4096, "val_size": 256},
        "pipeline": {"method": "spectrain", "stages": 4, "executor": "ray", "cpus_per_stage": 0.5,
                     "transport": transport},
        "train": {"max_steps": steps, "batch_size": 64, "log_every": 1},
        "optim": {"lr": 0.05},
        "checkpoint": {"every": every},
        "fault": {"max_restarts": restarts},
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 30 updates")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=25)
    ap.add_argument("--transport", default="auto", help="pipeline.transport of every run")
    ap.add_argument("--out", default="recovery", help="result name: benchmarks/results/OUT.json")
    ap.add_argument("--parts", default="actors,nodes", help="actors (killed actors), nodes (lost nodes), or both")
    ap.add_argument("--node-loss", default=",".join(SCENARIOS), help="the node-loss scenarios of --parts nodes")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    result: dict = {}
    if "actors" in parts:
        result |= killed_actors(args)
    if "nodes" in parts:
        if args.quick:  # each scenario starts four Ray nodes and trains twice: minutes, not a smoke test
            print("node loss left out in --quick (minutes per scenario): run --parts nodes")
        else:
            result["node_loss"] = node_loss(args.node_loss.split(","))
            print(node_table(result["node_loss"]))
    print(f"wrote {write(args.out, result, quick=args.quick)}")


def node_table(rows: dict[str, dict]) -> str:
    """The node-loss rows as a table."""
    return table([{"node lost": f"{s} ({r['stages'][0]} -> {r['stages'][1]} stages)", "seen s": f"{r['seen_s']:.1f}",
                   "running again s": f"{r['running_again_s']:.1f}",
                   "of which bundle wait s": f"{r['placement_wait_s']:.1f}", "updates redone": r["updates_redone"],
                   "restarts": r["restarts"], "weights = reference": "yes" if r["equal"] else
                   ("to rounding" if r["close"] else f"no ({r['max_diff']:.1e})")} for s, r in rows.items()],
                 ["node lost", "seen s", "running again s", "of which bundle wait s", "updates redone", "restarts",
                  "weights = reference"])


def killed_actors(args: argparse.Namespace) -> dict:
    """The killed stage and driver actor rows (the docstring's four runs), printed; their results."""
    steps, size = (30, "tiny") if args.quick else (args.steps, "small")
    kill_at = min(args.kill_at, steps - 2)
    start_ray(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plain = run_training(from_mapping(settings(steps, 0, size, transport=args.transport)), root / "plain")
        ckpt = run_training(from_mapping(settings(steps, args.every, size, transport=args.transport)), root / "ckpt")
        a = torch.load(root / "ckpt" / "model.pt", weights_only=True)
        result: dict = {"model": f"mlp/{size}", "stages": 4, "transport": args.transport, "updates": steps, "checkpoint_every": args.every,
                        "kill_at": kill_at, "wall_s": {"plain": plain["wall_s"], "checkpoints": ckpt["wall_s"]},
                        "checkpoint_cost": ckpt["wall_s"] / plain["wall_s"]}
        for victim, title in (("stage", "StageActor"), ("driver", "DriverActor")):
            killer = KillActor(kill_at, title)
            t0 = time.perf_counter()
            killed = run_training(from_mapping(settings(steps, args.every, size, restarts=1, transport=args.transport)), root / f"killed-{victim}",
                           callbacks=[killer])
            wall = time.perf_counter() - t0
            b = torch.load(root / f"killed-{victim}" / "model.pt", weights_only=True)
            (restart,) = killed["restarts"]
            result["wall_s"][f"killed_{victim}"] = wall
            result[victim] = {
                "detect_s": restart["failed_at"] - killer.killed_at, "recovery_s": restart["recovery_s"],
                "lost_updates": restart["lost_updates"], "resumed_from": restart["resumed_from"],
                "replaced_stages": restart.get("replaced_stages"), "killed_over_checkpoints": wall / ckpt["wall_s"],
                "max_weight_diff_vs_uninterrupted": max((a[k] - b[k]).abs().max().item() for k in a),
            }
    rows = [(f"wall, checkpoint every {args.every} / none", f"{result['checkpoint_cost']:.2f}")]
    for victim in ("stage", "driver"):
        r = result[victim]
        rows += [
            (f"{victim} killed -> noticed (s)", f"{r['detect_s']:.2f}"),
            (f"{victim}: noticed -> stages running again (s)", f"{r['recovery_s']:.2f}"),
            (f"{victim}: stage actors replaced", f"{r['replaced_stages'] or 'all'}"),
            (f"{victim}: updates lost and redone", f"{r['lost_updates']} (resumed from {r['resumed_from']})"),
            (f"{victim}: wall, killed once / not killed", f"{r['killed_over_checkpoints']:.2f}"),
            (f"{victim}: max |weight diff| vs uninterrupted", f"{r['max_weight_diff_vs_uninterrupted']:.1e}"),
        ]
    print(table([{"figure": f, "value": v} for f, v in rows], ["figure", "value"]))
    return result


if __name__ == "__main__":
    main()
