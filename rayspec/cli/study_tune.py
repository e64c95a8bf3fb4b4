"""``python -m rayspec.study runner=tune``: a study's runs as Ray Tune trials, side by side and across a cluster's nodes.

Each run is one trial of a grid over the planned runs (method × stages × seed, and the rate sweep); it trains through
``rayspec.cli.study_run.train_run``, as the sequential runner does, into the same ``runs/<name>/`` folder of the
study's output directory, which must be on storage that every node mounts. A trial's placement group is one
bundle of ``threads`` CPUs with the local executor (the trial's process trains every stage), or a driver bundle
and one bundle per stage with ``executor=ray`` (``rayspec.cli.tune.trial_bundles``).

[Note: baselines first] Every method run is compared with its seed's sequential run at each evaluation, so it
needs the baseline's weights (``trajectory.pt``) while it trains. The baselines therefore run first, as a Tune
experiment of their own (``tune/baselines``), and the methods after them (``tune/methods``): the distances are
computed during training exactly as the sequential runner computes them, and only the baselines keep their
weights. The price is a barrier: no method starts before the last baseline ends.

[Note: resume] Each phase's Tune experiment is restored (``Tuner.restore``, errored trials rerun) when the same
study runs again with the same runs and overrides; a trial whose ``run.json`` shows it finished is not trained
again, so a changed study starts new experiments that train only what is missing. A trial that was cut off
trains its run afresh; a run that failed (or whose folder was removed) in a trial Tune counts as done is trained
in a new experiment after the restored one, as the sequential runner retrains it. On Ctrl-C Tune saves its state
and returns; the study then stops (``KeyboardInterrupt``) instead of reporting a part of its runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rayspec.cli.study_config import BASELINE, RunSpec, Study, run_config, run_name, run_spec
from rayspec.cli.study_run import (
    failed_record,
    finished_record,
    load_trajectory,
    open_study,
    outcome,
    read_record,
    report_study,
    train_run,
)
from rayspec.cli.tune import trial_bundles

__all__ = ["PHASES", "tune_study"]

log = logging.getLogger(__name__)

PHASES = ("baselines", "methods")
"""The Tune experiments of a study, in order, under ``<output_dir>/tune/`` (see the module's note)."""


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every trial of a study shares (shipped by ``tune.with_parameters``)."""

    study: Study
    cwd: str
    """The directory the study was started in; trials run there, as the sequential runner does."""


def _point(spec: RunSpec) -> dict[str, Any]:
    """A trial's parameters: the run it trains (``label``, ``stages``, ``seed``, ``lr``: None for the study's)."""
    return {"label": spec.label, "stages": spec.stages, "seed": spec.seed, "lr": spec.lr}


def _spec(study: Study, config: dict[str, Any]) -> RunSpec:
    p = config["run"]
    return run_spec(study, p["label"], int(p["stages"]), int(p["seed"]), p.get("lr"))


def _trial(point: dict[str, Any], setup: _Setup) -> None:
    """One Tune trial: train one run of the study (unless its ``run.json`` shows it finished) and report it."""
    import ray
    from ray import tune

    if Path(setup.cwd).is_dir():
        os.chdir(setup.cwd)  # relative paths (data.root=...) mean what they mean to the sequential runner
    study = setup.study
    spec = _spec(study, point)
    runs = study.directory / "runs"
    record, trained = finished_record(spec, runs / spec.name), False
    if record is None:
        reference = None
        if spec.reference is not None:
            reference = load_trajectory(runs / spec.reference, read_record(runs / spec.reference))
        record = train_run(study, spec, runs / spec.name, reference,
                           placement_group=ray.util.get_current_placement_group(), bundle_offset=1)
        trained = True
    final = {k: v for k, v in record["final"].items() if isinstance(v, float)}
    tune.report({"status": record["status"], "trained": trained, "seconds": record["seconds"], **final})


class _Resources:
    """Tune's resource callable: a trial's placement group from its run's pipeline settings."""

    def __init__(self, study: Study) -> None:
        self.study = study
        self._cache: dict[str, Any] = {}

    def __call__(self, point: dict[str, Any]) -> Any:
        from ray.tune import PlacementGroupFactory

        p = run_config(self.study, _spec(self.study, point)).pipeline
        bundles, strategy = trial_bundles(p, float(self.study.threads or 1) if p.executor == "local" else None)
        key = json.dumps([bundles, strategy])
        if key not in self._cache:
            self._cache[key] = PlacementGroupFactory(bundles, strategy=strategy)
        return self._cache[key]


def _dirname(trial: Any) -> str:
    """A trial's folder and name: its run's name (``gpipe-n4-seed0``)."""
    p = trial.config["run"]
    return run_name(p["label"], int(p["stages"]), int(p["seed"]), p.get("lr"))


def _tuner(study: Study, phase: str, space: dict[str, Any], specs: Sequence[RunSpec], max_concurrent_trials: int | None,
           resume: bool, callbacks: Sequence[Any]) -> tuple[Any, bool]:
    """The phase's Tuner, and whether it restores an earlier experiment (see the module's note)."""
    from ray import tune

    root = study.directory / "tune"
    path, state_file = root / phase, root / f"{phase}.json"
    state = [[spec.name, spec.overrides] for spec in specs]
    setup = _Setup(study, os.getcwd())
    trainable = tune.with_resources(tune.with_parameters(_trial, setup=setup), resources=_Resources(study))
    saved = json.loads(state_file.read_text()) if state_file.exists() else None
    if resume and saved == state and tune.Tuner.can_restore(path):
        log.info("rayspec.study: resuming the %s trials from %s", phase, path)
        return tune.Tuner.restore(str(path), trainable, resume_errored=True), True
    if path.exists():  # a new experiment; runs finished earlier are skipped by their trials
        aside = path.with_name(f"{phase}-{time.strftime('%Y%m%d-%H%M%S')}")
        path.rename(aside)
        log.info("rayspec.study: moved the earlier %s trials to %s; starting new ones", phase, aside)
    root.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps(state))
    config = tune.TuneConfig(num_samples=1, max_concurrent_trials=max_concurrent_trials, trial_name_creator=_dirname,
                             trial_dirname_creator=_dirname)
    run = tune.RunConfig(name=phase, storage_path=str(root), callbacks=list(callbacks))
    return tune.Tuner(trainable, param_space=space, tune_config=config, run_config=run), False


def tune_study(study: Study, resume: bool = True, max_concurrent_trials: int | None = 1,
               callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train (or resume) every run of ``study`` as Ray Tune trials, baselines first; then write and log the
    report (the sequential runner's, from the same records).

    Args:
        study: from ``load_study``; its ``output_dir`` must be on storage every node of the cluster mounts.
        resume: restore the study's Tune experiments and skip finished runs; ``False`` moves an earlier output
            directory aside and starts afresh.
        max_concurrent_trials: trials at once, at most (None: as many as the cluster's resources hold).
        callbacks: ``ray.tune.Callback`` objects for both phases' new experiments (a restored one keeps its own).

    Returns:
        The contents of ``study_results.json``.
    """
    from ray import tune

    from rayspec.exec.ray.connect import ensure_ray

    study = dataclasses.replace(study, output_dir=str(study.directory))  # the same folder from every node
    runs = open_study(study, resume)
    ensure_ray(run_config(study, runs[0]).ray)
    runs_dir = study.directory / "runs"
    earlier = {spec.name for spec in runs if resume and finished_record(spec, runs_dir / spec.name) is not None}
    errors: dict[str, str] = {}
    for phase in PHASES:
        specs = [spec for spec in runs if (spec.label == BASELINE) == (phase == "baselines")]
        space = {"run": tune.grid_search([_point(spec) for spec in specs])}  # the planned runs, rate sweep included
        log.info("rayspec.study: %s: %d Ray Tune trial%s, at most %s at once", phase, len(specs),
                 "s" * (len(specs) != 1), max_concurrent_trials or "as many as the cluster holds")
        tuner, restored = _tuner(study, phase, space, specs, max_concurrent_trials, resume, callbacks)
        results = _fit(tuner, phase, len(specs))
        if restored and any(finished_record(spec, runs_dir / spec.name) is None for spec in specs):
            # a run that failed, or whose folder was removed since, in a trial that Tune counts as done
            log.info("rayspec.study: the restored %s trials left runs unfinished; training them anew", phase)
            results = _fit(_tuner(study, phase, space, specs, max_concurrent_trials, False, callbacks)[0],
                           phase, len(specs))
        for result in results:
            name = _spec(study, result.config).name
            if result.error is not None:
                errors[name] = f"the Tune trial failed: {type(result.error).__name__}: {result.error}"
        for spec in specs:
            record = read_record(runs_dir / spec.name)
            state = "no run.json" if record is None else outcome(record)
            when = " (finished earlier, skipped)" if spec.name in earlier else ""
            log.info("  %s N=%d seed %d: %s%s", spec.label, spec.stages, spec.seed, errors.get(spec.name, state), when)
    records = {spec.name: _record(runs_dir, spec)
               or failed_record(study, spec, errors.get(spec.name, "the trial left no run.json")) for spec in runs}
    return report_study(study, runs, records, len(runs) - len(earlier))


def _fit(tuner: Any, phase: str, trials: int) -> Any:
    """Run a phase's ``trials`` trials; ``KeyboardInterrupt`` when Tune stopped on an interrupt (it saves its state
    and returns instead of raising), so that no report is written from a part of the runs. Every trial that ran to
    its end reported once; a trial stopped by the interrupt reported nothing (and counts as terminated)."""
    results = tuner.fit()
    cut = trials - sum(1 for r in results if r.error is not None or "status" in (r.metrics or {}))
    if cut:
        raise KeyboardInterrupt(f"{cut} {phase} trial(s) did not finish; the same command resumes the study")
    return results


def _record(runs: Path, spec: RunSpec) -> dict[str, Any] | None:
    """The ``run.json`` of ``spec`` (whatever its status), None when there is none for its overrides."""
    record = read_record(runs / spec.name)
    return record if record is not None and record.get("overrides") == spec.overrides else None
