"""Studies on Ray Tune: the same report as the sequential runner, trials side by side, resume through Tune."""

from __future__ import annotations

import logging
import logging.handlers
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import ray
import yaml
from ray import tune

from rayspec.cli.study import main, run_study, runner_options
from rayspec.cli.study_config import StudyError, load_study
from rayspec.cli.study_tune import tune_study
from rayspec.cli.tune import trial_bundles
from rayspec.config import from_mapping
from rayspec.config.compose import compose
from rayspec.errors import ConfigError
from rayspec.training.console import relayed_to

TINY = [
    "model=mlp", "model.size=tiny", "data.train_size=512", "data.val_size=128", "data.noise=1.0",
    "train.max_steps=8", "train.batch_size=32", "train.eval_every=4", "train.log_every=2",
    "optim.lr=0.1", "optim.schedule=poly",
]


def write_study(path: Path) -> Path:
    path.write_text(yaml.safe_dump({"overrides": TINY, "methods": ["gpipe", "spectrain-paper"], "stages": [2],
                                    "seeds": [0]}))
    return path


class Spans(tune.Callback):
    """When each trial started and ended, as Tune's driver saw it (trial name -> [start, end]), and at every step of
    Tune's loop the trials under way (pending or running) with the CPUs left free (a trial's placement group holds
    its CPU from before its process starts)."""

    def __init__(self) -> None:
        self.spans: dict[str, list[float]] = {}
        self.steps: set[tuple[int, float]] = set()

    def on_step_begin(self, iteration, trials, **info) -> None:
        under_way = sum(t.status in ("PENDING", "RUNNING") for t in trials)
        self.steps.add((under_way, ray.available_resources().get("CPU", 0.0)))

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self.spans[str(trial)] = [time.monotonic(), math.inf]

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.spans[str(trial)][1] = time.monotonic()


@pytest.fixture(scope="module")
def studies(ray_session, tmp_path_factory):
    """A tiny study (a baseline, gpipe and spectrain at 2 stages) by the sequential runner and on Tune with two
    trials at once."""
    root = tmp_path_factory.mktemp("study")
    path = write_study(root / "tiny.yaml")
    sequential = run_study(load_study(str(path), output_dir=str(root / "seq")))
    spans = Spans()
    logged = logging.handlers.BufferingHandler(10_000)  # the study's lines (caplog is one test's only)
    with relayed_to(logged):
        tuned = tune_study(load_study(str(path), output_dir=str(root / "tune")), max_concurrent_trials=2,
                           callbacks=[spans])
    return root, path, sequential, tuned, [r.getMessage() for r in logged.buffer], spans


def test_a_study_on_tune_reports_what_the_sequential_runner_reports(studies):
    """The baseline first as its own Tune experiment, then two method trials side by side: every figure of the
    report equals the sequential runner's."""
    root, _, sequential, tuned, lines, spans = studies
    assert tuned["table"] == sequential["table"] and tuned["markdown"] == sequential["markdown"]
    seq_runs, tune_runs = ({r["name"]: r for r in p["runs"]} for p in (sequential, tuned))
    assert set(tune_runs) == set(seq_runs) == {"sequential-n1-seed0", "gpipe-n2-seed0", "spectrain-paper-n2-seed0"}
    for name, run in seq_runs.items():
        assert tune_runs[name]["status"] == run["status"] == "ok"
        assert (tune_runs[name]["final"], tune_runs[name]["curves"]) == (run["final"], run["curves"]), name
    assert tune_runs["spectrain-paper-n2-seed0"]["final"]["distance"] > 1e-6  # compared with the baseline
    for name in ("study.md", "study_results.json", "learning_curves.png", "distance.png", "prediction.png"):
        assert (root / "tune" / name).exists(), name
    baseline, a, b = (spans.spans[name] for name in ("sequential-n1-seed0", "gpipe-n2-seed0",
                                                      "spectrain-paper-n2-seed0"))
    assert baseline[1] <= min(a[0], b[0])  # the baseline first
    # side by side: both method trials under way at once, holding both CPUs (one at a time, never two under way)
    assert (2, 0.0) in spans.steps and max(n for n, _ in spans.steps) == 2
    assert "(3 trained now)" in lines[-1]


@pytest.mark.slow
def test_a_study_on_tune_resumes_through_tune(studies, caplog):
    """The same study again, after a run's folder was removed: both experiments are restored, and only that run
    trains anew."""
    root, path, sequential, _, _, _ = studies
    shutil.rmtree(root / "tune" / "runs" / "gpipe-n2-seed0")
    caplog.set_level(logging.INFO, logger="rayspec")
    resumed = tune_study(load_study(str(path), output_dir=str(root / "tune")), max_concurrent_trials=2)
    again = caplog.messages
    assert any("resuming the baselines trials" in line for line in again)
    assert any("resuming the methods trials" in line for line in again)
    assert any("left runs unfinished; training them anew" in line for line in again)
    assert "(1 trained now)" in again[-1] and resumed["table"] == sequential["table"]
    assert "  spectrain-paper N=2 seed 0: val_accuracy 0.0625 (finished earlier, skipped)" in again


def test_trial_placement_groups(ray_session):
    """One bundle for a run on the local executor (the trial's process trains every stage); a driver bundle and one
    per stage on Ray stages."""
    local = from_mapping(compose(["pipeline.executor=local"])).pipeline
    assert trial_bundles(local, 1.0) == ([{"CPU": 1.0}], "PACK")
    staged = from_mapping(compose(["pipeline.executor=ray", "pipeline.stages=3", "pipeline.cpus_per_stage=0.5"]))
    assert trial_bundles(staged.pipeline) == ([{"CPU": 0.1}] + [{"CPU": 0.5}] * 3, "PACK")


def test_runner_options(capsys):
    assert runner_options({}) == ("sequential", 1)
    assert runner_options({"runner": "tune", "max_concurrent_trials": None}) == ("tune", None)
    with pytest.raises(ConfigError, match=r"runner='slurm' is unknown .*; choose one of sequential, tune"):
        runner_options({"runner": "slurm"})
    for options, message in [({"max_concurrent_trials": 4}, "applies to runner=tune"),
                             ({"runner": "tune", "max_concurrent_trials": 0}, "must be an integer >= 1")]:
        with pytest.raises(StudyError, match=message):
            runner_options(options)
    assert main(["study=lstm_text", "runner=tune", "max_concurrent_trials=two"]) == 2
    assert "max_concurrent_trials='two' must be an integer" in capsys.readouterr().err


def test_the_cluster_example_submits_a_study_as_a_job():
    """``examples/cluster/submit_study.sh`` runs ``ray job submit ... -- python -m rayspec.study ...`` (the ``ray``
    command replaced by ``echo``; tests/test_cluster.py submits to a real head)."""
    script = Path(__file__).resolve().parents[1] / "examples" / "cluster" / "submit_study.sh"
    args = ["study=lstm_text", "runner=tune", "output_dir=/shared/studies/lstm_text", "max_concurrent_trials=8"]
    res = subprocess.run([str(script), "http://127.0.0.1:8265", *args], env={**os.environ, "RAY": "echo"},
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    submit, command = res.stdout.strip().split(" -- ")
    assert submit.startswith("job submit --address http://127.0.0.1:8265 --working-dir ")
    assert command == "python -m rayspec.study " + " ".join(args)
