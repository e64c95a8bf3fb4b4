"""Time to accuracy: the training seconds each method takes to reach 95 % and 99 % of the sequential baseline's score.

    python -m benchmarks.time_to_accuracy [--study reviews|fashion] [--methods gpipe,spectrain-paper,...]
                                          [--seeds 0,1,2] [--stages 2] [--eval-every 50] [--quick] [--out NAME]
                                          [--set KEY=VALUE ...] [--resume]

Every run trains a study's model on its data with its settings (``rayspec/experiments/studies/STUDY.yaml``, read by
``rayspec.cli.study_config.load_study``: the same overrides, the same eval split), evaluating every ``--eval-every``
updates (default: half the study's ``train.eval_every``, so the clock has resolution). The methods run at
``--stages`` N on the Ray executor, transport ``p2p``, one CPU per stage actor (fewer where the cluster has fewer
than N CPUs); ``dataparallel`` on N Ray Train workers with the same CPUs. The baseline, ``sequential``, is the
study's: ``vanilla`` at one stage on the local executor (one thread). Its score (the mean accuracy of its last 3
evaluations, ``rayspec.cli.study_stats``), averaged over the seeds, sets the targets: 95 % and 99 % of it.

The clock is each evaluation record's ``train_s`` (``metrics.jsonl``): seconds of training so far, evaluation and
checkpoints left out (``dataparallel``: rank 0's clock, see ``rayspec.training.dataparallel``). A run's time to a
target is the ``train_s`` of its first evaluation at or above it; a method's is the median over the seeds, a run that
never reaches the target (or failed) counting as slower than every one that did, so the median is "not reached" when
it falls on one. The table gives each method's median [per seed], its ratio to the fastest method, the runs that did
not reach the target and the seconds per update (the run's ``train_s`` over its updates). SpecTrain's prediction
scoring is off (``pipeline.probe=0``): it is measurement, not training; ``spectrain-paper-adaptive`` keeps it, as its
predictor damps each prediction by what the probe measured.

Method labels are the studies' (``rayspec.cli.study_config.METHOD_LABELS``): ``spectrain-paper`` is the paper's
SpecTrain (an update per batch of one micro-batch), ``spectrain-paper-adaptive`` its adaptive predictor;
``spectrain-paper-acc4`` accumulates 4 micro-batches of a quarter batch into each update; ``pipedream-2bw``
accumulates N-1 micro-batches (two weight versions: none may be in flight across two updates), so at N=2 it trains
on whole batches. ``interleaved`` (2 chunks per stage actor) is skipped when the model has fewer than 2N blocks.
Every method trains the study's batch size for the study's number of updates.

``--quick``: the study (reviews by default), ``vanilla`` and ``spectrain-paper``, one seed, 12 updates evaluated
every 4, in the scratch folder. Results: ``benchmarks/results/OUT.json`` (default ``time_to_accuracy``) and
``OUT.png`` beside it.
"""

from __future__ import annotations

import argparse
import json
import logging.handlers
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks._shared.processes import start_ray
from benchmarks._shared.results import results_dir, table, write
from benchmarks.time_to_accuracy import _curves
from rayspec.cli.study_config import BASELINE, METHOD_LABELS, load_study_part, with_settings
from rayspec.cli.study_run import write_json
from rayspec.config import Config

METHODS = ("dataparallel", "vanilla", "gpipe", "1f1b", "zb1p", "interleaved", "async", "pipedream", "pipedream-2bw",
           "spectrain-paper", "spectrain-paper-acc4", "spectrain-paper-adaptive")
"""The methods of a full run, in the table's order (the baseline, ``sequential``, comes first)."""
EXTRA_LABELS: dict[str, list[str]] = {
    "dataparallel": ["pipeline.method=dataparallel"],
    "spectrain-paper-acc4": [*METHOD_LABELS["spectrain-paper"], "pipeline.accumulate=4"],
}
"""Labels of this benchmark beyond the studies' ``METHOD_LABELS``, with their overrides."""
QUICK = {"methods": "vanilla,spectrain-paper", "seeds": "0", "max_steps": 12, "eval_every": 4}
PIPELINE = ["pipeline.executor=ray", "pipeline.transport=p2p"]
"""What every run at N stages sets beyond its method: the Ray executor, p2p (and ``pipeline.probe=0``, no prediction
scoring, except for the adaptive predictor, which trains with what the probe measures)."""


def method_overrides(label: str, stages: int) -> list[str]:
    """The training overrides of method ``label`` at ``stages`` stages (the baseline: vanilla at one stage, local)."""
    if label == BASELINE:
        return [*METHOD_LABELS["vanilla"], "pipeline.stages=1", "pipeline.executor=local"]
    if label in EXTRA_LABELS:
        own = EXTRA_LABELS[label]
    elif label in METHOD_LABELS:
        own = list(METHOD_LABELS[label])
    else:
        raise ValueError(f"method {label!r} is unknown; choose from {', '.join(METHODS)} or a study label "
                         f"({', '.join(METHOD_LABELS)})")
    if label == "pipedream-2bw":
        own = [*own, f"pipeline.accumulate={max(1, stages - 1)}"]
    probe = [] if "pipeline.predictor=adaptive" in own else ["pipeline.probe=0"]
    return [*own, f"pipeline.stages={stages}", *PIPELINE, *probe]


def read_curve(run_dir: Path) -> list[list[float]]:
    """``[update, train_s, val_accuracy]`` of every evaluation record of the run's ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[r["step"], r["train_s"], r["val_accuracy"]] for r in records if "val_accuracy" in r]


def train_one(config: Config, label: str, seed: int) -> dict[str, Any]:
    """Train one run in its own temporary run directory: its curve, training seconds and updates, or its error."""
    from rayspec.training import run_training
    from rayspec.training.console import relayed_to

    lines = logging.handlers.BufferingHandler(capacity=1 << 16)  # the run's log lines, for an error's tail
    out: dict[str, Any] = {"method": label, "seed": seed}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rayspec-tta-") as run_dir, relayed_to(lines):
        try:
            summary = run_training(config, run_dir)
            out |= {"train_s": summary["train_s"], "updates": summary["updates"]}
        except Exception as err:  # recorded as a run that reached nothing; the benchmark goes on
            out |= {"error": f"{type(err).__name__}: {err}",
                    "log_tail": [lines.format(record) for record in lines.buffer[-5:]]}
        out["curve"] = read_curve(Path(run_dir))
    out["wall_s"] = time.perf_counter() - t0
    return out


def _ints(text: str, name: str, ap: argparse.ArgumentParser) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s]
    except ValueError:
        ap.error(f"{name}={text!r} must be comma-separated integers, e.g. {name} 0,1,2")
    if not values or min(values) < 0 or len(set(values)) != len(values):
        ap.error(f"{name}={text!r} needs distinct integers >= 0")
    return values


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", default="reviews", help="a study name or file (default reviews; fashion)")
    ap.add_argument("--methods", default=None, help=f"comma-separated method labels (default: {','.join(METHODS)})")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages N (dataparallel: N workers); default 2")
    ap.add_argument("--eval-every", type=int, default=None, help="updates between evaluations (default: half the "
                                                                 "study's train.eval_every)")
    ap.add_argument("--address", default=None, help="a running Ray cluster to use (default: a fresh local one)")
    ap.add_argument("--quick", action="store_true",
                    help="vanilla and spectrain-paper, 1 seed, 12 updates (a smoke run)")
    ap.add_argument("--out", default="time_to_accuracy", help="result name: benchmarks/results/OUT.json and OUT.png")
    ap.add_argument("--resume", action="store_true",
                    help="keep the finished runs of OUT.partial.json (written after every run, kept after the last) "
                         "that have these settings, and train only the others: to go on after an interruption, or "
                         "to add methods or seeds")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a training override for every run, after the study's own (data.path=FILE: a copy of the "
                         "study's data file); repeatable")
    args = ap.parse_args(argv)
    methods = [m for m in (args.methods or (QUICK["methods"] if args.quick else ",".join(METHODS))).split(",") if m]
    for label in methods:
        if label == BASELINE:
            ap.error(f"--methods: {BASELINE} is the baseline and always runs; leave it out")
        try:
            method_overrides(label, args.stages)
        except ValueError as err:
            ap.error(f"--methods: {err}")
    seeds = _ints(args.seeds or (QUICK["seeds"] if args.quick else "0,1,2"), "--seeds", ap)
    if args.stages < 2:
        ap.error(f"--stages={args.stages} must be >= 2 (the baseline is the one-stage run)")
    if args.eval_every is not None and args.eval_every < 1:
        ap.error(f"--eval-every={args.eval_every} must be >= 1")

    training = [*args.overrides, *([f"train.max_steps={QUICK['max_steps']}", f"train.eval_every={QUICK['eval_every']}"]
                                   if args.quick else [])]
    study = load_study_part(args.study, training, methods=["vanilla"], stages=[args.stages], seeds=seeds)
    eval_every = args.eval_every or (QUICK["eval_every"] if args.quick else
                                     max(1, int(study.base["train"]["eval_every"]) // 2))
    common = [f"train.eval_every={eval_every}"]
    baseline_config = with_settings(study.base, [*method_overrides(BASELINE, 1), "seed=0", *common])
    blocks = _blocks(baseline_config)

    import ray
    import torch

    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        start_ray()
    cpus = min(1.0, ray.cluster_resources().get("CPU", 1.0) / args.stages)
    per_stage = [f"pipeline.cpus_per_stage={cpus:g}"]
    torch.set_num_threads(study.threads or torch.get_num_threads())  # the baseline and every evaluation, as a study
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in [BASELINE, *methods]}
    partial = results_dir(args.quick) / f"{args.out}.partial.json"
    key = {"study": study.name, "stages": args.stages, "eval_every": eval_every, "overrides": training}
    kept = _resumed(partial, key) if args.resume else {}
    others = {k: run for k, run in kept.items() if k[0] not in runs or k[1] not in seeds}  # kept, not trained here
    skipped: dict[str, str] = {}
    if "interleaved" in methods and blocks < 2 * args.stages:
        skipped["interleaved"] = (f"the model has {blocks} blocks; interleaved at N={args.stages} with 2 chunks per "
                                  f"stage actor needs {2 * args.stages}")
    t_all = time.perf_counter()
    try:
        for seed in seeds:
            for label in runs:
                if label in skipped:
                    continue
                stages = 1 if label == BASELINE else args.stages
                over = [*method_overrides(label, stages), f"seed={seed}", *common,
                        *(per_stage if label != BASELINE else [])]
                if (done := kept.get((label, seed))) is not None and done["overrides"] == over:
                    runs[label].append(done)
                    print(f"{study.name} {label} seed {seed}: kept from {partial.name}", flush=True)
                    continue
                run = train_one(with_settings(study.base, over), label, seed)
                runs[label].append({**run, "overrides": over})
                _save_partial(partial, key, runs, others)
                reached = f"final {run['curve'][-1][2]:.4f}" if run["curve"] else "no evaluation"
                shown = f"failed: {run['error'][:300]}" if "error" in run else f"{run['train_s']:.1f} s trained"
                print(f"{study.name} {label} seed {seed}: {shown}, {reached} ({run['wall_s']:.0f} s)", flush=True)
    finally:
        if not args.address:
            ray.shutdown()
    try:
        goal = _curves.targets(runs[BASELINE])
    except RuntimeError as err:  # the runs are kept, for their errors
        path = write(args.out, {"study": study.name, "error": str(err), "runs": runs}, quick=args.quick)
        raise SystemExit(f"{err}; the runs are in {path}") from None
    keys = list(goal["targets"])
    rows = [_curves.method_row(label, done, goal["targets"]) for label, done in runs.items() if done]
    _curves.add_ratios(rows, keys)

    settings = {"stages": args.stages, "seeds": seeds, "methods": methods, "eval_every": eval_every,
                "max_steps": int(study.base["train"]["max_steps"]),
                "batch_size": int(study.base["train"]["batch_size"]),
                "executor": "ray", "transport": "p2p", "cpus_per_stage": cpus, "baseline": f"{BASELINE}: vanilla, "
                "1 stage, local executor", "study_overrides": study.overrides, "threads": study.threads,
                "method_overrides": {label: method_overrides(label, 1 if label == BASELINE else args.stages)
                                     for label in runs}}
    payload = {"study": study.name, "description": study.description, "settings": settings, **goal, "rows": rows,
               "skipped": skipped, "runs": runs, "wall_s": time.perf_counter() - t_all}
    levels = " and ".join(f"{t:.4f}" for t in goal["targets"].values())
    print(f"\n{study.name}, N={args.stages}: training seconds to {levels}"
          f" validation accuracy ({' and '.join(k.replace('to_', '') + ' %' for k in keys)} of the sequential "
          f"baseline's {goal['baseline_score']:.4f}); median [per seed], x best = over the fastest median, "
          "missed = runs that did not reach it:")
    cells = _curves.table_rows(rows, keys)
    print(table(cells, list(cells[0])))
    for label, reason in skipped.items():
        print(f"{label}: skipped: {reason}")
    path = write(args.out, payload, quick=args.quick)
    png = _curves.plot(payload, results_dir(args.quick) / f"{args.out}.png")
    print(f"\nwrote {path} and {png}")
    if all("error" in run for label in methods for run in runs[label]):
        raise SystemExit("every run of the methods failed; see the results file's errors")


def _save_partial(path: Path, key: dict[str, Any], runs: Mapping[str, list[dict[str, Any]]],
                  others: Mapping[tuple[str, int], dict[str, Any]] | None = None) -> None:
    """Every run so far, with the settings they share, so that an interrupted benchmark loses at most one run;
    ``others``: finished runs of the file that this call does not train (other methods or seeds), kept in it."""
    merged: dict[str, list[dict[str, Any]]] = {label: list(done) for label, done in runs.items()}
    for (label, _), run in (others or {}).items():
        merged.setdefault(label, []).append(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {**key, "runs": merged})


def _resumed(path: Path, key: Mapping[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """The finished runs of an earlier partial file by (method, seed), if it was written with the same settings;
    a run that failed is trained again."""
    if not path.exists():
        print(f"--resume: no {path.name} yet; every run trains", flush=True)
        return {}
    saved = json.loads(path.read_text())
    if any(saved.get(k) != v for k, v in key.items()):
        raise SystemExit(f"--resume: {path} was written with other settings "
                         f"({ {k: saved.get(k) for k in key} }, now {dict(key)}); delete it or drop --resume")
    return {(label, run["seed"]): run for label, done in saved["runs"].items() for run in done if "error" not in run}


def _blocks(config: Config) -> int:
    """The model's number of blocks (what the pipeline cuts into stages)."""
    from rayspec.training.prepare import prepare

    return len(prepare(config).model)


if __name__ == "__main__":
    main()
