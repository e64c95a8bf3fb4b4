"""``rayspec study study=NAME`` (``python -m rayspec.study``): every method against sequential training over stage
counts and seeds.

A study (``rayspec/experiments/studies/NAME.yaml``) names one workload as training overrides of the run
configuration, the methods, the stage counts and the seeds. Each run trains through ``rayspec.training.run_training`` with the
same data order and learning-rate schedule (both depend only on ``seed`` and the overrides); at every
evaluation the run's merged weights are compared with the sequential run's weights at the same update.
The results (``study.md``, ``study_results.json``, ``learning_curves.png``, ``distance.png``, ``prediction.png``) go to the
study's output directory, one sub-directory per run under ``runs/``. ``runner=sequential`` (the default) trains the
runs one after another in this process; ``runner=tune`` trains them as Ray Tune trials (``rayspec.cli.study_tune``),
side by side where resources allow and across a cluster's nodes. Both report from the same records.

[Note: one sequential baseline per seed] A ``vanilla`` pipeline is bit-exactly sequential training at any
stage count (``tests/test_stage.py``), so the baseline trains once per seed, on one stage. The exception
is a model with active dropout: each stage draws its masks from its own random stream, so vanilla on
``N`` stages samples other masks than on one; the baseline then trains once per seed and stage count,
and every method is compared with the baseline of its own stage count (the same masks).

[Note: evaluations drain the pipeline] ``train.eval_every`` cuts training into segments; the pipeline
drains at the end of each (like a GPipe flush) and refills after the evaluation, so the asynchronous
methods run a little less stale around evaluations than an undisturbed run would.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

from rayspec.cli.common import split_args
from rayspec.cli.study_config import (
    BASELINE,
    CLI_KEYS,
    DEFAULT_METHODS,
    METHOD_LABELS,
    RUNNERS,
    STUDIES,
    RunSpec,
    Study,
    StudyError,
    available,
    load_study,
    plan_runs,
    run_name,
)
from rayspec.cli.study_run import (
    finished_record,
    load_trajectory,
    open_study,
    outcome,
    relative_distance,
    report_study,
    train_run,
)
from rayspec.errors import RayspecError, unknown
from rayspec.training.console import ensure_console
from rayspec.training.progress import duration

__all__ = ["STUDIES", "METHOD_LABELS", "DEFAULT_METHODS", "BASELINE", "Study", "StudyError", "RunSpec", "available",
           "load_study", "plan_runs", "run_name", "run_study", "train_run", "relative_distance", "main"]

log = logging.getLogger(__name__)


def run_study(study: Study, resume: bool = True) -> dict[str, Any]:
    """Train (or resume) every run of ``study``, then write and log the report (INFO lines of ``rayspec.cli.*``).

    Args:
        study: from ``load_study``.
        resume: skip runs whose ``run.json`` in the output directory shows them finished with the same
            overrides; ``False`` moves an earlier output directory aside and starts afresh.

    Returns:
        The contents of ``study_results.json``.
    """
    directory = study.directory
    runs = open_study(study, resume)
    records: dict[str, dict[str, Any]] = {}
    trajectories: dict[str, dict[int, dict[str, Any]] | None] = {}
    trained_s, trained = 0.0, 0
    for i, spec in enumerate(runs, 1):
        run_dir = directory / "runs" / spec.name
        record = finished_record(spec, run_dir) if resume else None
        head = f"[{i}/{len(runs)}] {spec.label} N={spec.stages} seed {spec.seed}:"
        if record is not None:
            log.info("%s %s (finished earlier, skipped)", head, outcome(record))
        else:
            reference = trajectories.get(spec.reference) if spec.reference else None
            record = train_run(study, spec, run_dir, reference)
            trained_s, trained = trained_s + record["seconds"], trained + 1
            left = sum(1 for s in runs[i:] if not resume or finished_record(s, directory / "runs" / s.name) is None)
            error = f" ({record['error']})" if record["status"] != "ok" else ""
            log.info("%s %s%s in %.1f s; eta %s", head, outcome(record), error, record["seconds"],
                     duration(trained_s / trained * left))
        records[spec.name] = record
        if spec.reference is None:
            trajectories[spec.name] = load_trajectory(run_dir, record)
    return report_study(study, runs, records, trained)


# --------------------------------------------------------------------------- command line

USAGE = """usage: rayspec study study=NAME [methods=[async,spectrain-paper]] [stages=[2,4]] [seeds=[0,1,2]]
                     [executor=local|ray] [output_dir=DIR] [resume=false] [lr_sweep=false] [checks=false]
                     [runner=sequential|tune] [max_concurrent_trials=N|null] [training overrides]
       (python -m rayspec.study takes the same arguments; values are read as Hydra overrides)"""


def parse_args(argv: Sequence[str]) -> tuple[str, dict[str, Any], list[str]]:
    """Split Hydra-style ``key=value`` arguments into the study reference, study options and training overrides."""
    return split_args(argv, "study", CLI_KEYS, ("output_dir", "executor", "runner"), available(), USAGE, StudyError)


def runner_options(options: dict[str, Any]) -> tuple[str, int | None]:
    """Take ``runner`` (default sequential) and ``max_concurrent_trials`` (default 1; null: no limit) out of the
    command's options, checked."""
    runner = options.pop("runner", "sequential")
    if runner not in RUNNERS:
        raise unknown("runner", runner, RUNNERS, " (sequential: one run after another here; tune: Ray Tune trials, "
                      "side by side and across a cluster)")
    given = "max_concurrent_trials" in options
    limit = options.pop("max_concurrent_trials", 1)
    if given and runner != "tune":
        raise StudyError("max_concurrent_trials applies to runner=tune; add runner=tune")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise StudyError(f"max_concurrent_trials={limit!r} must be an integer >= 1, or null for as many trials as "
                         "the cluster holds")
    return runner, limit


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m rayspec.study``; returns the exit code (2: bad input, 1: a run failed other than diverging,
    or a checked method's run differed from its ``same_as``'s)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(f"{USAGE}\nmethods: {', '.join(METHOD_LABELS)}\navailable studies: {', '.join(available()) or 'none'}")
        return 0
    try:
        ref, options, overrides = parse_args(args)
        resume = options.pop("resume")
        runner, limit = runner_options(options)
        study = load_study(ref, overrides, **options)
        ensure_console()  # the study's lines on stdout, unless this program set up logging
        if runner == "tune":
            from rayspec.cli.study_tune import tune_study  # Ray only for a study on Ray Tune

            payload = tune_study(study, resume=resume, max_concurrent_trials=limit)
        else:
            payload = run_study(study, resume=resume)
    except RayspecError as err:  # StudyError and every other bad input
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        print(f"rayspec.study: interrupted{f': {err}' if str(err) else ''}", file=sys.stderr)
        return 130
    failed = [r["name"] for r in payload["runs"] if r["status"] == "failed"]
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)}; see their train.log under "
              f"{study.directory / 'runs'}", file=sys.stderr)
    broken = [f"{r['method']} N={r['stages']} seed {r['seed']}" for r in payload["checks"] if r["identical"] is False]
    if broken:
        print(f"error: check failed, not the same runs as {payload['checks'][0]['same_as']}: {', '.join(broken)} "
              "(study.md says so)", file=sys.stderr)
    return 1 if failed or broken else 0
