"""``python -m rayspec.study study=NAME``: every method against sequential SGD over stage counts and seeds.

A study (``conf/study/NAME.yaml``) names one workload as training overrides of ``conf/config.yaml``,
the methods, the stage counts and the seeds. Each run trains through ``rayspec.trainer.train`` with the
same data order and learning-rate schedule (both depend only on ``seed`` and the overrides); at every
evaluation the run's merged weights are compared with the sequential run's weights at the same update.
The results (``study.md``, ``study_results.json``, ``learning_curves.png``, ``distance.png``) go to the
study's output directory, one sub-directory per run under ``runs/``.

[Note: one sequential baseline per seed] A ``vanilla`` pipeline is bit-exactly sequential SGD at any
stage count (``tests/test_stage.py``), so the baseline trains once per seed, on one stage. The exception
is a model with active dropout: each stage draws its masks from its own random stream, so vanilla on
``N`` stages samples other masks than on one; the baseline then trains once per seed and stage count,
and every method is compared with the baseline of its own stage count (the same masks).

[Note: evaluations drain the pipeline] ``train.eval_every`` cuts training into segments; the pipeline
drains at the end of each (like a GPipe flush) and refills after the evaluation, so the asynchronous
methods run a little less stale around evaluations than an undisturbed run would.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rayspec.config import Config, ConfigError, from_mapping
from rayspec.tune import ROOT, compose, merge_overrides

__all__ = ["STUDIES", "METHODS", "Study", "StudyError", "RunSpec", "load_study", "plan_runs", "run_study", "main"]

STUDIES = ROOT / "conf" / "study"
METHODS: dict[str, list[str]] = {
    "vanilla": ["pipeline.method=vanilla"],
    "gpipe": ["pipeline.method=gpipe"],
    "async": ["pipeline.method=async"],
    "pipedream": ["pipeline.method=pipedream"],
    "spectrain-paper": ["pipeline.method=spectrain", "pipeline.variant=paper"],
    "spectrain-consistent": ["pipeline.method=spectrain", "pipeline.variant=consistent"],
    "spectrain-paper-recompute": ["pipeline.method=spectrain", "pipeline.variant=paper", "pipeline.backward=recompute"],
    "spectrain-consistent-recompute": ["pipeline.method=spectrain", "pipeline.variant=consistent",
                                       "pipeline.backward=recompute"],
}
"""Method labels a study may name, and the training overrides each stands for."""
DEFAULT_METHODS = ["async", "pipedream", "spectrain-paper", "spectrain-consistent", "gpipe"]
BASELINE = "sequential"
"""The label of the baseline runs: ``vanilla``, which is sequential SGD."""
FILE_KEYS = ("name", "description", "overrides", "methods", "stages", "seeds", "output_dir", "threads")
CLI_KEYS = ("study", "output_dir", "resume", "methods", "stages", "seeds", "executor", "threads")
RUN_FILE = "run.json"
TRAJECTORY_FILE = "trajectory.pt"
FINISHED = ("ok", "diverged")
OWNED = ("pipeline.method", "pipeline.variant", "pipeline.backward", "pipeline.stages", "seed")


class StudyError(ValueError):
    """A study file or option that cannot work; the message names the value and the fix."""


@dataclass
class Study:
    """A validated study: one workload, the methods, stage counts and seeds, and where results go."""

    name: str
    overrides: list[str]
    """Training overrides of every run: ``pipeline.executor=local``, the file's, then the command line's."""
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    """Method labels (keys of ``METHODS``), each trained at every stage count; the baseline is added."""
    stages: list[int] = field(default_factory=lambda: [2, 4])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    output_dir: str = ""
    """Default ``outputs/studies/<name>``."""
    description: str = ""
    threads: int | None = 1
    """Torch threads of the process that trains the runs (the local executor runs every stage in it); None:
    torch's default. One thread is as fast for small stages and does not thrash a shared machine."""
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

    @property
    def name(self) -> str:
        return run_name(self.label, self.stages, self.seed)

    @property
    def owned(self) -> list[str]:
        """The overrides the study sets for this run: method, variant, backward, stage count and seed."""
        return [*METHODS["vanilla" if self.label == BASELINE else self.label], f"pipeline.stages={self.stages}",
                f"seed={self.seed}"]


def run_name(label: str, stages: int, seed: int) -> str:
    return f"{label}-n{stages}-seed{seed}"


# --------------------------------------------------------------------------- loading and validation


def available() -> list[str]:
    """The study names in ``conf/study/``."""
    return sorted(p.stem for p in STUDIES.glob("*.yaml"))


def find_study(ref: str) -> Path:
    """The study file for ``study=REF``: a name in ``conf/study/`` or a path to a ``.yaml`` file."""
    path = Path(ref).expanduser()
    candidates = [path] if path.suffix in (".yaml", ".yml") else [STUDIES / f"{ref}.yaml", path.with_suffix(".yaml")]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise StudyError(f"study={ref} not found; available studies in {STUDIES}: {', '.join(available()) or 'none'} "
                     "(or give a path to a .yaml file)")


def load_study(ref: str, overrides: Sequence[str] = (), **options: Any) -> Study:
    """Read, check and compose a study before any training.

    Args:
        ref: a study name in ``conf/study/`` or a path to a study file.
        overrides: training overrides from the command line (after the file's ``overrides``).
        **options: study settings that win over the file's (``methods``, ``stages``, ``seeds``, ``output_dir``,
            ``executor``).

    Raises:
        StudyError: the file, a key, a method or a composed training config is invalid.
    """
    path = find_study(ref)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise StudyError(f"{path} is not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise StudyError(f"{path} must hold a mapping of study settings (overrides, methods, stages, seeds, ...)")
    executor = options.pop("executor", None)
    raw.update({k: v for k, v in options.items() if v is not None})
    for key in raw:
        if key not in FILE_KEYS:
            close = difflib.get_close_matches(str(key), FILE_KEYS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise StudyError(f"{path}: unknown key {key!r}; {hint}known keys: {', '.join(FILE_KEYS)}")
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
        threads=raw.get("threads", 1),
    )
    _check(study)
    return study


def _list(where: str, key: str, value: Any, kind: type) -> list[Any]:
    value = [value] if isinstance(value, (str, int)) and not isinstance(value, bool) else value
    if (not isinstance(value, list) or not value or len(set(value)) != len(value)
            or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value)):
        example = "[async, spectrain-paper]" if kind is str else "[2, 4]"
        raise StudyError(f"{where}: {key}={value!r} must be a non-empty list of distinct {kind.__name__}s, "
                         f"e.g. {key}={example}")
    return list(value)


def _check(study: Study) -> None:
    """Check the labels, numbers and every run's composed config; decide whether the baseline is per stage count."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from rayspec.trainer import prepare

    where = study.name
    for label in study.methods:
        if label not in METHODS:
            close = difflib.get_close_matches(label, METHODS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise StudyError(f"{where}: method {label!r} is unknown; {hint}choose from {', '.join(METHODS)}")
    if study.threads is not None and (not isinstance(study.threads, int) or study.threads < 1):
        raise StudyError(f"{where}: threads={study.threads!r} must be an integer >= 1 (or null for torch's default)")
    if any(n < 1 for n in study.stages) or any(s < 0 for s in study.seeds):
        raise StudyError(f"{where}: stages={study.stages} must be >= 1 and seeds={study.seeds} >= 0")
    keyed = {o.split("=", 1)[0].lstrip("+~") for o in study.overrides}
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
        for label in [BASELINE, *study.methods]:
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


def run_config(study: Study, spec: RunSpec) -> Config:
    """The validated config of one run: the study's composed ``base`` with the run's owned keys set.

    The owned keys are plain values (no config groups), so setting them on the composed mapping gives what
    Hydra composes from ``spec.overrides``.
    """
    cfg = copy.deepcopy(study.base or compose(study.overrides))
    for override in spec.owned:
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


def plan_runs(study: Study) -> list[RunSpec]:
    """Every run of the study in order: per seed the baseline(s), then each stage count's methods."""
    runs: list[RunSpec] = []
    for seed in study.seeds:
        for n in study.stages if study.per_stage_baseline else [1]:
            runs.append(RunSpec(BASELINE, n, seed, None))
        for n in study.stages:
            reference = run_name(BASELINE, n if study.per_stage_baseline else 1, seed)
            runs += [RunSpec(label, n, seed, reference) for label in study.methods]
    for spec in runs:
        spec.overrides = merge_overrides(study.overrides, spec.owned)
    return runs


# --------------------------------------------------------------------------- runs


def _float_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items() if v.is_floating_point()}


def relative_distance(weights: Mapping[str, Any], reference: Mapping[str, Any]) -> float:
    """``‖W - W_ref‖ / ‖W_ref‖`` over all floating-point entries of two state_dicts (L2, in float64)."""
    diff, norm = 0.0, 0.0
    for k, ref in reference.items():
        r = ref.double()
        diff += float((weights[k].double() - r).pow(2).sum())
        norm += float(r.pow(2).sum())
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-300)


class _Recorder:
    """The trainer callback of one run: curves, the weight distance to the baseline, early stop on a non-finite loss."""

    def __init__(self, reference: Mapping[int, Mapping[str, Any]] | None, keep: bool) -> None:
        self.reference, self.keep = reference, keep
        self.loss: list[list[float]] = []
        self.val: list[list[float]] = []
        self.distance: list[list[float]] = []
        self.trajectory: dict[int, dict[str, Any]] = {}

    def on_metrics(self, record: dict[str, Any]) -> None:
        if "val_loss" in record:
            self.val.append([record["step"], record["val_loss"], record["val_accuracy"]])
        elif "loss" in record:
            self.loss.append([record["step"], record["loss"]])
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"the training loss became {record['loss']} by update {record['step']}")

    def on_weights(self, step: int, state: Mapping[str, Any]) -> None:
        if self.keep:
            self.trajectory[step] = _float_state(state)
        if self.reference is not None and step in self.reference:
            self.distance.append([step, relative_distance(state, self.reference[step])])


def _read_record(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, payload: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(path)


def _finished(spec: RunSpec, run_dir: Path) -> dict[str, Any] | None:
    """The record of a finished run with the same overrides (a baseline needs its trajectory too), else None."""
    record = _read_record(run_dir)
    if record is None or record.get("status") not in FINISHED or record.get("overrides") != spec.overrides:
        return None
    if spec.reference is None and record["status"] == "ok" and not (run_dir / TRAJECTORY_FILE).exists():
        return None
    return record


def train_run(study: Study, spec: RunSpec, run_dir: Path,
              reference: Mapping[int, Mapping[str, Any]] | None) -> dict[str, Any]:
    """Train one run into ``run_dir`` (emptied first) and return its record (``status`` ok, diverged or failed);
    writes ``run.json``."""
    import torch

    from rayspec.trainer import train

    if run_dir.exists():  # an unfinished or outdated run: nothing of it is kept
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    config = run_config(study, spec)
    recorder = _Recorder(reference, keep=spec.reference is None)
    status, error, summary = "ok", None, None
    t0 = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        try:
            summary = train(config, run_dir, echo=lambda line: print(line, file=log, flush=True), callbacks=[recorder])
        except FloatingPointError as err:
            status, error = "diverged", str(err)
        except Exception as err:  # recorded; the study goes on with the next run
            status, error = "failed", f"{type(err).__name__}: {err}"
    seconds = time.perf_counter() - t0
    final_val = recorder.val[-1] if recorder.val else None
    if status == "ok" and final_val is not None and not all(math.isfinite(v) for v in final_val[1:]):
        status, error = "diverged", f"val_loss {final_val[1]} at update {final_val[0]}"
    if status == "ok" and spec.reference is None:
        torch.save(recorder.trajectory, run_dir / TRAJECTORY_FILE)
    p = config.pipeline
    record = {
        "label": spec.label, "method": p.method, "variant": p.variant, "backward": p.backward, "stages": spec.stages,
        "seed": spec.seed, "reference": spec.reference, "overrides": spec.overrides, "status": status, "error": error,
        "seconds": seconds, "updates": summary["updates"] if summary else None,
        "final": {
            "val_accuracy": final_val[2] if final_val and status == "ok" else None,
            "val_loss": final_val[1] if final_val and status == "ok" else None,
            "train_loss": summary["final_train_loss"] if summary else None,
            "distance": recorder.distance[-1][1] if recorder.distance and status == "ok" else None,
            "mean_distance": (sum(d for _, d in recorder.distance) / len(recorder.distance)
                              if recorder.distance and status == "ok" else None),
        },
        "curves": {"loss": recorder.loss, "val": recorder.val, "distance": recorder.distance},
    }
    _write_json(run_dir / RUN_FILE, record)
    return record


def _trajectory(run_dir: Path, record: dict[str, Any] | None) -> dict[int, dict[str, Any]] | None:
    import torch

    if record is None or record.get("status") != "ok" or not (run_dir / TRAJECTORY_FILE).exists():
        return None
    return torch.load(run_dir / TRAJECTORY_FILE, weights_only=True)


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _acc(record: dict[str, Any]) -> str:
    acc = record["final"]["val_accuracy"]
    return f"val_accuracy {acc:.4f}" if record["status"] == "ok" and acc is not None else record["status"].upper()


def run_study(study: Study, resume: bool = True, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) every run of ``study``, then write and print the report.

    Args:
        study: from ``load_study``.
        resume: skip runs whose ``run.json`` in the output directory shows them finished with the same
            overrides; ``False`` moves an earlier output directory aside and starts afresh.
        echo: prints one console line.

    Returns:
        The contents of ``study_results.json``.
    """
    import torch

    from rayspec.study_report import write_report

    if study.threads is not None:
        torch.set_num_threads(study.threads)
    directory = study.directory
    if not resume and directory.exists() and any(directory.iterdir()):
        aside = directory.with_name(f"{directory.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        directory.rename(aside)
        echo(f"rayspec.study: moved the earlier study to {aside}")
    (directory / "runs").mkdir(parents=True, exist_ok=True)
    runs = plan_runs(study)
    baseline = ("vanilla once per seed and stage count (the model has dropout: per-stage random streams)"
                if study.per_stage_baseline else "vanilla once per seed on one stage (bit-exactly sequential SGD at "
                "any stage count)")
    echo(f"rayspec.study: {study.name}: {len(runs)} runs ({', '.join(study.methods)} at {study.stages} stages, "
         f"seeds {study.seeds}; baseline: {baseline}) in {directory}")
    records: dict[str, dict[str, Any]] = {}
    trajectories: dict[str, dict[int, dict[str, Any]] | None] = {}
    trained_s, trained = 0.0, 0
    for i, spec in enumerate(runs, 1):
        run_dir = directory / "runs" / spec.name
        record = _finished(spec, run_dir) if resume else None
        head = f"[{i}/{len(runs)}] {spec.label} N={spec.stages} seed {spec.seed}:"
        if record is not None:
            echo(f"{head} {_acc(record)} (finished earlier, skipped)")
        else:
            reference = trajectories.get(spec.reference) if spec.reference else None
            record = train_run(study, spec, run_dir, reference)
            trained_s, trained = trained_s + record["seconds"], trained + 1
            left = sum(1 for s in runs[i:] if not resume or _finished(s, directory / "runs" / s.name) is None)
            error = f" ({record['error']})" if record["status"] != "ok" else ""
            echo(f"{head} {_acc(record)}{error} in {record['seconds']:.1f} s; eta {_duration(trained_s / trained * left)}")
        records[spec.name] = record
        if spec.reference is None:
            trajectories[spec.name] = _trajectory(run_dir, record)
    payload = write_report(study, runs, records, directory)
    echo("")
    echo(payload["markdown"])
    echo(f"rayspec.study: wrote {directory / 'study.md'}, study_results.json, learning_curves.png, distance.png")
    return payload


def study_settings(study: Study) -> dict[str, Any]:
    """The study's settings and the composed training config of its first run (for the report)."""
    cfg = from_mapping(study.base or compose(study.overrides))
    settings = {k: v for k, v in asdict(study).items() if k not in ("output_dir", "base")}
    return {**settings, "config": asdict(cfg)}


# --------------------------------------------------------------------------- command line

USAGE = """usage: python -m rayspec.study study=NAME [methods=[async,spectrain-paper]] [stages=[2,4]] [seeds=[0,1,2]]
                               [executor=local|ray] [output_dir=DIR] [resume=false] [training overrides]"""


def parse_args(argv: Sequence[str]) -> tuple[str, dict[str, Any], list[str]]:
    """Split ``key=value`` arguments into the study reference, study options and training overrides."""
    options: dict[str, Any] = {}
    overrides: list[str] = []
    for arg in argv:
        if "=" not in arg and not arg.startswith("~"):
            raise StudyError(f"argument {arg!r} is not key=value (or a Hydra deletion ~key)\n{USAGE}")
        key, _, value = arg.partition("=")
        if key in CLI_KEYS:
            options[key] = value if key in ("study", "output_dir", "executor") else yaml.safe_load(value)
        else:
            overrides.append(arg)
    if "study" not in options:
        raise StudyError(f"give study=NAME; available studies: {', '.join(available()) or 'none'}\n{USAGE}")
    resume = options.pop("resume", True)
    if not isinstance(resume, bool):
        raise StudyError(f"resume={resume!r} must be true or false")
    options["resume"] = resume
    return options.pop("study"), options, overrides


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m rayspec.study``; returns the exit code (2: bad input, 1: a run failed other than diverging)."""
    from rayspec.train import USER_ERRORS

    args = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(f"{USAGE}\nmethods: {', '.join(METHODS)}\navailable studies: {', '.join(available()) or 'none'}")
        return 0
    try:
        ref, options, overrides = parse_args(args)
        resume = options.pop("resume")
        study = load_study(ref, overrides, **options)
        payload = run_study(study, resume=resume)
    except (StudyError, *USER_ERRORS) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    failed = [r["name"] for r in payload["runs"] if r["status"] == "failed"]
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)}; see their train.log under "
              f"{study.directory / 'runs'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
