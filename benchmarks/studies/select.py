"""Selection probes of the ``fashion`` and ``reviews`` studies: sequential baselines on the selection split only.

    python -m benchmarks.studies.select --study fashion --step rate --grid optim.lr=0.01,0.03,0.1 \\
        [--set model.size=tiny ...] [--seeds 0,1] [--results study_select]

Every probe is the study's sequential baseline (``vanilla`` on one stage) with ``data.eval_split=selection``: it
trains on the training split less the selection split (``data.selection``) and is scored on the held-out part;
the test split is never read. No pipelined method runs here, so no choice can favour one. A probe's score is
the study's score: the mean of the last 3 evaluations; a probe whose training loss exceeds 3x its first logged
loss or turns non-finite is diverged (``rayspec.cli.study_stats``).

Each call sweeps one setting (``--grid KEY=V1,V2,...``) with the others as ``--set`` gives them (the choices of
earlier steps), and appends its rows to ``benchmarks/results/<results>.json`` under the study and step, with the
choice its rule makes over these rows and those of earlier calls of the same step with the same ``--set``. The rules, fixed before any probe ran:

- ``rate``: the largest value whose mean score over the seeds is within 1 point of the best mean, with no
  diverged seed (the paper's regime is the large rate where staleness matters; a smaller one hides the
  methods' differences, a larger one costs the baseline accuracy).
- every other step (``model``, ``budget``, ``dropout``): the cheapest value (mean CPU seconds per run: the machine
  is shared, so wall time says little) whose mean score is within 0.5 points of the best mean, with no diverged
  seed; the time budget of the full protocol (about 40 s per run at N=4) decides between settings that score
  alike. A grid holds only values whose runs fit that budget (wider models were timed first, not probed).
- with ``--min-score F`` (a step after the test split showed a floor missed): the cheapest value whose mean score
  reaches ``F``, no diverged seed; ``F`` is the floor plus the gap measured between the selection and test
  splits, fixed before the step's probes run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks._shared.results import results_dir, write
from rayspec.cli.study import BASELINE, RunSpec, train_run
from rayspec.cli.study_config import load_study_part, with_overrides
from rayspec.cli.study_stats import score
from rayspec.config import from_mapping
from rayspec.config.compose import compose

TOLERANCE = {"rate": 0.01}
"""The accuracy (fraction) below the best mean that a step's rule still accepts; 0.005 for steps not listed."""


def choose(rows: list[dict[str, Any]], step: str, min_score: float | None = None) -> str | None:
    """The grid value the step's rule picks (see the module docstring), from rows of every seed; with ``min_score``
    (a fraction), the cheapest value whose mean score reaches it (None if none does)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["value"], []).append(r)
    means = {v: statistics.fmean(r["score"] for r in rs) for v, rs in by.items()
             if all(r["status"] == "ok" and r["score"] is not None for r in rs)}
    if not means:
        return None
    floor = max(means.values()) - TOLERANCE.get(step, 0.005) if min_score is None else min_score
    near = [v for v, m in means.items() if m >= floor]
    if not near:
        return None
    if step == "rate":
        return max(near, key=lambda v: float(v.rsplit("=", 1)[-1]))
    return min(near, key=lambda v: statistics.fmean(r["cpu_seconds"] for r in by[v]))


def grid_values(grid: str) -> list[list[str]]:
    """The probes' overrides: ``KEY=V1,V2`` (one key) or ``A=1 B=2|A=3 B=4`` (bundles of overrides)."""
    if "|" in grid:
        return [bundle.split() for bundle in grid.split("|")]
    key, _, values = grid.partition("=")
    return [[f"{key}={v}"] for v in values.split(",")]


def probe(study_name: str, setting: list[str], fixed: list[str], seed: int, out: Path,
          split: str = "selection") -> dict[str, Any]:
    """Train one probe (the baseline with ``setting``, scored on ``split``) and return its row."""
    overrides = [*fixed, *setting, f"data.eval_split={split}"]
    study = load_study_part(study_name, overrides, seeds=[seed], stages=[1])  # the baseline alone
    value = " ".join(setting) if len(setting) != 1 else setting[0].partition("=")[2]
    run_dir = out / study_name / f"{'_'.join(setting) or split}-seed{seed}"
    spec = with_overrides(study, RunSpec(BASELINE, 1, seed, None))
    record = _same_run(out / study_name, spec.overrides) or train_run(study, spec, run_dir, None)
    row = {"value": value, "seed": seed, "set": fixed, "status": record["status"], "score": score(record),
           "final": record["final"]["val_accuracy"], "curve": [[s, round(a, 4)] for s, _, a in record["curves"]["val"]],
           "seconds": round(record["seconds"], 1), "cpu_seconds": round(record["cpu_seconds"], 1)}
    shown = "-" if row["score"] is None else f"{100 * row['score']:.2f}"
    print(f"{study_name} {' '.join(setting)} seed {seed}: {record['status']} score {shown} % ({row['seconds']} s, "
          f"{row['cpu_seconds']} s CPU)", flush=True)
    return row


def _same_run(folder: Path, overrides: list[str]) -> dict[str, Any] | None:
    """The record of an earlier probe of the same run (the same composed config: the runs are deterministic), so
    that a setting shared by two steps is trained once; None if there is none."""
    mine = asdict(from_mapping(compose(overrides)))
    for path in sorted(folder.glob("*/run.json")):
        record = json.loads(path.read_text())
        if record.get("status") == "ok" and asdict(from_mapping(compose(record["overrides"]))) == mine:
            print(f"  (the same run as {path.parent.name}: its record is reused)", flush=True)
            return record
    return None


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", required=True, help="fashion or reviews")
    ap.add_argument("--step", default="", help="model, budget, rate or dropout (names the rule)")
    ap.add_argument("--grid", default="", help="KEY=V1,V2,...: the setting swept; or bundles of overrides, "
                    "'A=1 B=2|A=3 B=4'")
    ap.add_argument("--set", nargs="*", default=[], help="overrides of every probe (earlier steps' choices)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--min-score", type=float, default=None, help="the rule instead: the cheapest value whose mean "
                    "selection score reaches this fraction (a floor the test split must meet, plus the gap measured "
                    "between the two splits)")
    ap.add_argument("--results", default="study_select", help="results file name in benchmarks/results")
    ap.add_argument("--out", default="outputs/study_select", help="where the probes' run directories go")
    ap.add_argument("--test", action="store_true", help="no probe: the study's own sequential baseline (with --set: "
                    "a candidate's) on the test split, once per seed, after every choice; the rows go under the "
                    "study's sequential_test (a candidate's: sequential_test <its overrides>)")
    args = ap.parse_args(argv)
    if args.test:
        return final(args.study, [int(s) for s in args.seeds.split(",")], args.results, Path(args.out), list(args.set))
    settings = grid_values(args.grid)
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.perf_counter()
    rows = [probe(args.study, setting, list(args.set), s, Path(args.out)) for setting in settings for s in seeds]
    chosen = choose(rows, args.step, args.min_score)
    print(f"{args.study} {args.step}: {chosen} ({time.perf_counter() - t0:.0f} s)", flush=True)
    path = results_dir(False) / f"{args.results}.json"
    fresh = json.loads(path.read_text()) if path.exists() else {}  # read again last: another process may write too
    studies = fresh.get("studies", {})
    steps = studies.setdefault(args.study, {}).setdefault("steps", [])
    # rows of earlier calls of the same step with the same settings count too (a grid extended, or run in parts)
    earlier = [r for st in steps if st["step"] == args.step and st["set"] == args.set for r in st["rows"]]
    chosen = choose(earlier + rows, args.step, args.min_score)
    steps.append({"step": args.step, "grid": settings, "set": args.set, "seeds": seeds, "rows": rows,
                  **({"min_score": args.min_score} if args.min_score is not None else {}),
                  "chosen": chosen, **({"with_earlier_rows": len(earlier)} if earlier else {})})
    print(f"{args.study} {args.step}: {chosen} with the earlier calls' rows", flush=True)
    write(args.results, {**{k: v for k, v in fresh.items() if k not in ("benchmark", "machine", "date", "commit")},
                         "rules": {"rate": "largest value within 1 point of the best mean score, no diverged seed",
                                   "other": "cheapest value within 0.5 points of the best mean score, no diverged "
                                            "seed"},
                         "score": "mean of the last 3 evaluations on the selection split", "studies": studies})


def final(study_name: str, seeds: list[int], results: str, out: Path, fixed: Sequence[str] = ()) -> None:
    """The study's sequential baseline on the test split, per seed: mean ± std of the score against the floor;
    ``fixed``: a candidate's overrides of the study's settings (kept apart, under ``sequential_test <fixed>``)."""
    key = " ".join(["sequential_test", *fixed])
    rows = [probe(study_name, [], list(fixed), seed, out, split="test") for seed in seeds]
    path = results_dir(False) / f"{results}.json"
    fresh = json.loads(path.read_text()) if path.exists() else {}  # other seeds may come from another process
    studies = fresh.get("studies", {})
    earlier = studies.get(study_name, {}).get(key, {}).get("rows", [])
    rows = sorted([r for r in earlier if r["seed"] not in seeds] + rows, key=lambda r: r["seed"])
    scores = [r["score"] for r in rows if r["score"] is not None]
    summary = {"rows": rows, "mean": statistics.fmean(scores) if scores else None,
               "std": statistics.stdev(scores) if len(scores) > 1 else None}
    print(f"{study_name} sequential {' '.join(fixed)} on the test split, seeds {[r['seed'] for r in rows]}: "
          f"{summary['mean']} ± {summary['std']}", flush=True)
    studies.setdefault(study_name, {})[key] = summary
    write(results, {**{k: v for k, v in fresh.items() if k not in ("benchmark", "machine", "date", "commit")},
                    "studies": studies})


if __name__ == "__main__":
    main()
