"""Ray Tune sweeps: every sweep file composes, a real 2-trial sweep runs and resumes, bad sweeps fail early."""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import logging.handlers
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayspec.cli.sweep import SweepError, available, load_sweep, trial_overrides
from rayspec.cli.tune import RESULTS, _Resources, _Setup, _tuner, param_space, parse_args, run_sweep
from rayspec.config import from_mapping
from rayspec.config.compose import compose, override_value
from rayspec.errors import ConfigError
from rayspec.training.console import relayed_to

TINY = [
    "model=mlp", "model.size=tiny", "pipeline.executor=ray", "pipeline.stages=2", "pipeline.cpus_per_stage=0.4",
    "train.max_steps=20", "train.batch_size=32", "train.eval_every=10", "train.log_every=10",
    "data.train_size=512", "data.val_size=128",
]


def write_sweep(path: Path, **settings) -> Path:
    path.write_text(yaml.safe_dump({"overrides": TINY, "search_space": {"optim.lr": {"grid": [0.01, 0.05]}},
                                    **settings}))
    return path


def one_sample(domain):
    """One value of a Tune domain or grid, as a trial would get it."""
    return domain["grid_search"][0] if isinstance(domain, dict) else domain.sample()


@pytest.mark.parametrize("name", available())
def test_every_sweep_file_loads_and_composes(name):
    sweep = load_sweep(name)
    sampled = {k: one_sample(d) for k, d in param_space(sweep).items()}
    assert set(sampled) == set(sweep.search_space)
    config = from_mapping(compose(trial_overrides(sweep.overrides, sampled)))
    assert config.train.max_steps >= 1


def test_the_shipped_sweeps_exist():
    assert {"lr_method", "partition"} <= set(available())


def test_trial_overrides_are_hydra_strings():
    base = ["model.size=tiny", "optim.lr=0.1"]
    sampled = {"optim.lr": 0.02, "model": "vgg16", "pipeline.balance": override_value([2, 2, 2, 1]),
               "optim.nesterov": True}
    assert trial_overrides(base, sampled) == ["model.size=tiny", "optim.lr=0.02", "model=vgg16",
                                              "pipeline.balance=[2,2,2,1]", "optim.nesterov=true"]
    assert override_value(None) == "null" and override_value("a b") == "'a b'" and override_value(1e-5) == "1e-05"
    config = from_mapping(compose(trial_overrides(base, sampled)))
    assert (config.model["name"], config.model["size"], config.pipeline.balance) == ("vgg16", "tiny", [2, 2, 2, 1])


def test_trial_resources_give_the_driver_and_every_stage_a_bundle(tmp_path, ray_session):
    """Sized from the cluster's CPUs, so it needs the running Ray."""
    setup = _Setup("s", TINY, None, str(tmp_path), str(tmp_path))
    pgf = _Resources(setup)({"pipeline.stages": 3, "pipeline.balance": "[3,2,2]"})
    assert pgf.bundles == [{"CPU": 0.1}, {"CPU": 0.4}, {"CPU": 0.4}, {"CPU": 0.4}]
    assert sum(b["CPU"] for b in _Resources(setup)({}).bundles) <= 1  # two TINY trials fit 2 CPUs at once
    assert _Resources(setup)({"pipeline.executor": "local"}).bundles == [{"CPU": 1.0}]


@pytest.fixture(scope="module")
def tiny_sweep(ray_session, tmp_path_factory):
    """A real 2-trial sweep of 2-stage Ray pipelines (0.9 CPU each, so both run at once on 2 CPUs)."""
    root = tmp_path_factory.mktemp("sweep")
    path = write_sweep(root / "tiny.yaml", max_concurrent_trials=2)
    settings = yaml.safe_load(path.read_text())
    settings["overrides"] += ["logger=wandb", "logger.mode=offline"]  # one offline W&B run per trial
    path.write_text(yaml.safe_dump(settings))
    sweep = load_sweep(str(path), storage_path=str(root / "out"))
    logged = logging.handlers.BufferingHandler(10_000)  # the sweep's lines (caplog is one test's only)
    with relayed_to(logged):
        rows = run_sweep(sweep)
    return path, sweep, rows, [r.getMessage() for r in logged.buffer]


def test_two_trial_sweep_writes_results(tiny_sweep):
    _, sweep, rows, lines = tiny_sweep
    with open(sweep.directory / RESULTS) as f:
        saved = list(csv.DictReader(f))
    assert len(saved) == 2 and {r["status"] for r in saved} == {"TERMINATED"}
    assert {float(r["optim.lr"]) for r in saved} == {0.01, 0.05}
    for r in saved:
        assert 0 <= float(r["val_accuracy"]) <= 1 and math.isfinite(float(r["val_loss"]))
        assert math.isfinite(float(r["loss"])) and float(r["samples_per_s"]) > 0 and r["step"] == "20"
        assert r["evaluations"] == "2"  # train.eval_every=10 of 20 updates: one report per evaluation
        for name in ("metrics.jsonl", "summary.json", "model.pt", ".hydra/config.yaml"):
            assert (Path(r["path"]) / name).exists(), name
        assert "cpus_per_stage: 0.4" in (Path(r["path"]) / ".hydra/config.yaml").read_text()
    text = "\n".join(lines)
    assert "starting sweep tiny" in text and "TERMINATED" in text
    command = next(line.strip() for line in lines if line.strip().startswith("python -m rayspec.train"))
    best = from_mapping(compose(shlex.split(command)[3:]))  # the printed best config is a valid command line
    assert best.optim.lr in (0.01, 0.05) and best.pipeline.stages == 2


def test_sweep_trials_log_to_wandb_offline(tiny_sweep):
    from wandb_offline import offline_runs, read_offline_history

    _, sweep, rows, _ = tiny_sweep
    assert len(rows) == 2
    for r in rows:
        runs = offline_runs(r["path"])
        assert len(runs) == 1, r["path"]
        history = read_offline_history(runs[0], wait_s=60)
        losses = [h["loss"] for h in history if "loss" in h]
        assert len(losses) == 2 and all(math.isfinite(v) for v in losses)  # train.log_every=10 of 20 updates


def test_sweep_resumes_without_new_trials(tiny_sweep, caplog):
    path, sweep, rows, _ = tiny_sweep
    caplog.set_level(logging.INFO, logger="rayspec")
    trial_dirs = sorted(p.name for p in sweep.directory.iterdir() if p.is_dir())
    again = run_sweep(load_sweep(str(path), storage_path=sweep.storage_path))
    assert any("resuming sweep tiny" in line for line in caplog.messages)
    assert [(r["trial_id"], r["val_accuracy"]) for r in again] == [(r["trial_id"], r["val_accuracy"]) for r in rows]
    assert sorted(p.name for p in sweep.directory.iterdir() if p.is_dir()) == trial_dirs
    changed = load_sweep(str(path), ["train.max_steps=30"], storage_path=sweep.storage_path)
    with pytest.raises(SweepError, match="with other settings .*resume=false"):
        run_sweep(changed)
    caplog.clear()
    _tuner(changed, False)  # resume=false: the earlier sweep is moved aside, nothing is lost
    aside = [p for p in sweep.directory.parent.iterdir() if p.name.startswith("tiny-")]
    assert len(aside) == 1 and (aside[0] / RESULTS).exists() and "moved the earlier sweep" in caplog.messages[-2]
    assert not (sweep.directory / RESULTS).exists()


BAD = [
    ({"num_sample": 2}, "unknown key 'num_sample'; did you mean num_samples?"),
    ({"search_space": {"optim.lr": [0.1, 0.2]}}, "must be one domain like {choice: [a, b]}"),
    ({"search_space": {"pipeline.stagse": {"grid": [2]}}}, "search_space pipeline.stagse=2: Could not override"),
    ({"search_space": {"model": {"choice": ["mlp", "alexnet"]}}}, "model=alexnet: In 'config': Could not find"),
    ({"search_space": {"optim.lr": {"grid": [0.1, -1]}}}, "optim.lr=-1 must be a positive number"),
    ({"search_space": {"optim.lr": {"loguniform": [0, 1]}}}, "loguniform [0, 1] needs 0 < low < high"),
    ({"search_space": {"optim.momentum": {"uniform": [0.5, 1.5]}}}, "optim.momentum=1.0 must be in [0, 1)"),
    ({"search_space": {"optim.lr": {"uniform": [0.1]}}}, "uniform needs [low, high] numbers"),
    ({"overrides": ["train.max_steps=0"]}, "overrides: train.max_steps=0 must be >= 1"),
    ({"scheduler": {"name": "fifo", "max_t": 2}}, "scheduler fifo takes no settings"),
    ({"scheduler": {"name": "asha", "max_t": 2, "grace_period": 3}}, "grace_period <= max_t"),
    ({"scheduler": {"name": "asha"}, "overrides": TINY[:-4]}, "train.eval_every=0 evaluates only at the end"),
    ({"search_alg": "grid", "search_space": {"optim.lr": {"uniform": [0.01, 0.1]}}}, "search_alg=grid needs grid"),
    ({"search_alg": "optuna"}, "search_alg=optuna samples and takes no grid domains (optim.lr); use choice"),
    ({"num_samples": 0}, "num_samples=0 must be an integer >= 1"),
]
if importlib.util.find_spec("optuna") is None:
    BAD.append(({"search_alg": "optuna", "search_space": {"optim.lr": {"choice": [0.1]}}},
                "search_alg=optuna needs the optuna package; pip install optuna"))


@pytest.mark.parametrize("settings,message", BAD, ids=[str(b[0])[:60] for b in BAD])
def test_bad_sweep_is_a_clear_error(tmp_path, settings, message):
    with pytest.raises(SweepError) as info:
        load_sweep(str(write_sweep(tmp_path / "bad.yaml", **settings)))
    assert message in str(info.value)


UNKNOWN = [
    ({"search_space": {"optim.lr": {"normal": [0, 1]}}},
     "domain='normal' is unknown for search_space.optim.lr in sweep bad; choose one of grid, choice"),
    ({"metric": "accuracy"}, "metric='accuracy' is unknown in sweep bad (trials report only these); choose one of "
                             "val_accuracy"),
    ({"mode": "maximum"}, "mode='maximum' is unknown in sweep bad; choose one of max, min (did you mean 'max'?)"),
    ({"scheduler": "hyperband"}, "scheduler='hyperband' is unknown in sweep bad (asha as {name: asha, max_t: 8, "
                                 "grace_period: 2, reduction_factor: 2}); choose one of fifo, asha"),
    ({"search_alg": "bayes"}, "search_alg='bayes' is unknown in sweep bad; choose one of random, grid, optuna"),
]


@pytest.mark.parametrize("settings,message", UNKNOWN, ids=[str(b[0])[:60] for b in UNKNOWN])
def test_an_unknown_name_in_a_sweep_is_a_config_error(tmp_path, settings, message):
    with pytest.raises(ConfigError) as info:
        load_sweep(str(write_sweep(tmp_path / "bad.yaml", **settings)))
    assert message in str(info.value)


def test_missing_sweep_lists_the_available_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"sweep='nope' is unknown in .*sweeps \(a path to a .yaml file works "
                                          r"too\); choose one of lr_method, partition"):
        load_sweep("nope")
    with pytest.raises(SweepError, match="absent.yaml not found; available sweeps in .*lr_method, partition"):
        load_sweep(str(tmp_path / "absent.yaml"))


def test_command_line_arguments():
    assert parse_args(["sweep=lr_method", "resume=false", "storage_path=/x", "train.max_steps=5"]) == (
        "lr_method", {"resume": False, "storage_path": "/x"}, ["train.max_steps=5"])
    with pytest.raises(SweepError, match="give sweep=NAME; available sweeps: lr_method"):
        parse_args(["train.max_steps=5"])
    with pytest.raises(SweepError, match="resume='maybe' must be true or false"):
        parse_args(["sweep=lr_method", "resume=maybe"])


@pytest.mark.parametrize("bad", ["nope", "domain"])
def test_cli_reports_bad_sweeps_before_ray_starts(tmp_path, bad):
    ref = "nope" if bad == "nope" else str(write_sweep(tmp_path / "bad.yaml",
                                                        search_space={"optim.lr": {"normal": [0, 1]}}))
    res = subprocess.run([sys.executable, "-m", "rayspec.tune", f"sweep={ref}", f"storage_path={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    expected = "error: sweep='nope' is unknown in" if bad == "nope" else "domain='normal' is unknown"
    assert expected in res.stderr
    assert "Started a local Ray instance" not in res.stderr + res.stdout
    assert not any(tmp_path.glob("*/experiment_state*"))


class _Context:
    """What a trial asks Tune's context for, outside Tune: its directory and id (a local run needs no bundles)."""

    def __init__(self, trial_dir: Path) -> None:
        self.trial_dir = trial_dir

    def get_trial_dir(self) -> str:
        return str(self.trial_dir)

    def get_trial_id(self) -> str:
        return "t0"


def test_a_trial_run_again_continues_from_its_checkpoint_and_wandb_run(tmp_path, monkeypatch):
    """A trial that Tune runs again (a resumed sweep) resumes from its own newest checkpoint and continues its W&B
    run; here its first attempt fails at its second evaluation, after the checkpoint at update 2."""
    import ray.tune
    import ray.util
    from wandb_offline import offline_run_id, offline_runs, read_offline_history

    import rayspec.cli.tune as tune_cli
    from rayspec.training.loggers import RUN_FILE

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(ray.tune, "get_context", lambda: _Context(tmp_path / "trial_0"))
    monkeypatch.setattr(ray.util, "get_current_placement_group", lambda: None)
    reported: list[dict] = []

    def fail_at_4(result: dict) -> None:
        if result["step"] == 4:
            raise RuntimeError("the trial's process died")
        reported.append(result)

    overrides = ["model.size=tiny", "data.train_size=256", "data.val_size=64", "train.batch_size=16",
                 "train.max_steps=6", "train.log_every=2", "train.eval_every=2", "checkpoint.every=2",
                 "pipeline.executor=local", "pipeline.stages=2", "logger=wandb"]
    setup = _Setup("s", overrides, None, str(tmp_path / "out"), str(Path.cwd()))
    monkeypatch.setattr(tune_cli, "_report", fail_at_4)
    with pytest.raises(Exception, match="the trial's process died"):
        tune_cli.trial({"optim.lr": 0.05}, setup)
    run_dir = tmp_path / "out" / "trial_0"
    first = json.loads((run_dir / RUN_FILE).read_text())
    monkeypatch.setattr(tune_cli, "_report", reported.append)
    tune_cli.trial({"optim.lr": 0.05}, setup)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == 2 and summary["updates"] == 6
    assert [r["step"] for r in reported] == [2, 4, 6]  # Tune hears of every evaluation once
    runs = offline_runs(run_dir)
    assert [offline_run_id(r) for r in runs] == [first["id"]] * 2
    history = [sorted({row["_step"] for row in read_offline_history(r, wait_s=60)}) for r in runs]
    assert history == [[2, 4], [6]]  # update 4's loss reached W&B before the failure: not sent again
