"""What the driver actor costs: the same Ray run with its loop in a driver actor and in the calling process.

    python -m benchmarks.driver [--quick] [--rounds 3] [--steps 60]

``rayspec.training.train`` runs a Ray run's loop in a driver actor and relays what it streams back; the
loop itself (``rayspec.training.loop.run``) can also run in the calling process, as it did before the
driver actor. Both run the same spectrain and gpipe pipelines (small MLP, 4 stages of 0.5 CPU each,
``--steps`` updates, an evaluation every 20) in one Ray instance, interleaved over ``--rounds``
rounds. Reported per method: the median ratio driver actor / in process of the training throughput
(samples/s over the pipeline's own time) and of the whole call's wall time (actor starts included),
and the median extra wall seconds. Writes ``benchmarks/results/driver.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks._shared.processes import start_ray
from benchmarks._shared.results import table, write
from rayspec.config import from_mapping
from rayspec.training import run_training
from rayspec.training.loop import run
from rayspec.training.prepare import prepare


def settings(method: str, steps: int, size: str) -> dict:
    return {
        "model": {"name": "mlp", "size": size},
        "data": {"name": "synthetic_image", "train_size": 4096, "val_size": 256},
        "pipeline": {"method": method, "stages": 4, "executor": "ray", "cpus_per_stage": 0.5},
        "train": {"max_steps": steps, "batch_size": 64, "log_every": 10, "eval_every": 20},
        "optim": {"lr": 0.05},
    }


def in_process(config, run_dir: Path) -> dict:
    """The run loop in this process (no driver actor): what ``train`` did before it had one."""
    prepared = prepare(config, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run(prepared, run_dir, lambda _: None, [], None, 0)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 20 updates, 1 round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)
    steps, size, rounds = (20, "tiny", 1) if args.quick else (args.steps, "small", args.rounds)
    start_ray(2)
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for method in ("spectrain", "gpipe"):
                for where in ("actor", "process"):
                    config = from_mapping(settings(method, steps, size))
                    run_dir = Path(tmp) / f"{method}-{where}-{r}"
                    t0 = time.perf_counter()
                    if where == "actor":
                        summary = run_training(config, run_dir)
                    else:
                        summary = in_process(config, run_dir)
                    runs.setdefault((method, where), []).append((summary["samples_per_s"], time.perf_counter() - t0))
    rows, result = [], {"model": f"mlp/{size}", "stages": 4, "updates": steps, "rounds": rounds, "methods": {}}
    for method in ("spectrain", "gpipe"):
        actor, process = runs[(method, "actor")], runs[(method, "process")]
        rate = statistics.median(a[0] / p[0] for a, p in zip(actor, process))
        wall = statistics.median(a[1] / p[1] for a, p in zip(actor, process))
        extra = statistics.median(a[1] - p[1] for a, p in zip(actor, process))
        result["methods"][method] = {"samples_per_s_ratio": rate, "wall_ratio": wall, "extra_wall_s": extra,
                                     "runs": {"actor": actor, "process": process}}
        rows.append({"method": method, "samples/s actor/process": f"{rate:.2f}", "wall actor/process": f"{wall:.2f}",
                     "extra wall (s)": f"{extra:+.1f}",
                     "samples/s (actor, process)": f"{statistics.median(a[0] for a in actor):.0f}, "
                                                   f"{statistics.median(p[0] for p in process):.0f}"})
    print(table(rows, list(rows[0])))
    print(f"wrote {write('driver', result, quick=args.quick)}")


if __name__ == "__main__":
    main()
