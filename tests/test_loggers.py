"""A resumed run continues its W&B run (rayspec/training/loggers.py, [Note: W&B resume]), offline here: the id is
kept in the run folder and in every checkpoint, and the steps go on from the checkpoint without sending again
what W&B holds already."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from wandb_offline import offline_run_id, offline_runs, read_offline_history

from rayspec.training import run
from rayspec.training.loggers import RUN_FILE

BASE = ["model.size=tiny", "data.train_size=256", "data.val_size=64", "train.batch_size=16", "train.log_every=2",
        "train.eval_every=2", "checkpoint.every=2", "pipeline.executor=local", "pipeline.stages=2", "logger=wandb",
        "logger.project=rayspec-test"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def steps(run_dir: Path) -> list[tuple[str, list[int]]]:
    """``(W&B run id, its history's steps)`` of every offline run under ``run_dir``, oldest first."""
    return [(offline_run_id(r), sorted({row["_step"] for row in read_offline_history(r, wait_s=60)}))
            for r in offline_runs(run_dir)]


def test_a_resumed_run_continues_its_wandb_run(tmp_path, caplog):
    first = tmp_path / "run"
    run([*BASE, "train.max_steps=6"], first)
    record = json.loads((first / RUN_FILE).read_text())
    wandb_id = record["id"]
    assert record["last_step"] == 6 and record["mode"] == "offline"
    checkpoint = first / "checkpoints" / "step_00000004.pt"
    assert torch.load(checkpoint, weights_only=True)["wandb_id"] == wandb_id
    # Resume from update 4, as after a crash once update 6 had reached W&B: 5-6 are not sent again.
    caplog.set_level(logging.INFO, logger="rayspec")
    summary = run([*BASE, "train.max_steps=8", f"checkpoint.resume={checkpoint}"], first)
    assert summary.resumed_from == 4
    assert f"W&B: continuing run {wandb_id} from update 4; updates 5-6 are in W&B already and are not sent again" in caplog.messages
    assert steps(first) == [(wandb_id, [2, 4, 6]), (wandb_id, [8])]
    assert json.loads((first / RUN_FILE).read_text())["last_step"] == 8
    # Resumed into another run folder: the id comes with the checkpoint, what W&B holds from the checkpoint's folder.
    elsewhere = tmp_path / "elsewhere"
    run([*BASE, "train.max_steps=10", f"checkpoint.resume={first}"], elsewhere)
    assert steps(elsewhere) == [(wandb_id, [10])]
    assert json.loads((elsewhere / RUN_FILE).read_text())["id"] == wandb_id


def test_a_fresh_run_gets_a_new_wandb_id_or_the_given_one(tmp_path):
    run([*BASE, "train.max_steps=2"], tmp_path / "a")
    run([*BASE, "train.max_steps=2"], tmp_path / "b")
    run([*BASE, "train.max_steps=2", "logger.id=mine0001"], tmp_path / "c")
    ids = [json.loads((tmp_path / name / RUN_FILE).read_text())["id"] for name in "abc"]
    assert ids[0] != ids[1] and ids[2] == "mine0001"
    assert steps(tmp_path / "c") == [("mine0001", [2])]
