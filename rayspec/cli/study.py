"""``python -m rayspec.study study=NAME``: every method against sequential training over stage counts and seeds.

A study (``rayspec/conf/study/NAME.yaml``) names one workload as training overrides of the run
configuration, the methods, the stage counts and the seeds. Each run trains through ``rayspec.training.train`` with the
same data order and learning-rate schedule (both depend only on ``seed`` and the overrides); at every
evaluation the run's merged weights are compared with the sequential run's weights at the same update.
The results (``study.md``, ``study_results.json``, ``learning_curves.png``, ``distance.png``, ``prediction.png``) go to the
study's output directory, one sub-directory per run under ``runs/``.

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

import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rayspec.cli.common import USER_ERRORS, split_args
from rayspec.cli.study_config import (
    BASELINE,
    CLI_KEYS,
    DEFAULT_METHODS,
    FINISHED,
    METHODS,
    RUN_FILE,
    STUDIES,
    TRAJECTORY_FILE,
    RunSpec,
    Study,
    StudyError,
    available,
    load_study,
    plan_runs,
    run_config,
    run_name,
)
from rayspec.cli.study_report import write_report
from rayspec.training.progress import duration

__all__ = ["STUDIES", "METHODS", "DEFAULT_METHODS", "BASELINE", "Study", "StudyError", "RunSpec", "available",
           "load_study", "plan_runs", "run_name", "run_study", "train_run", "main"]


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
        self.prediction: list[list[float]] = []  # [step, quality, best scale, quality_flipped]: means over stages
        self.trajectory: dict[int, dict[str, Any]] = {}

    def on_metrics(self, record: dict[str, Any]) -> None:
        if "val_loss" in record:
            self.val.append([record["step"], record["val_loss"], record["val_accuracy"]])
            scored = [[v for k, v in record.items() if k.startswith(f"prediction_{name}/")]
                      for name in ("quality", "best_scale", "quality_flipped")]
            if scored[0]:
                self.prediction.append([record["step"], *(statistics.fmean(v) if v else math.nan for v in scored)])
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

    from rayspec.training import train

    if study.threads is not None:
        torch.set_num_threads(study.threads)
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
            **prediction_figures(summary),
        },
        "curves": {"loss": recorder.loss, "val": recorder.val, "distance": recorder.distance,
                   "prediction": recorder.prediction},
    }
    _write_json(run_dir / RUN_FILE, record)
    return record


def prediction_figures(summary: Mapping[str, Any] | None) -> dict[str, Any]:
    """A SpecTrain run's prediction scores over the whole run (``rayspec.core.predict``): per stage, and the means
    over the stages that predict (the last stage never does)."""
    stages = [st["prediction"] | {"stage": st["stage"]} for st in (summary or {}).get("stage_stats", [])
              if st.get("prediction") and st["prediction"]["quality"] is not None]
    if not stages:
        return {}
    keys = ("quality", "best_scale", "quality_flipped", "quality_kept", "flipped_share")
    return {**{f"prediction_{k}": statistics.fmean(values) if (values := [st[k] for st in stages
                                                                         if st.get(k) is not None]) else None
               for k in keys},
            "prediction_stages": [{k: st.get(k) for k in ("stage", "actions", *keys, "damping")} for st in stages]}


def _trajectory(run_dir: Path, record: dict[str, Any] | None) -> dict[int, dict[str, Any]] | None:
    import torch

    if record is None or record.get("status") != "ok" or not (run_dir / TRAJECTORY_FILE).exists():
        return None
    return torch.load(run_dir / TRAJECTORY_FILE, weights_only=True)


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
    directory = study.directory
    if not resume and directory.exists() and any(directory.iterdir()):
        aside = directory.with_name(f"{directory.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        directory.rename(aside)
        echo(f"rayspec.study: moved the earlier study to {aside}")
    (directory / "runs").mkdir(parents=True, exist_ok=True)
    runs = plan_runs(study)
    baseline = ("vanilla once per seed and stage count (the model has dropout: per-stage random streams)"
                if study.per_stage_baseline else "vanilla once per seed on one stage (bit-exactly sequential training at "
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
            echo(f"{head} {_acc(record)}{error} in {record['seconds']:.1f} s; eta {duration(trained_s / trained * left)}")
        records[spec.name] = record
        if spec.reference is None:
            trajectories[spec.name] = _trajectory(run_dir, record)
    payload = write_report(study, runs, records, directory)
    echo("")
    echo(payload["markdown"])
    total = sum(r["seconds"] for r in records.values())
    echo(f"rayspec.study: {len(runs)} runs, {duration(total)} of training in all ({trained} trained now); wrote "
         f"{directory / 'study.md'}, study_results.json, learning_curves.png, distance.png, prediction.png (SpecTrain methods)")
    return payload


# --------------------------------------------------------------------------- command line

USAGE = """usage: python -m rayspec.study study=NAME [methods=[async,spectrain-paper]] [stages=[2,4]] [seeds=[0,1,2]]
                               [executor=local|ray] [output_dir=DIR] [resume=false] [training overrides]"""


def parse_args(argv: Sequence[str]) -> tuple[str, dict[str, Any], list[str]]:
    """Split ``key=value`` arguments into the study reference, study options and training overrides."""
    return split_args(argv, "study", CLI_KEYS, ("study", "output_dir", "executor"), available(), USAGE, StudyError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m rayspec.study``; returns the exit code (2: bad input, 1: a run failed other than diverging)."""
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
