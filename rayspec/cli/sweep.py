"""Sweep files (``rayspec/experiments/sweeps/NAME.yaml``): loading, validation before any Ray work, and each trial's
overrides.

``rayspec.cli.tune`` runs a loaded sweep with Ray Tune.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayspec.cli.common import EXPERIMENTS, check_keys, find_settings, read_settings, settings_names
from rayspec.config import Config, from_mapping
from rayspec.config.compose import compose, merge_overrides, override_value
from rayspec.errors import ConfigError, RayspecError, unknown

__all__ = ["SWEEPS", "METRICS", "Sweep", "SweepError", "available", "load_sweep", "trial_overrides", "loggers"]

SWEEPS = EXPERIMENTS / "sweeps"
"""The sweep files shipped inside the package."""
DOMAINS = ("grid", "choice", "loguniform", "uniform", "randint")
SEARCH_ALGS = ("random", "grid", "optuna")
SCHEDULERS = ("fifo", "asha")
MODES = ("max", "min")
METRICS = ("val_accuracy", "val_loss", "loss", "samples_per_s")
FILE_KEYS = ("name", "overrides", "search_space", "metric", "mode", "num_samples", "scheduler",
             "search_alg", "max_concurrent_trials", "storage_path", "driver_cpus")
ASHA_KEYS = ("name", "max_t", "grace_period", "reduction_factor")


class SweepError(RayspecError):
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


def find_sweep(ref: str) -> Path:
    """The sweep file for ``sweep=REF``: a name in ``rayspec/experiments/sweeps/`` or a path to a ``.yaml`` file."""
    return find_settings(ref, SWEEPS, "sweep", SweepError)


def available() -> list[str]:
    """The sweep names in ``rayspec/experiments/sweeps/``."""
    return settings_names(SWEEPS)


def load_sweep(ref: str, overrides: Sequence[str] = (), **options: Any) -> Sweep:
    """Read, check and compose a sweep, before any Ray work.

    Args:
        ref: a sweep name in ``rayspec/experiments/sweeps/`` or a path to a sweep file.
        overrides: training overrides from the command line (after the file's ``overrides``).
        **options: sweep settings that win over the file's (``storage_path``, ``num_samples``, ...).

    Raises:
        SweepError: the file, a key, a value or a composed training config is invalid.
        ConfigError: an unknown name: of the sweep, a domain, the scheduler, the search algorithm, the metric or
            the mode (``rayspec.errors.unknown``).
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


def _domain(where: str, key: str, spec: Any) -> tuple[str, list[Any]]:
    """``{grid: [...]}`` etc. -> ``(kind, args)``; grid/choice values become override-safe scalars."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise SweepError(f"{where}: search_space.{key} must be one domain like {{choice: [a, b]}}; "
                         f"got {spec!r}; domains: {', '.join(DOMAINS)}")
    kind, args = next(iter(spec.items()))
    if kind not in DOMAINS:
        raise unknown("domain", kind, DOMAINS, f" for search_space.{key} in sweep {where}")
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


def _scheduler(where: str, spec: Any) -> dict[str, Any]:
    spec = {"name": spec} if isinstance(spec, str) else dict(spec or {})
    name = spec.get("name")
    if name not in SCHEDULERS:
        raise unknown("scheduler", name, SCHEDULERS,
                      f" in sweep {where} (asha as {{name: asha, max_t: 8, grace_period: 2, reduction_factor: 2}})")
    if name == "fifo":
        if len(spec) > 1:
            raise SweepError(f"{where}: scheduler fifo takes no settings; got {spec}")
        return spec
    check_keys(spec, ASHA_KEYS, f"{where}: scheduler", SweepError)
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
        raise unknown("metric", sweep.metric, METRICS, f" in sweep {where} (trials report only these)")
    if sweep.mode not in MODES:
        raise unknown("mode", sweep.mode, MODES, f" in sweep {where}")
    for key in ("num_samples", "max_concurrent_trials"):
        v = getattr(sweep, key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise SweepError(f"{where}: {key}={v!r} must be an integer >= 1")
    if sweep.driver_cpus is not None and (not isinstance(sweep.driver_cpus, (int, float)) or sweep.driver_cpus <= 0):
        raise SweepError(f"{where}: driver_cpus={sweep.driver_cpus!r} must be a positive number")
    if sweep.search_alg not in SEARCH_ALGS:
        raise unknown("search_alg", sweep.search_alg, SEARCH_ALGS, f" in sweep {where}")
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
        loggers(from_mapping(base), sweep.directory, sweep.name, "check")
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


def trial_overrides(base: Sequence[str], sampled: Mapping[str, Any]) -> list[str]:
    """The overrides of one trial: ``base`` then the trial's sampled values (``model=resnet50``, ...)."""
    return merge_overrides(base, [f"{k}={v if isinstance(v, str) else override_value(v)}" for k, v in sampled.items()])


def loggers(config: Config, run_dir: Path, group: str, name: str) -> list[Any]:
    """The loggers of ``logger=...`` (W&B) for one trial: one run per trial, grouped by the sweep's name."""
    from rayspec.training.loggers import build_callbacks

    return build_callbacks(config, run_dir, group=group, name=name, job_type="sweep-trial")
