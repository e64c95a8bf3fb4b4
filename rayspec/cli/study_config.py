"""Study files (``rayspec/experiments/studies/NAME.yaml``): loading, validation before any training, and the plan of
runs.

See ``rayspec.cli.study`` for what a study trains and the notes on its baseline.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rayspec.cli.common import EXPERIMENTS, check_keys, find_settings, read_settings, settings_names
from rayspec.config import Config, from_mapping
from rayspec.config.compose import compose, merge_overrides, override_key
from rayspec.core.methods import METHODS
from rayspec.errors import ConfigError, RayspecError, unknown
from rayspec.training.prepare import prepare

__all__ = ["STUDIES", "METHOD_LABELS", "DEFAULT_METHODS", "BASELINE", "Study", "StudyError", "RunSpec", "available",
           "find_study", "load_study", "load_study_part", "run_config", "has_dropout", "plan_runs", "run_name",
           "with_overrides", "predicts", "study_settings", "RUNNERS", "baseline_stages", "run_spec", "sweep_rates"]

STUDIES = EXPERIMENTS / "studies"
"""The study files shipped inside the package."""
METHOD_LABELS: dict[str, list[str]] = {
    "vanilla": ["pipeline.method=vanilla"],
    "gpipe": ["pipeline.method=gpipe"],
    "async": ["pipeline.method=async"],
    "pipedream": ["pipeline.method=pipedream"],
    "spectrain-paper": ["pipeline.method=spectrain", "pipeline.variant=paper"],
    "spectrain-consistent": ["pipeline.method=spectrain", "pipeline.variant=consistent"],
    "spectrain-paper-recompute": ["pipeline.method=spectrain", "pipeline.variant=paper", "pipeline.backward=recompute"],
    "spectrain-consistent-recompute": ["pipeline.method=spectrain", "pipeline.variant=consistent",
                                       "pipeline.backward=recompute"],
    **{f"spectrain-{variant}-{predictor}": ["pipeline.method=spectrain", f"pipeline.variant={variant}",
                                            f"pipeline.predictor={predictor}"]
       for variant in ("paper", "consistent") for predictor in ("momentum", "adaptive")},
    "1f1b": ["pipeline.method=1f1b"],
    "zb1p": ["pipeline.method=zb1p"],
    "interleaved": ["pipeline.method=interleaved", "pipeline.virtual_stages=2"],
    "pipedream-2bw": ["pipeline.method=pipedream-2bw"],
    "spectrain-2bw": ["pipeline.method=spectrain-2bw"],
}
"""The method labels a study may name (``methods=[...]``), each with the training overrides it stands for: a method of
the registry ``rayspec.core.methods.METHODS`` with a variant, predictor or backward."""
DEFAULT_METHODS = ["async", "pipedream", "spectrain-paper", "spectrain-consistent", "gpipe"]
BASELINE = "sequential"
"""The label of the baseline runs: ``vanilla``, which is sequential training (the run's optimizer)."""
FILE_KEYS = ("name", "description", "overrides", "methods", "stages", "seeds", "output_dir", "threads", "lr_sweep",
             "checks")
CLI_KEYS = ("study", "output_dir", "resume", "methods", "stages", "seeds", "executor", "threads", "runner",
            "max_concurrent_trials", "lr_sweep", "checks")
RUNNERS = ("sequential", "tune")
"""How a study's runs are trained: one after another in this process, or as Ray Tune trials (``runner=``)."""
RUN_FILE = "run.json"
TRAJECTORY_FILE = "trajectory.pt"
FINISHED = ("ok", "diverged")
OWNED = ("pipeline.method", "pipeline.variant", "pipeline.predictor", "pipeline.backward", "pipeline.stages",
         "pipeline.virtual_stages", "seed")
SWEEP_KEYS = ("stages", "seeds", "factors")
"""``lr_sweep``: the stage count, the seeds and the multiples of the study's ``optim.lr`` every method trains at."""
CHECK_KEYS = ("methods", "same_as", "seeds")
"""``checks``: methods that compute the updates of the study's method ``same_as`` by construction, trained at these
seeds only (every stage count) and compared with it bit for bit, instead of at every seed and rate."""


class StudyError(RayspecError):
    """A study file or option that cannot work; the message names the value and the fix."""


@dataclass
class Study:
    """A validated study: one workload, the methods, stage counts and seeds, and where results go."""

    name: str
    overrides: list[str]
    """Training overrides of every run: ``pipeline.executor=local``, the file's, then the command line's."""
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    """Method labels (keys of ``METHOD_LABELS``), each trained at every stage count; the baseline is added."""
    stages: list[int] = field(default_factory=lambda: [2, 4])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    output_dir: str = ""
    """Default ``outputs/studies/<name>``."""
    description: str = ""
    threads: int | None = 1
    """Torch threads of the process that trains the runs (the local executor runs every stage in it); None:
    torch's default. One thread is as fast for small stages and does not thrash a shared machine."""
    lr_sweep: dict[str, Any] | None = None
    """Accuracy against the learning rate: ``{stages: N, seeds: [...], factors: [...]}``; every method and the
    baseline train at each multiple of ``optim.lr`` at N stages and those seeds (factor 1 is the study's own run)."""
    checks: dict[str, Any] | None = None
    """``{methods: [...], same_as: LABEL, seeds: [...]}``: each of ``methods`` trains at every stage count and these
    seeds only, and the report checks that its runs equal ``same_as``'s to the last bit (``CHECK_KEYS``)."""
    per_stage_baseline: bool = False
    """Set when the model has active dropout (see the module's note); then one baseline per stage count."""
    base: dict[str, Any] = field(default_factory=dict, repr=False)
    """``overrides`` composed with Hydra once; each run sets only the keys the study owns (``OWNED``) on it."""

    @property
    def directory(self) -> Path:
        return Path(self.output_dir or f"outputs/studies/{self.name}").expanduser().resolve()


@dataclass
class RunSpec:
    """One training run of a study."""

    label: str
    stages: int
    seed: int
    reference: str | None
    """The run name of the baseline this run is compared with (None for a baseline)."""
    overrides: list[str] = field(default_factory=list)
    """Every training override of the run: ``python -m rayspec.train`` with these trains the same run."""
    lr: float | None = None
    """The learning rate of a run of the rate sweep (``Study.lr_sweep``); None: the study's ``optim.lr``."""

    @property
    def name(self) -> str:
        return run_name(self.label, self.stages, self.seed, self.lr)

    @property
    def owned(self) -> list[str]:
        """The overrides the study sets for this run: method, variant, backward, stage count, seed (and rate)."""
        return [*METHOD_LABELS["vanilla" if self.label == BASELINE else self.label], f"pipeline.stages={self.stages}",
                f"seed={self.seed}", *([f"optim.lr={self.lr}"] if self.lr is not None else [])]


def predicts(label: str) -> bool:
    """Whether the method label trains a method that predicts weights (SpecTrain)."""
    method = next(o.split("=", 1)[1] for o in METHOD_LABELS[label] if o.startswith("pipeline.method="))
    return METHODS[method].predicts


def run_name(label: str, stages: int, seed: int, lr: float | None = None) -> str:
    return f"{label}-n{stages}-seed{seed}" + (f"-lr{lr:g}" if lr is not None else "")


# --------------------------------------------------------------------------- loading and validation


def available() -> list[str]:
    """The study names in ``rayspec/experiments/studies/``."""
    return settings_names(STUDIES)


def find_study(ref: str) -> Path:
    """The study file for ``study=REF``: a name in ``rayspec/experiments/studies/`` or a path to a ``.yaml`` file."""
    return find_settings(ref, STUDIES, "study", StudyError, "studies")


def load_study(ref: str, overrides: Sequence[str] = (), **options: Any) -> Study:
    """Read, check and compose a study before any training.

    Args:
        ref: a study name in ``rayspec/experiments/studies/`` or a path to a study file.
        overrides: training overrides from the command line (after the file's ``overrides``).
        **options: study settings that win over the file's (``methods``, ``stages``, ``seeds``, ``output_dir``,
            ``executor``, ``lr_sweep``: False drops the file's).

    Raises:
        StudyError: the file, a key, a value or a composed training config is invalid.
        ConfigError: an unknown name: of the study or a method label (``rayspec.errors.unknown``).
    """
    path = find_study(ref)
    raw = read_settings(path, StudyError, "study settings (overrides, methods, stages, seeds, ...)")
    executor = options.pop("executor", None)
    raw.update({k: v for k, v in options.items() if v is not None})
    check_keys(raw, FILE_KEYS, str(path), StudyError)
    name = str(raw.get("name") or path.stem)
    if not re.fullmatch(r"[\w.\-]+", name):
        raise StudyError(f"name={name!r} must be a plain directory name (letters, digits, _ . -)")
    base = raw.get("overrides") or []
    if not isinstance(base, list) or not all(isinstance(o, str) and ("=" in o or o.startswith("~")) for o in base):
        raise StudyError(f"{name}: overrides must be a list of Hydra override strings like train.max_steps=100")
    cli = [*overrides, *([f"pipeline.executor={executor}"] if executor else [])]
    study = Study(
        name=name, overrides=merge_overrides(["pipeline.executor=local"], base, cli),
        methods=_list(name, "methods", raw.get("methods", DEFAULT_METHODS), str),
        stages=_list(name, "stages", raw.get("stages", [2, 4]), int),
        seeds=_list(name, "seeds", raw.get("seeds", [0, 1, 2]), int),
        output_dir=str(raw.get("output_dir") or ""), description=str(raw.get("description") or "").strip(),
        threads=raw.get("threads", 1), lr_sweep=raw.get("lr_sweep") or None, checks=raw.get("checks") or None,
    )
    _check_checks(study)
    _check(study)
    _check_sweep(study)
    return study


def load_study_part(ref: str, overrides: Sequence[str] = (), **options: Any) -> Study:
    """``load_study`` for training some of a study's runs outside the study runner (the benchmarks): without the
    file's rate sweep and checks, which name methods, stages and seeds that a narrowed study may lack."""
    return load_study(ref, overrides, lr_sweep=False, checks=False, **options)


def _list(where: str, key: str, value: Any, kind: type | tuple[type, ...]) -> list[Any]:
    value = [value] if isinstance(value, (str, int)) and not isinstance(value, bool) else value
    if (not isinstance(value, list) or not value or len(set(value)) != len(value)
            or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value)):
        example = "[async, spectrain-paper]" if kind is str else "[2, 4]"
        noun = kind.__name__ if isinstance(kind, type) else "number"
        raise StudyError(f"{where}: {key}={value!r} must be a non-empty list of distinct {noun}s, "
                         f"e.g. {key}={example}")
    return list(value)


def _check(study: Study) -> None:
    """Check the labels, numbers and every run's composed config; decide whether the baseline is per stage count."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    where = study.name
    for label in [*study.methods, *checked(study)]:
        if label not in METHOD_LABELS:
            raise unknown("method", label, METHOD_LABELS, f" in study {where}")
    if study.threads is not None and (not isinstance(study.threads, int) or study.threads < 1):
        raise StudyError(f"{where}: threads={study.threads!r} must be an integer >= 1 (or null for torch's default)")
    if any(n < 1 for n in study.stages) or any(s < 0 for s in study.seeds):
        raise StudyError(f"{where}: stages={study.stages} must be >= 1 and seeds={study.seeds} >= 0")
    keyed = {override_key(o) for o in study.overrides}
    for owned in OWNED:
        if owned in keyed:
            raise StudyError(f"{where}: the study sets {owned} for every run; give methods=, stages= or seeds= "
                             f"instead of the override {owned}=...")
    try:
        study.base = compose(study.overrides)
        base = from_mapping(study.base)
        t = base.train
        if not t.eval_every or t.eval_every >= t.max_steps:
            raise StudyError(f"{where}: train.eval_every={t.eval_every} gives no evaluations before the end of "
                             f"train.max_steps={t.max_steps}; the weight distance is measured at evaluations, so set "
                             f"e.g. train.eval_every={max(1, t.max_steps // 16)} (about 16 evaluations)")
        for label in [BASELINE, *study.methods, *checked(study)]:
            for n in sorted({1, *study.stages}) if label == BASELINE else study.stages:
                run_config(study, RunSpec(label, n, study.seeds[0], None))
        # the partition of the most stages (fewer stages cut the same blocks coarser) and the model's dropout
        prepared = prepare(run_config(study, RunSpec(BASELINE, max(study.stages), study.seeds[0], None)))
    except StudyError:
        raise
    except (HydraException, OmegaConfBaseException, ConfigError) as err:
        raise StudyError(f"{where}: {err}") from err
    except ValueError as err:  # the model, data or partition cannot take these settings
        raise StudyError(f"{where}: {err}") from err
    study.per_stage_baseline = has_dropout(prepared.model)


def _check_sweep(study: Study) -> None:
    """Check ``lr_sweep``: its keys, a stage count and seeds of the study's own, positive factors including 1."""
    sweep = study.lr_sweep
    if sweep is None:
        return
    where = f"{study.name}: lr_sweep"
    _keyed(sweep, SWEEP_KEYS, where, "lr_sweep: {stages: 4, seeds: [0, 1], factors: [0.333, 0.577, 1, 1.732, 3]}")
    seeds, factors = _list(where, "seeds", sweep["seeds"], int), _list(where, "factors", sweep["factors"], (int, float))
    if sweep["stages"] not in study.stages or not set(seeds) <= set(study.seeds):
        raise StudyError(f"{where}: stages={sweep['stages']!r} must be one of stages={study.stages} and seeds="
                         f"{seeds} among seeds={study.seeds} (factor 1 is the study's own run)")
    if 1 not in factors or any(f <= 0 for f in factors):
        raise StudyError(f"{where}: factors={factors} must be positive multiples of optim.lr and include 1")


def _keyed(value: Any, keys: Sequence[str], where: str, example: str) -> None:
    """Check that a study setting ``value`` is a mapping of exactly ``keys``."""
    if not isinstance(value, dict) or set(value) != set(keys):
        raise StudyError(f"{where}={value!r} must name {', '.join(keys)}, e.g. {example}")


def checked(study: Study) -> list[str]:
    """The method labels of the study's ``checks`` ([] without)."""
    return list(study.checks["methods"]) if study.checks else []


def _check_checks(study: Study) -> None:
    """Check the form of ``checks``: its keys, methods outside ``methods``, a ``same_as`` among them, seeds of the
    study's (``_check`` checks the labels and their runs' configs, as it does the methods')."""
    checks = study.checks
    if checks is None:
        return
    where = f"{study.name}: checks"
    _keyed(checks, CHECK_KEYS, where, "checks: {methods: [1f1b, zb1p], same_as: gpipe, seeds: [0]}")
    labels, seeds = _list(where, "methods", checks["methods"], str), _list(where, "seeds", checks["seeds"], int)
    if checks["same_as"] not in study.methods or set(labels) & set(study.methods) or not set(seeds) <= set(study.seeds):
        raise StudyError(f"{where}: same_as={checks['same_as']!r} must be one of methods={study.methods}, methods="
                         f"{labels} must not be (a method is trained at every seed or checked, not both) and seeds="
                         f"{seeds} must be among seeds={study.seeds}; or drop the checks with checks=false")


def sweep_rates(study: Study) -> list[float | None]:
    """The learning rates of the rate sweep, None standing for the study's own (factor 1); [] without a sweep."""
    if study.lr_sweep is None:
        return []
    lr = float(run_config(study, RunSpec(BASELINE, 1, study.seeds[0], None)).optim.lr)
    return [None if f == 1 else float(f"{f * lr:.4g}") for f in study.lr_sweep["factors"]]


def run_config(study: Study, spec: RunSpec) -> Config:
    """The validated config of one run: the study's composed ``base`` with the run's owned keys set.

    The owned keys are plain values (no config groups), so setting them on the composed mapping gives what
    Hydra composes from ``spec.overrides``; they are overrides this module writes (``key=scalar``), so a split
    reads them, where Hydra's parser reads what a user writes (``rayspec.cli.common.parse_overrides``).
    """
    return with_settings(study.base or compose(study.overrides), spec.owned)


def with_settings(base: Mapping[str, Any], settings: Sequence[str]) -> Config:
    """A copy of the composed mapping ``base`` with each plain ``key=scalar`` of ``settings`` set on it, validated."""
    cfg = copy.deepcopy(dict(base))
    for override in settings:
        key, _, value = override.partition("=")
        *path, leaf = key.split(".")
        node = cfg
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return from_mapping(cfg)


def has_dropout(model: Any) -> bool:
    """Whether training draws random numbers in ``model``: a dropout module, or attention or RNN dropout."""
    from torch import nn
    from torch.nn.modules.dropout import _DropoutNd

    for m in model.modules():
        if isinstance(m, _DropoutNd) and m.p > 0:
            return True
        if isinstance(m, (nn.MultiheadAttention, nn.RNNBase)) and m.dropout > 0:
            return True
    return False


def baseline_stages(study: Study) -> list[int]:
    """The stage counts the baseline trains at: one (bit-exactly sequential training), or each of the study's."""
    return list(study.stages) if study.per_stage_baseline else [1]


def run_spec(study: Study, label: str, stages: int, seed: int, lr: float | None = None) -> RunSpec:
    """The run of ``label`` at ``stages``, ``seed`` (and rate ``lr``), with its baseline and overrides."""
    reference = None if label == BASELINE else run_name(BASELINE, stages if study.per_stage_baseline else 1, seed, lr)
    return with_overrides(study, RunSpec(label, stages, seed, reference, lr=lr))


def plan_runs(study: Study) -> list[RunSpec]:
    """Every run of the study in order: per seed the baseline(s), then each stage count's methods (and checked
    methods at the check seeds); then the rate sweep's runs other than the study's own rate, per rate and seed the
    baseline(s) first."""
    runs: list[RunSpec] = []
    for seed in study.seeds:
        runs += [run_spec(study, BASELINE, n, seed) for n in baseline_stages(study)]
        runs += [run_spec(study, label, n, seed) for n in study.stages for label in study.methods]
        if study.checks and seed in study.checks["seeds"]:
            runs += [run_spec(study, label, n, seed) for n in study.stages for label in checked(study)]
    sweep = study.lr_sweep or {}
    for lr in (r for r in sweep_rates(study) if r is not None):
        for seed in sweep["seeds"]:
            runs += [run_spec(study, BASELINE, n, seed, lr) for n in baseline_stages(study) if n in (1, sweep["stages"])]
            runs += [run_spec(study, label, sweep["stages"], seed, lr) for label in study.methods]
    return runs


def with_overrides(study: Study, spec: RunSpec) -> RunSpec:
    """``spec`` with its ``overrides`` set: the study's, then the keys the study owns for this run."""
    spec.overrides = merge_overrides(study.overrides, spec.owned)
    return spec


def study_settings(study: Study) -> dict[str, Any]:
    """The study's settings and the composed training config of its first run (for the report)."""
    cfg = from_mapping(study.base or compose(study.overrides))
    settings = {k: v for k, v in asdict(study).items() if k not in ("output_dir", "base")}
    return {**settings, "config": asdict(cfg)}
