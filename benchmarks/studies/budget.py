"""The time of a study's full protocol, projected from one timed run per method at its largest stage count.

    python -m benchmarks.studies.budget --study fashion [--methods gpipe,async,spectrain-paper] [--seed 0] \\
        [--parallel 2] [--results study_budget]

Trains the study's sequential baseline and the named methods once (one seed, the study's largest stage count, the
local executor, one thread: as the study runs them) on the study's own settings, and records each run's wall and
CPU seconds. The projection gives every planned run (``rayspec.cli.study_config.plan_runs``: seeds x methods x
stage counts, and the rate sweep) the CPU seconds of its method's timed run (an untimed method: the mean of the
timed pipelined methods; another stage count: the same, as the local executor computes the same math) and divides
by the runs trained side by side (``--parallel``). CPU seconds, not wall seconds, because the machine is shared:
an idle core gives about the CPU time as wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._shared.results import results_dir, write
from rayspec.cli.study_config import BASELINE, load_study, load_study_part, plan_runs, run_spec
from rayspec.cli.study_run import train_run


def project(study_name: str, timed: dict[str, float], parallel: int) -> dict[str, Any]:
    """The projected CPU seconds of every planned run and the study's wall-clock hours ``parallel`` at a time."""
    study = load_study(study_name)
    pipelined = [v for k, v in timed.items() if k != BASELINE]
    fallback = statistics.fmean(pipelined) if pipelined else timed[BASELINE]
    runs = plan_runs(study)
    total = sum(timed.get(spec.label, fallback) for spec in runs)
    return {"runs": len(runs), "cpu_seconds": round(total), "parallel": parallel,
            "hours": round(total / parallel / 3600, 2), "per_run_mean_s": round(total / len(runs), 1)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", required=True)
    ap.add_argument("--methods", default="gpipe,async,pipedream,spectrain-paper,zb1p")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", type=int, default=2, help="runs trained side by side in the full protocol")
    ap.add_argument("--results", default="study_budget")
    ap.add_argument("--out", default="outputs/study_budget")
    args = ap.parse_args(argv)
    study = load_study_part(args.study, seeds=[args.seed])
    n = max(study.stages)
    rows = []
    for label in [BASELINE, *args.methods.split(",")]:
        spec = run_spec(study, label, 1 if label == BASELINE else n, args.seed)
        record = train_run(study, spec, Path(args.out) / args.study / spec.name, None)
        rows.append({"label": label, "stages": spec.stages, "status": record["status"], "score": record["score"],
                     "seconds": round(record["seconds"], 1), "cpu_seconds": round(record["cpu_seconds"], 1)})
        print(f"{args.study} {label} N={spec.stages}: {record['status']} {rows[-1]['seconds']} s "
              f"({rows[-1]['cpu_seconds']} s CPU)", flush=True)
    projection = project(args.study, {r["label"]: r["cpu_seconds"] for r in rows}, args.parallel)
    print(f"{args.study}: {projection}", flush=True)
    path = results_dir(False) / f"{args.results}.json"
    studies = json.loads(path.read_text()).get("studies", {}) if path.exists() else {}
    studies[args.study] = {"timed": rows, "projection": projection}
    write(args.results, {"note": __doc__.split("\n\n")[2].replace("\n", " "), "studies": studies})


if __name__ == "__main__":
    main()
