"""Hydra experiments: every one composes with the paper's settings and smoke-runs with ``debug=smoke`` on Ray;
``debug`` wins whatever the order; W&B offline runs hold the logged loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_data import write_cifar, write_imdb
from test_train import CONF, compose_config
from wandb_offline import offline_runs, read_offline_history

from rayspec.config import ConfigError, from_mapping
from rayspec.training import run_training
from rayspec.training.loggers import build_callbacks, wandb_mode

EXPERIMENTS = sorted(p.stem for p in (Path(CONF) / "experiment").glob("*.yaml"))
PAPER = ["vgg16_cifar10", "resnet152_cifar10", "inceptionv4_cifar10", "snn_cifar10", "lstm_imdb", "transformer_imdb"]


def test_every_paper_workload_has_an_experiment():
    assert set(PAPER) | {"quickstart"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_with_the_papers_settings(name):
    cfg = compose_config(f"+experiment={name}", "data.root=/nonexistent")
    config = from_mapping(cfg)
    assert config.pipeline.method == "spectrain" and config.pipeline.stages == 4
    assert config.optim.momentum == 0.9
    if name == "quickstart":
        return
    assert config.model["size"] == "full"
    assert (config.optim.schedule, config.optim.power) == ("poly", 2.0)
    if name.endswith("cifar10"):
        assert config.data["name"] == "cifar10"
        assert (config.train.batch_size, config.optim.weight_decay) == (128, 5e-4)
    else:
        assert config.data["name"] == "imdb" and config.train.batch_size == 256
    assert 0 < config.train.eval_every < config.train.max_steps  # periodic evaluation


def test_debug_wins_over_the_experiment_in_any_order():
    for overrides in (["+experiment=vgg16_cifar10", "debug=smoke"], ["debug=smoke", "+experiment=vgg16_cifar10"]):
        config = from_mapping(compose_config(*overrides))
        assert config.model == {"name": "vgg16", "size": "tiny"}
        assert (config.train.max_steps, config.train.batch_size, config.train.train_samples) == (4, 16, 256)
        assert config.optim.weight_decay == 5e-4  # what debug does not touch stays the experiment's


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """Small CIFAR-10 batches and an aclImdb/ tree in the real on-disk formats."""
    root = tmp_path_factory.mktemp("data")
    write_cifar(root, per_batch=8, n_test=16)
    words = ["great", "fun", "bad", "boring", "movie", "plot", "actor", "scene"]
    reviews = {label: [" ".join(words[(i * 3 + j + 4 * (label == "neg")) % 8] for j in range(20)) for i in range(12)]
               for label in ("pos", "neg")}
    write_imdb(root, train=reviews, test={k: v[:8] for k, v in reviews.items()})
    return root


FAST = {"quickstart"}  # the rest (bigger tiny models) run with the slow tests


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in EXPERIMENTS])
def test_experiment_smoke_runs_on_ray(name, data_root, tmp_path, ray_session):
    cfg = compose_config(f"+experiment={name}", "debug=smoke", f"data.root={data_root}", "pipeline.cpus_per_stage=0.5",
                         "pipeline.executor=ray")
    summary = run_training(from_mapping(cfg), tmp_path)
    assert summary["updates"] == 4 and summary["stages"] == 4
    assert torch.isfinite(torch.tensor(summary["final_train_loss"]))
    assert 0 <= summary["val_accuracy"] <= 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_accuracy" in r] == [2, 4]  # debug evaluates every 2 updates


def test_experiment_without_data_on_disk_is_a_clear_error(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "rayspec.train", "+experiment=lstm_imdb", f"data.root={tmp_path}",
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "aclImdb" in res.stderr and "error:" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow  # a Ray run with W&B's writer process
def test_wandb_offline_run_holds_the_loss(tmp_path, monkeypatch, ray_session):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose_config("debug=smoke", "logger=wandb", "logger.project=rayspec-test", "pipeline.cpus_per_stage=0.5")
    config = from_mapping(cfg)
    summary = run_training(config, tmp_path, callbacks=build_callbacks(config, tmp_path))
    runs = offline_runs(tmp_path)
    assert len(runs) == 1
    history = read_offline_history(runs[0], wait_s=60)
    losses = [row["loss"] for row in history if "loss" in row]
    expected = [r["loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert losses == pytest.approx(expected) and len(losses) == 2
    assert [row["val_accuracy"] for row in history if "val_accuracy" in row][-1] == pytest.approx(summary["val_accuracy"])
    assert any("samples_per_s" in row for row in history)


def test_wandb_mode_offline_without_a_key(monkeypatch, tmp_path):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode("auto")[0] == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    (tmp_path / "netrc").chmod(0o600)
    assert wandb_mode("auto")[0] == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") == ("disabled", "WANDB_MODE=disabled is set")


@pytest.mark.parametrize(("override", "match"), [
    ("logger.name=tensorboard", "logger='tensorboard' is unknown"),
    ("+logger.colour=red", r"unknown key\(s\) logger.colour"),
])
def test_bad_logger_is_a_clear_error(override, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        build_callbacks(from_mapping(compose_config("logger=wandb", override)), tmp_path)
