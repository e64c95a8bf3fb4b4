"""``rayspec tune sweep=NAME`` (``python -m rayspec.tune``): Ray Tune sweeps over training overrides
(``rayspec/experiments/sweeps/NAME.yaml``).

Each trial trains through ``rayspec.training.run_training`` in its own placement group: bundle 0 for the run's
driver, then one bundle per stage (docs/design.md §3).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rayspec.cli.common import split_args
from rayspec.cli.sweep import METRICS, Sweep, SweepError, available, load_sweep, loggers, trial_overrides
from rayspec.config import PipelineConfig, from_mapping
from rayspec.config.compose import compose, override_key
from rayspec.errors import ConfigError, RayspecError

__all__ = ["run_sweep", "trial", "trial_bundles", "param_space", "write_results", "best_row", "report_lines", "parse_args",
           "main"]

log = logging.getLogger(__name__)

CLI_KEYS = ("sweep", "storage_path", "resume", "num_samples", "max_concurrent_trials")
STATE = "rayspec_sweep.json"
RESULTS = "sweep_results.csv"


# --------------------------------------------------------------------------- trials


@dataclass
class _Setup:
    """What every trial of a sweep shares (shipped to trials by ``tune.with_parameters``)."""

    name: str
    overrides: list[str]
    driver_cpus: float | None
    directory: str
    """The sweep's output directory; each trial writes its run files into its Tune trial directory there."""
    cwd: str
    """The directory the sweep was started in; trials run there, as ``rayspec.train`` does."""


class _Resources:
    """Tune's resource callable: bundle 0 for the trial's driver, then one bundle per stage."""

    def __init__(self, setup: _Setup) -> None:
        self.setup = setup
        self._cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, sampled: dict[str, Any]) -> Any:
        from ray.tune import PlacementGroupFactory

        key = tuple(trial_overrides(self.setup.overrides, sampled))
        if key not in self._cache:
            self._cache[key] = PlacementGroupFactory(*self._bundles(list(key)))
        return self._cache[key]

    def _bundles(self, overrides: list[str]) -> tuple[list[dict[str, float]], str]:
        from hydra.errors import HydraException

        try:
            p = from_mapping(compose(overrides)).pipeline
        except (HydraException, ConfigError):  # the trial itself reports the error; it needs only its driver
            return [{"CPU": self.setup.driver_cpus or 1.0}], "PACK"
        return trial_bundles(p, self.setup.driver_cpus)


def trial_bundles(p: PipelineConfig, driver_cpus: float | None = None) -> tuple[list[dict[str, float]], str]:
    """The placement group of one trial that trains with pipeline settings ``p``, as bundles and a strategy: with
    ``pipeline.executor=local`` one bundle of ``driver_cpus`` (default 1) for the trial's process, which trains every
    stage; with Ray stages a driver bundle (default 0.1 CPU) and one bundle per stage (``stage_resources``)."""
    if p.executor == "local":
        return [{"CPU": driver_cpus or 1.0}], "PACK"
    driver = driver_cpus or 0.1
    from rayspec.exec.ray.cluster import stage_resources

    cpus, gpus = stage_resources(p.cpus_per_stage, p.gpus_per_stage, p.stages, reserved_cpus=driver)
    stage = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return [{"CPU": driver}] + [dict(stage) for _ in range(p.stages)], p.placement.upper()


class _Reporter:
    """Turns the trainer's evaluation records into ``tune.report`` calls (one Tune iteration each).

    The final evaluation is reported only after ``run_training`` returns (``finish``): a scheduler that stops the
    trial at that report (ASHA at ``max_t``) then cannot cut off the run's ``summary.json`` and ``model.pt``.
    """

    def __init__(self, final_step: int) -> None:
        self.final_step = final_step
        self.last: dict[str, Any] = {}
        self.final: dict[str, Any] | None = None

    def on_metrics(self, record: dict[str, Any]) -> None:
        if "val_loss" not in record:
            self.last = record
            return
        result: dict[str, Any] = {"step": record["step"], "val_loss": record["val_loss"], "val_accuracy": record["val_accuracy"],
                  **{k: self.last[k] for k in ("loss", "samples_per_s") if k in self.last}}
        if record["step"] >= self.final_step:
            self.final = result
        else:
            _report(result)

    def finish(self) -> None:
        if self.final is not None:
            _report(self.final)


def _report(result: dict[str, Any]) -> None:
    from ray import tune

    tune.report(result)


def trial(sampled: dict[str, Any], setup: _Setup) -> None:
    """One Tune trial: compose its config, train it in the trial's placement group, report each evaluation."""
    import ray
    from omegaconf import OmegaConf
    from ray import tune

    from rayspec.training import run_training
    from rayspec.training.console import ensure_console

    if Path(setup.cwd).is_dir():
        os.chdir(setup.cwd)  # relative paths (data.root=...) mean what they mean to rayspec.train
    context = tune.get_context()
    overrides = trial_overrides(setup.overrides, sampled)
    cfg = compose(overrides)
    config = from_mapping(cfg)
    p = config.pipeline
    if p.executor == "ray":  # the stages take what their bundles hold
        stage_bundles = context.get_trial_resources().bundles[1:]
        if len(stage_bundles) < p.stages:
            raise ConfigError(f"the trial has {len(stage_bundles)} stage bundles for pipeline.stages={p.stages}; "
                              f"check the trial's overrides {overrides}")
        p.cpus_per_stage, p.gpus_per_stage = stage_bundles[0].get("CPU"), stage_bundles[0].get("GPU", 0.0)
        cfg["pipeline"].update(cpus_per_stage=p.cpus_per_stage, gpus_per_stage=p.gpus_per_stage)
    run_dir = Path(setup.directory) / Path(context.get_trial_dir()).name  # Tune's trial directory in storage
    if config.checkpoint.resume is None and config.checkpoint.dir is None:
        # A trial that Tune runs again (a resumed sweep) goes on from its own newest checkpoint, and with it
        # its W&B run; a new trial has none and starts afresh.
        config.checkpoint.resume = cfg["checkpoint"]["resume"] = "auto"
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(cfg), run_dir / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), run_dir / ".hydra" / "overrides.yaml")
    reporter = _Reporter(config.train.max_steps)
    callbacks = [reporter, *loggers(config, run_dir, setup.name, context.get_trial_id())]
    ensure_console()  # the trial's lines on its stdout, which Ray forwards
    run_training(config, run_dir, callbacks=callbacks, placement_group=ray.util.get_current_placement_group(),
                 bundle_offset=1)
    reporter.finish()


# --------------------------------------------------------------------------- the sweep


def param_space(sweep: Sweep) -> dict[str, Any]:
    """The Tune search space: one entry per override key."""
    from ray import tune

    space: dict[str, Any] = {}
    for key, (kind, args) in sweep.search_space.items():
        if kind == "grid" or (kind == "choice" and sweep.search_alg == "grid"):
            space[key] = tune.grid_search(args)
        elif kind == "choice":
            space[key] = tune.choice(args)
        else:
            space[key] = getattr(tune, kind)(*args)
    return space


def _tune_config(sweep: Sweep) -> Any:
    from ray import tune

    scheduler, search_alg = None, None
    if sweep.scheduler["name"] == "asha":
        from ray.tune.schedulers import ASHAScheduler

        s = sweep.scheduler
        scheduler = ASHAScheduler(time_attr="training_iteration", max_t=s["max_t"], grace_period=s["grace_period"],
                                  reduction_factor=s["reduction_factor"])
    if sweep.search_alg == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search_alg = OptunaSearch()
    return tune.TuneConfig(metric=sweep.metric, mode=sweep.mode, num_samples=sweep.num_samples, scheduler=scheduler,
                           search_alg=search_alg, max_concurrent_trials=sweep.max_concurrent_trials)


def _state(sweep: Sweep) -> dict[str, Any]:
    """What a resumed sweep must share with the one it resumes (where it runs may differ: ``ray.*``)."""
    state = asdict(sweep)
    state.pop("storage_path")
    state["overrides"] = [o for o in sweep.overrides if not override_key(o).startswith("ray.")]
    return json.loads(json.dumps(state))


def _start_ray(sweep: Sweep) -> None:
    from rayspec.exec.ray.connect import ensure_ray

    ensure_ray(from_mapping(compose(sweep.overrides)).ray)


def _tuner(sweep: Sweep, resume: bool) -> Any:
    from ray import tune

    setup = _Setup(sweep.name, sweep.overrides, sweep.driver_cpus, str(sweep.directory), os.getcwd())
    trainable = tune.with_resources(tune.with_parameters(trial, setup=setup), resources=_Resources(setup))
    exp_dir = sweep.directory
    state_file = exp_dir / STATE
    if resume and tune.Tuner.can_restore(exp_dir):
        saved = json.loads(state_file.read_text()) if state_file.exists() else None
        if saved is not None and saved != _state(sweep):
            differs = ", ".join(k for k in saved if saved.get(k) != _state(sweep).get(k))
            raise SweepError(f"{exp_dir} holds sweep {sweep.name} with other settings ({differs}); "
                             "pass resume=false to start afresh (the earlier run is moved aside)")
        log.info("rayspec.tune: resuming sweep %s from %s", sweep.name, exp_dir)
        return tune.Tuner.restore(str(exp_dir), trainable, resume_errored=True)
    if exp_dir.exists() and any(exp_dir.iterdir()):
        aside = exp_dir.with_name(f"{exp_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        exp_dir.rename(aside)
        log.info("rayspec.tune: moved the earlier sweep to %s", aside)
    exp_dir.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps(_state(sweep), indent=2))
    log.info("rayspec.tune: starting sweep %s in %s", sweep.name, exp_dir)
    run_config = tune.RunConfig(name=sweep.name, storage_path=str(exp_dir.parent))
    return tune.Tuner(trainable, param_space=param_space(sweep), tune_config=_tune_config(sweep), run_config=run_config)


def run_sweep(sweep: Sweep, resume: bool = True) -> list[dict[str, Any]]:
    """Run (or resume) a sweep with Ray Tune; log the trial table and the best config (INFO, ``rayspec.cli.tune``);
    write ``sweep_results.csv``.

    Args:
        sweep: from ``load_sweep``.
        resume: continue the sweep in ``sweep.directory`` if Tune can restore it; else start afresh.

    Returns:
        One row per trial: ``trial_id``, the swept values, the last reported metrics and ``status``.
    """
    _start_ray(sweep)
    tuner = _tuner(sweep, resume)
    results = tuner.fit()
    rows = sorted((_row(sweep, r) for r in results), key=lambda r: r["trial_id"])
    write_results(rows, sweep.directory / RESULTS)
    for line in report_lines(sweep, rows):
        log.info("%s", line)
    log.info("rayspec.tune: wrote %s", sweep.directory / RESULTS)
    return rows


def _row(sweep: Sweep, result: Any) -> dict[str, Any]:
    metrics = result.metrics or {}
    finished = (Path(result.path) / "summary.json").exists()  # early-stopped trials end before their summary
    status = "ERROR" if result.error else ("TERMINATED" if finished else "STOPPED")
    row: dict[str, Any] = {"trial_id": metrics.get("trial_id") or Path(result.path).name}
    row.update({k: (result.config or {}).get(k) for k in sweep.search_space})
    row.update({k: metrics.get(k) for k in ("step", *METRICS)})
    row.update({"evaluations": metrics.get("training_iteration"), "status": status, "path": result.path})
    return row


def write_results(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """``sweep_results.csv``: one row per trial."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["trial_id"])
        writer.writeheader()
        writer.writerows(rows)


def best_row(sweep: Sweep, rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The trial with the best last ``sweep.metric``, or None if no trial reported it."""
    scored = [r for r in rows if isinstance(r.get(sweep.metric), (int, float)) and math.isfinite(r[sweep.metric])]
    if not scored:
        return None
    return (max if sweep.mode == "max" else min)(scored, key=lambda r: r[sweep.metric])


def report_lines(sweep: Sweep, rows: Sequence[dict[str, Any]]) -> list[str]:
    """The trial table and the best config as a ``python -m rayspec.train`` command line."""
    columns = ["trial_id", *sweep.search_space, "step", *METRICS, "status"]
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    best = best_row(sweep, rows)
    if best is None:
        lines.append(f"no trial reported {sweep.metric}; see the trial errors above")
        return lines
    sampled = {k: best[k] for k in sweep.search_space}
    command = shlex.join(["python", "-m", "rayspec.train", *trial_overrides(sweep.overrides, sampled)])
    lines.append(f"best {sweep.metric} {best[sweep.metric]:.4g} (trial {best['trial_id']}):")
    lines.append(f"  {command}")
    return lines


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


# --------------------------------------------------------------------------- command line

USAGE = """usage: rayspec tune sweep=NAME [resume=false] [storage_path=DIR] [num_samples=N] [max_concurrent_trials=N]
                    [training overrides, e.g. train.max_steps=50]
       (python -m rayspec.tune takes the same arguments; values are read as Hydra overrides)"""


def parse_args(argv: Sequence[str]) -> tuple[str, dict[str, Any], list[str]]:
    """Split Hydra-style ``key=value`` arguments into the sweep reference, sweep options and training overrides."""
    return split_args(argv, "sweep", CLI_KEYS, ("storage_path",), available(), USAGE, SweepError)


def _console() -> None:
    """The sweep's lines on stdout unless this program set up logging (imported here: bad input is reported before
    the training modules load)."""
    from rayspec.training.console import ensure_console

    ensure_console()


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m rayspec.tune``; returns the exit code (2: bad input, 1: a trial failed)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(f"{USAGE}\navailable sweeps: {', '.join(available()) or 'none'}")
        return 0
    try:
        ref, options, overrides = parse_args(args)
        resume = options.pop("resume")
        sweep = load_sweep(ref, overrides, **options)
        _console()
        rows = run_sweep(sweep, resume=resume)
    except RayspecError as err:  # SweepError and every other bad input
        print(f"error: {err}", file=sys.stderr)
        return 2
    failed = [r["trial_id"] for r in rows if r["status"] == "ERROR"]
    if failed:
        print(f"error: {len(failed)} trial(s) failed: {', '.join(failed)}; see their error.txt under "
              f"{sweep.directory}", file=sys.stderr)
    return 1 if failed else 0
