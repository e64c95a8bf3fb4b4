"""``python -m rayspec.tune sweep=NAME``: Ray Tune sweeps over training overrides (``sweeps/NAME.yaml``)."""

from __future__ import annotations

import csv
import difflib
import importlib.util
import json
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rayspec.config import ConfigError, from_mapping

__all__ = ["SWEEPS", "Sweep", "SweepError", "load_sweep", "run_sweep", "main"]

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = ROOT / "sweeps"
CONF = ROOT / "conf"
DOMAINS = ("grid", "choice", "loguniform", "uniform", "randint")
SEARCH_ALGS = ("random", "grid", "optuna")
METRICS = ("val_accuracy", "val_loss", "loss", "samples_per_s")
FILE_KEYS = ("name", "overrides", "search_space", "metric", "mode", "num_samples", "scheduler",
             "search_alg", "max_concurrent_trials", "storage_path", "driver_cpus")
CLI_KEYS = ("sweep", "storage_path", "resume", "num_samples", "max_concurrent_trials")
ASHA_KEYS = ("name", "max_t", "grace_period", "reduction_factor")
STATE = "rayspec_sweep.json"
RESULTS = "sweep_results.csv"


class SweepError(ValueError):
    """A sweep file or option that cannot work; the message names the value and the fix."""


@dataclass
class Sweep:
    """A validated sweep: what every trial trains, what varies, and how Tune searches."""

    name: str
    overrides: list[str]
    """Training overrides of every trial: the file's, then the command line's."""
    search_space: dict[str, tuple[str, list[Any]]]
    """Override key -> (domain, arguments); grid/choice values are override literals or plain scalars."""
    metric: str = "val_accuracy"
    mode: str = "max"
    num_samples: int = 1
    scheduler: dict[str, Any] = field(default_factory=lambda: {"name": "fifo"})
    search_alg: str = "random"
    max_concurrent_trials: int | None = None
    storage_path: str = "outputs/sweeps"
    driver_cpus: float | None = None
    """CPUs of each trial's driver bundle; default 0.1 with Ray stages, 1 with ``pipeline.executor=local``."""

    @property
    def directory(self) -> Path:
        """The sweep's output directory, ``<storage_path>/<name>``."""
        return Path(self.storage_path).expanduser().resolve() / self.name


# --------------------------------------------------------------------------- loading and validation


def settings_names(folder: Path) -> list[str]:
    """The names of the settings files (sweeps, studies) in ``folder``."""
    return sorted(p.stem for p in folder.glob("*.yaml"))


def find_settings(ref: str, folder: Path, kind: str, error: type[Exception], plural: str = "") -> Path:
    """The ``kind`` file (sweep, study) for ``kind=REF``: a name in ``folder`` or a path to a ``.yaml`` file."""
    path = Path(ref).expanduser()
    candidates = [path] if path.suffix in (".yaml", ".yml") else [folder / f"{ref}.yaml", path.with_suffix(".yaml")]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    names = ", ".join(settings_names(folder)) or "none"
    raise error(f"{kind}={ref} not found; available {plural or kind + 's'} in {folder}: {names} "
                "(or give a path to a .yaml file)")


def find_sweep(ref: str) -> Path:
    """The sweep file for ``sweep=REF``: a name in ``sweeps/`` or a path to a ``.yaml`` file."""
    return find_settings(ref, SWEEPS, "sweep", SweepError)


def available() -> list[str]:
    """The sweep names in ``sweeps/``."""
    return settings_names(SWEEPS)


def load_sweep(ref: str, overrides: Sequence[str] = (), **options: Any) -> Sweep:
    """Read, check and compose a sweep, before any Ray work.

    Args:
        ref: a sweep name in ``sweeps/`` or a path to a sweep file.
        overrides: training overrides from the command line (after the file's ``overrides``).
        **options: sweep settings that win over the file's (``storage_path``, ``num_samples``, ...).

    Raises:
        SweepError: the file, a key, a domain or a composed training config is invalid.
    """
    path = find_sweep(ref)
    raw = read_settings(path, SweepError, "sweep settings (overrides, search_space, ...)")
    raw.update({k: v for k, v in options.items() if v is not None})
    check_keys(raw, FILE_KEYS, str(path), SweepError)
    where = raw.get("name") or path.stem
    base = list(raw.get("overrides") or [])
    if not all(isinstance(o, str) and ("=" in o or o.startswith("~")) for o in base):
        raise SweepError(f"{where}: overrides must be a list of Hydra override strings like train.max_steps=100")
    space = raw.get("search_space") or {}
    if not isinstance(space, dict) or not space:
        raise SweepError(f"{where}: search_space must map training override keys to domains, e.g. "
                         "optim.lr: {loguniform: [0.001, 0.1]}")
    sweep = Sweep(
        name=str(where), overrides=merge_overrides(base, overrides),
        search_space={str(k): _domain(where, str(k), v) for k, v in space.items()},
        metric=raw.get("metric", "val_accuracy"), mode=raw.get("mode", "max"),
        num_samples=raw.get("num_samples", 1), scheduler=_scheduler(where, raw.get("scheduler", "fifo")),
        search_alg=raw.get("search_alg", "random"), max_concurrent_trials=raw.get("max_concurrent_trials"),
        storage_path=str(raw.get("storage_path", "outputs/sweeps")), driver_cpus=raw.get("driver_cpus"),
    )
    _check_settings(sweep)
    _check_space(sweep)
    return sweep


def read_settings(path: Path, error: type[Exception], what: str) -> dict[str, Any]:
    """The mapping in the YAML file ``path`` (a sweep or study file); ``error`` names a bad file."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise error(f"{path} is not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise error(f"{path} must hold a mapping of {what}")
    return raw


def check_keys(raw: Mapping[str, Any], known: Sequence[str], where: str, error: type[Exception] = SweepError) -> None:
    """Raise ``error`` for the first key of ``raw`` not in ``known``, suggesting the closest known one."""
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise error(f"{where}: unknown key {key!r}; {hint}known keys: {', '.join(known)}")


def _domain(where: str, key: str, spec: Any) -> tuple[str, list[Any]]:
    """``{grid: [...]}`` etc. -> ``(kind, args)``; grid/choice values become override-safe scalars."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise SweepError(f"{where}: search_space.{key} must be one domain like {{choice: [a, b]}}; "
                         f"got {spec!r}; domains: {', '.join(DOMAINS)}")
    kind, args = next(iter(spec.items()))
    if kind not in DOMAINS:
        raise SweepError(f"{where}: search_space.{key} has unknown domain {kind!r}; use one of {', '.join(DOMAINS)}")
    if not isinstance(args, list) or not args:
        raise SweepError(f"{where}: search_space.{key}: {kind} needs a non-empty list, e.g. {{{kind}: [1, 2]}}")
    if kind in ("grid", "choice"):
        return kind, [_scalar(v) for v in args]
    if len(args) != 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        raise SweepError(f"{where}: search_space.{key}: {kind} needs [low, high] numbers; got {args!r}")
    low, high = args
    if low >= high or (kind == "loguniform" and low <= 0):
        raise SweepError(f"{where}: search_space.{key}: {kind} [{low}, {high}] needs "
                         f"{'0 < ' if kind == 'loguniform' else ''}low < high")
    if kind == "randint" and not all(isinstance(a, int) for a in args):
        raise SweepError(f"{where}: search_space.{key}: randint needs integers [low, high) (high excluded)")
    return kind, [low, high]


def _scalar(value: Any) -> Any:
    """Numbers, booleans and None stay; strings and lists become their override literal (e.g. ``[2,2,2,1]``)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return override_value(value)


def override_value(value: Any) -> str:
    """A value as Hydra's override grammar reads it: ``true``, ``null``, ``0.01``, ``[2,2,2,1]``, ``'a b'``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if re.fullmatch(r"[\w./:\-+]+", text) or re.fullmatch(r"'.*'|\[.*\]|\{.*\}", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _scheduler(where: str, spec: Any) -> dict[str, Any]:
    spec = {"name": spec} if isinstance(spec, str) else dict(spec or {})
    name = spec.get("name")
    if name == "fifo" and len(spec) == 1:
        return spec
    if name != "asha":
        raise SweepError(f"{where}: scheduler {name!r} is unknown; use fifo or "
                         "{name: asha, max_t: 8, grace_period: 2, reduction_factor: 2}")
    check_keys(spec, ASHA_KEYS, f"{where}: scheduler")
    asha = {"name": "asha", "max_t": 8, "grace_period": 1, "reduction_factor": 2, **spec}
    if not all(isinstance(asha[k], int) and asha[k] >= 1 for k in ("max_t", "grace_period")):
        raise SweepError(f"{where}: scheduler max_t and grace_period count evaluations; give integers >= 1")
    if asha["grace_period"] > asha["max_t"] or not asha["reduction_factor"] > 1:
        raise SweepError(f"{where}: scheduler needs grace_period <= max_t and reduction_factor > 1; got {spec}")
    return asha


def _check_settings(sweep: Sweep) -> None:
    where = sweep.name
    if not re.fullmatch(r"[\w.\-]+", sweep.name):
        raise SweepError(f"name={sweep.name!r} must be a plain directory name (letters, digits, _ . -)")
    if sweep.metric not in METRICS:
        raise SweepError(f"{where}: metric={sweep.metric!r} is not reported; use one of {', '.join(METRICS)}")
    if sweep.mode not in ("max", "min"):
        raise SweepError(f"{where}: mode={sweep.mode!r} must be max or min")
    for key in ("num_samples", "max_concurrent_trials"):
        v = getattr(sweep, key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise SweepError(f"{where}: {key}={v!r} must be an integer >= 1")
    if sweep.driver_cpus is not None and (not isinstance(sweep.driver_cpus, (int, float)) or sweep.driver_cpus <= 0):
        raise SweepError(f"{where}: driver_cpus={sweep.driver_cpus!r} must be a positive number")
    if sweep.search_alg not in SEARCH_ALGS:
        raise SweepError(f"{where}: search_alg={sweep.search_alg!r} is unknown; use one of {', '.join(SEARCH_ALGS)}")
    kinds = {k: kind for k, (kind, _) in sweep.search_space.items()}
    if sweep.search_alg == "grid":
        ranged = [k for k, kind in kinds.items() if kind not in ("grid", "choice")]
        if ranged:
            raise SweepError(f"{where}: search_alg=grid needs grid or choice domains; {', '.join(ranged)} "
                             "are ranges (use search_alg: random, or list the values)")
    if sweep.search_alg == "optuna":
        grids = [k for k, kind in kinds.items() if kind == "grid"]
        if grids:
            raise SweepError(f"{where}: search_alg=optuna samples and takes no grid domains ({', '.join(grids)}); "
                             "use choice instead")
        if importlib.util.find_spec("optuna") is None:
            raise SweepError(f"{where}: search_alg=optuna needs the optuna package; pip install optuna "
                             "(or use search_alg: random)")


def _check_space(sweep: Sweep) -> None:
    """Compose the training config with every checked value of every key (the others at their first)."""
    first = {k: _examples(d)[0] for k, d in sweep.search_space.items()}
    _compose_checked(sweep.name, sweep.overrides, "overrides")
    for key, domain in sweep.search_space.items():
        for value in _examples(domain):
            sampled = {**first, key: value}
            _compose_checked(sweep.name, trial_overrides(sweep.overrides, sampled), f"search_space {key}={value}")
    base = compose(sweep.overrides)
    try:
        _logger_callbacks(from_mapping(base), sweep.directory, sweep.name, "check")
    except ConfigError as err:
        raise SweepError(f"{sweep.name}: overrides: {err}") from err
    if sweep.scheduler["name"] == "asha" and not base["train"]["eval_every"] and "train.eval_every" not in first:
        raise SweepError(f"{sweep.name}: scheduler asha compares trials at evaluations, but train.eval_every=0 "
                         "evaluates only at the end; add e.g. train.eval_every=50 to the sweep's overrides")


def _examples(domain: tuple[str, list[Any]]) -> list[Any]:
    """Values to check a domain with: every listed value; a range's low end and middle (high is excluded)."""
    kind, args = domain
    if kind in ("grid", "choice"):
        return list(args)
    low, high = args
    if kind == "randint":
        return [low, high - 1]
    return [low, math.sqrt(low * high) if kind == "loguniform" else (low + high) / 2]


def _compose_checked(where: str, overrides: Sequence[str], what: str) -> None:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        from_mapping(compose(overrides))
    except (HydraException, OmegaConfBaseException, ConfigError) as err:
        raise SweepError(f"{where}: {what}: {err}") from err


def compose(overrides: Sequence[str]) -> dict[str, Any]:
    """``conf/config.yaml`` with Hydra overrides applied, as a plain resolved mapping."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = hydra_compose("config", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*groups: Sequence[str]) -> list[str]:
    """Concatenate override lists; a later override of the same key replaces the earlier one."""
    merged: dict[str, str] = {}
    for group in groups:
        for override in group:
            key = _override_key(override)
            merged.pop(key, None)
            merged[key] = override
    return list(merged.values())


def trial_overrides(base: Sequence[str], sampled: Mapping[str, Any]) -> list[str]:
    """The overrides of one trial: ``base`` then the trial's sampled values (``model=resnet50``, ...)."""
    return merge_overrides(base, [f"{k}={v if isinstance(v, str) else override_value(v)}" for k, v in sampled.items()])


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
        if p.executor == "local":
            return [{"CPU": self.setup.driver_cpus or 1.0}], "PACK"
        driver = self.setup.driver_cpus or 0.1
        from rayspec.ray_executor import stage_resources

        cpus, gpus = stage_resources(p.cpus_per_stage, p.gpus_per_stage, p.stages, reserved_cpus=driver)
        stage = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        return [{"CPU": driver}] + [dict(stage) for _ in range(p.stages)], p.placement.upper()


class _Reporter:
    """Turns the trainer's evaluation records into ``tune.report`` calls (one Tune iteration each).

    The final evaluation is reported only after ``train`` returns (``finish``): a scheduler that stops the
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


def _logger_callbacks(config: Any, run_dir: Path, group: str, name: str) -> list[Any]:
    """The loggers of ``logger=...`` (W&B): one run per trial, grouped by the sweep's name."""
    from rayspec.loggers import build_callbacks

    return build_callbacks(config, run_dir, group=group, name=name, job_type="sweep-trial")


def trial(sampled: dict[str, Any], setup: _Setup) -> None:
    """One Tune trial: compose its config, train it in the trial's placement group, report each evaluation."""
    import ray
    from omegaconf import OmegaConf
    from ray import tune

    from rayspec.trainer import train

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
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(cfg), run_dir / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), run_dir / ".hydra" / "overrides.yaml")
    reporter = _Reporter(config.train.max_steps)
    callbacks = [reporter, *_logger_callbacks(config, run_dir, setup.name, context.get_trial_id())]
    train(config, run_dir, echo=print, callbacks=callbacks, placement_group=ray.util.get_current_placement_group(),
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
    state["overrides"] = [o for o in sweep.overrides if not _override_key(o).startswith("ray.")]
    return json.loads(json.dumps(state))


def _start_ray(sweep: Sweep) -> None:
    from rayspec.ray_executor import ensure_ray

    ensure_ray(compose(sweep.overrides).get("ray") or {})


def _tuner(sweep: Sweep, resume: bool, echo: Callable[[str], None]) -> Any:
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
        echo(f"rayspec.tune: resuming sweep {sweep.name} from {exp_dir}")
        return tune.Tuner.restore(str(exp_dir), trainable, resume_errored=True)
    if exp_dir.exists() and any(exp_dir.iterdir()):
        aside = exp_dir.with_name(f"{exp_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        exp_dir.rename(aside)
        echo(f"rayspec.tune: moved the earlier sweep to {aside}")
    exp_dir.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps(_state(sweep), indent=2))
    echo(f"rayspec.tune: starting sweep {sweep.name} in {exp_dir}")
    run_config = tune.RunConfig(name=sweep.name, storage_path=str(exp_dir.parent))
    return tune.Tuner(trainable, param_space=param_space(sweep), tune_config=_tune_config(sweep), run_config=run_config)


def run_sweep(sweep: Sweep, resume: bool = True, echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run (or resume) a sweep with Ray Tune; print the trial table and the best config; write ``sweep_results.csv``.

    Args:
        sweep: from ``load_sweep``.
        resume: continue the sweep in ``sweep.directory`` if Tune can restore it; else start afresh.
        echo: prints one console line.

    Returns:
        One row per trial: ``trial_id``, the swept values, the last reported metrics and ``status``.
    """
    _start_ray(sweep)
    tuner = _tuner(sweep, resume, echo)
    results = tuner.fit()
    rows = sorted((_row(sweep, r) for r in results), key=lambda r: r["trial_id"])
    write_results(rows, sweep.directory / RESULTS)
    for line in report_lines(sweep, rows):
        echo(line)
    echo(f"rayspec.tune: wrote {sweep.directory / RESULTS}")
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

USAGE = """usage: python -m rayspec.tune sweep=NAME [resume=false] [storage_path=DIR] [num_samples=N]
                              [max_concurrent_trials=N] [training overrides, e.g. train.max_steps=50]"""


def parse_args(argv: Sequence[str]) -> tuple[str, dict[str, Any], list[str]]:
    """Split ``key=value`` arguments into the sweep reference, sweep options and training overrides."""
    options: dict[str, Any] = {}
    overrides: list[str] = []
    for arg in argv:
        if "=" not in arg and not arg.startswith("~"):
            raise SweepError(f"argument {arg!r} is not key=value (or a Hydra deletion ~key)\n{USAGE}")
        key, _, value = arg.partition("=")
        if key in CLI_KEYS:
            options[key] = yaml.safe_load(value) if key != "sweep" else value
        else:
            overrides.append(arg)
    if "sweep" not in options:
        raise SweepError(f"give sweep=NAME; available sweeps: {', '.join(available()) or 'none'}\n{USAGE}")
    resume = options.pop("resume", True)
    if not isinstance(resume, bool):
        raise SweepError(f"resume={resume!r} must be true or false")
    options["resume"] = resume
    return options.pop("sweep"), options, overrides


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m rayspec.tune``; returns the exit code (2: bad input, 1: a trial failed)."""
    from rayspec.train import USER_ERRORS

    args = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(f"{USAGE}\navailable sweeps: {', '.join(available()) or 'none'}")
        return 0
    try:
        ref, options, overrides = parse_args(args)
        resume = options.pop("resume")
        sweep = load_sweep(ref, overrides, **options)
        rows = run_sweep(sweep, resume=resume)
    except (SweepError, *USER_ERRORS) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    failed = [r["trial_id"] for r in rows if r["status"] == "ERROR"]
    if failed:
        print(f"error: {len(failed)} trial(s) failed: {', '.join(failed)}; see their error.txt under "
              f"{sweep.directory}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
