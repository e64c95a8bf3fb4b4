"""One run of a study: train it, compare its weights with its baseline's at every evaluation, record ``run.json``.

Both study runners (``rayspec.cli.study`` one run after another, ``rayspec.cli.study_tune`` as Ray Tune trials)
train every run through ``train_run`` and report from the same records, so their reports are the same.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rayspec.cli.study_config import FINISHED, RUN_FILE, TRAJECTORY_FILE, RunSpec, Study, plan_runs, run_config
from rayspec.cli.study_report import write_report
from rayspec.cli.study_stats import DIVERGENCE_FACTOR, diverged_at, score
from rayspec.config import Config
from rayspec.training.progress import duration

__all__ = ["relative_distance", "read_record", "write_json", "finished_record", "train_run", "failed_record", "prediction_figures",
           "load_trajectory", "outcome", "open_study", "report_study"]

log = logging.getLogger(__name__)


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
    """The trainer callback of one run: curves, the weight distance to the baseline, and an early stop when the
    training loss diverges (``rayspec.cli.study_stats.diverged_at``: non-finite, or above 3x the first logged loss)."""

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
            if diverged_at([self.loss[0], self.loss[-1]]) is not None:
                raise FloatingPointError(f"the training loss became {record['loss']} by update {record['step']} "
                                         f"(first logged: {self.loss[0][1]:.4g}; diverged: non-finite or above "
                                         f"{DIVERGENCE_FACTOR:g}x it)")

    def on_weights(self, step: int, state: Mapping[str, Any]) -> None:
        if self.keep:
            self.trajectory[step] = _float_state(state)
        if self.reference is not None and step in self.reference:
            self.distance.append([step, relative_distance(state, self.reference[step])])


def read_record(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, payload: Any) -> None:
    """Write ``payload`` as JSON through a temporary file, so that a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(path)


def finished_record(spec: RunSpec, run_dir: Path) -> dict[str, Any] | None:
    """The record of a finished run with the same overrides (a baseline needs its trajectory too), else None."""
    record = read_record(run_dir)
    if record is None or record.get("status") not in FINISHED or record.get("overrides") != spec.overrides:
        return None
    if spec.reference is None and record["status"] == "ok" and not (run_dir / TRAJECTORY_FILE).exists():
        return None
    return record


def train_run(study: Study, spec: RunSpec, run_dir: Path, reference: Mapping[int, Mapping[str, Any]] | None,
              placement_group: Any = None, bundle_offset: int = 0) -> dict[str, Any]:
    """Train one run into ``run_dir`` (emptied first) and return its record (``status`` ok, diverged or failed);
    writes ``run.json``.

    Args:
        reference: the baseline's weights per evaluated update (its ``trajectory.pt``); None for a baseline.
        placement_group, bundle_offset: a Tune trial's placement group and its first stage bundle
            (``rayspec.training.run_training``); the local executor ignores them.
    """
    import torch

    from rayspec.training import run_training
    from rayspec.training.console import relayed_to

    if study.threads is not None:
        torch.set_num_threads(study.threads)
    if run_dir.exists():  # an unfinished or outdated run: nothing of it is kept
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    config = run_config(study, spec)
    recorder = _Recorder(reference, keep=spec.reference is None)
    status, error, summary = "ok", None, None
    t0, cpu0 = time.perf_counter(), time.process_time()
    log = logging.FileHandler(run_dir / "train.log", mode="w")
    with relayed_to(log):  # the run's lines go to its train.log alone
        try:
            summary = run_training(config, run_dir, callbacks=[recorder], placement_group=placement_group,
                                   bundle_offset=bundle_offset)
        except FloatingPointError as err:
            status, error = "diverged", str(err)
        except Exception as err:  # recorded; the study goes on with the next run
            status, error = "failed", f"{type(err).__name__}: {err}"
    log.close()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    final_val = recorder.val[-1] if recorder.val else None
    if status == "ok" and final_val is not None and not all(math.isfinite(v) for v in final_val[1:]):
        status, error = "diverged", f"val_loss {final_val[1]} at update {final_val[0]}"
    if status == "ok" and spec.reference is None:
        torch.save(recorder.trajectory, run_dir / TRAJECTORY_FILE)
    record = _record(config, spec, status, error, seconds, summary, recorder)
    record["cpu_seconds"] = cpu_seconds
    write_json(run_dir / RUN_FILE, record)
    return record


def failed_record(study: Study, spec: RunSpec, error: str) -> dict[str, Any]:
    """The record of a run that left none (its process or node was lost): ``status`` failed with ``error``."""
    return _record(run_config(study, spec), spec, "failed", error, 0.0, None, _Recorder(None, keep=False))


def _record(config: Config, spec: RunSpec, status: str, error: str | None, seconds: float,
            summary: Mapping[str, Any] | None, recorder: _Recorder) -> dict[str, Any]:
    """``run.json``: what the run is, how it ended, its final figures, its score (``study_stats.score``) and its
    curves; ``eval_split`` says what it evaluated on (``test`` or ``selection``, ``rayspec.data.selection``)."""
    final_val = recorder.val[-1] if recorder.val else None
    p = config.pipeline
    record = {
        "label": spec.label, "method": p.method, "variant": p.variant, "backward": p.backward, "stages": spec.stages,
        "seed": spec.seed, "reference": spec.reference, "overrides": spec.overrides, "status": status, "error": error,
        "lr": config.optim.lr, "eval_split": config.data.get("eval_split", "test"),
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
    return record | {"score": score(record)}


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


def load_trajectory(run_dir: Path, record: dict[str, Any] | None) -> dict[int, dict[str, Any]] | None:
    import torch

    if record is None or record.get("status") != "ok" or not (run_dir / TRAJECTORY_FILE).exists():
        return None
    return torch.load(run_dir / TRAJECTORY_FILE, weights_only=True)


def outcome(record: dict[str, Any]) -> str:
    acc = record["final"]["val_accuracy"]
    return f"val_accuracy {acc:.4f}" if record["status"] == "ok" and acc is not None else record["status"].upper()


def open_study(study: Study, resume: bool) -> list[RunSpec]:
    """Make the study's output directory (``resume=False`` moves an earlier one aside), log what the study
    trains and return its runs in order (``plan_runs``)."""
    directory = study.directory
    if not resume and directory.exists() and any(directory.iterdir()):
        aside = directory.with_name(f"{directory.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        directory.rename(aside)
        log.info("rayspec.study: moved the earlier study to %s", aside)
    (directory / "runs").mkdir(parents=True, exist_ok=True)
    runs = plan_runs(study)
    baseline = ("vanilla once per seed and stage count (the model has dropout: per-stage random streams)"
                if study.per_stage_baseline else "vanilla once per seed on one stage (bit-exactly sequential training at "
                "any stage count)")
    log.info("rayspec.study: %s: %d runs (%s at %s stages, seeds %s; baseline: %s) in %s", study.name, len(runs),
             ", ".join(study.methods), study.stages, study.seeds, baseline, directory)
    return runs


def report_study(study: Study, runs: Sequence[RunSpec], records: Mapping[str, dict[str, Any]],
                 trained: int) -> dict[str, Any]:
    """Write and log the report of ``records`` (``study.md``, ``study_results.json``, plots); return the JSON's
    contents."""
    directory = study.directory
    payload = write_report(study, runs, records, directory)
    log.info("")
    log.info("%s", payload["markdown"])
    total = sum(r["seconds"] for r in records.values())
    log.info("rayspec.study: %d runs, %s of training in all (%d trained now); wrote %s, study_results.json, "
             "learning_curves.png, distance.png, prediction.png (SpecTrain methods)", len(runs), duration(total), trained,
             directory / "study.md")
    return payload
