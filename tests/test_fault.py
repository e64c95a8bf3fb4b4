"""A stage actor or the driver actor killed mid-run: the run restarts from the last checkpoint and
finishes with the planned updates and the weights of an uninterrupted run."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from benchmarks._shared.processes import KillActor, actor_processes, stage_actor_processes
from rayspec.config import from_mapping
from rayspec.training import RunFailed, run_training


def settings(executor: str = "ray", max_restarts: int = 2, transport: str = "auto") -> dict:
    return {
        "model": {"name": "mlp", "size": "tiny"},
        "data": {"name": "synthetic_image", "train_size": 640, "val_size": 64},
        "pipeline": {"method": "spectrain", "stages": 4, "executor": executor, "cpus_per_stage": 0.5,
                     "transport": transport},
        "train": {"max_steps": 30, "batch_size": 16, "log_every": 1},
        "optim": {"lr": 0.05, "weight_decay": 1e-4},
        "checkpoint": {"every": 5},
        "fault": {"max_restarts": max_restarts},
    }


@pytest.mark.parametrize("transport", [pytest.param("object_store", marks=pytest.mark.slow),
                                       pytest.param("compiled", marks=pytest.mark.slow), "p2p"])
def test_killed_stage_actor_is_restarted_from_the_last_checkpoint(tmp_path, ray_session, transport, caplog):
    killer = KillActor(at=12)
    caplog.set_level(logging.INFO, logger="rayspec")
    summary = run_training(from_mapping(settings(transport=transport)), tmp_path / "ray", callbacks=[killer])
    assert killer.pid is not None and killer.pid not in [p.pid for p in stage_actor_processes()]
    assert summary["updates"] == 30 and torch.isfinite(torch.tensor(summary["final_train_loss"]))
    (restart,) = summary["restarts"]
    assert restart["resumed_from"] in (10, 15) and restart["failed_at_update"] >= 12
    assert restart["lost_updates"] == restart["failed_at_update"] - restart["resumed_from"]
    assert restart["recovery_s"] > 0 and "died" in restart["error"]
    assert any(line.startswith("restart 1/2:") for line in caplog.messages)
    records = [json.loads(line) for line in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 31))  # the lost updates' records were replaced, not duplicated
    # Nothing but time was lost: the weights are those of an uninterrupted run.
    run_training(from_mapping(settings("local")), tmp_path / "local")
    a = torch.load(tmp_path / "ray" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # a Ray run killed and restarted: tens of seconds
def test_without_restarts_a_dead_stage_stops_the_run_and_names_the_checkpoint(tmp_path, ray_session):
    with pytest.raises(RunFailed) as info:
        run_training(from_mapping(settings(max_restarts=0)), tmp_path, callbacks=[KillActor(at=7)])
    text = str(info.value)
    assert "a stage actor died after update" in text and "fault.max_restarts=0" in text
    # The callback runs on what the driver actor streams back, a few updates behind it: the run may have
    # written the checkpoint of update 10 before the kill. The error names the newest one.
    newest = sorted((tmp_path / "checkpoints").glob("step_*.pt"))[-1]
    assert newest.name in ("step_00000005.pt", "step_00000010.pt") and str(newest) in text, text
    assert "checkpoint.resume=auto" in text
    assert not (tmp_path / "summary.json").exists()


def _no_actors_left(timeout_s: float = 20.0) -> bool:
    """No stage or driver actor process of this session is left (within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while stage_actor_processes() or actor_processes("DriverActor"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.slow  # a Ray run killed and restarted: tens of seconds
def test_killed_driver_actor_is_replaced_and_the_run_resumes_from_the_last_checkpoint(tmp_path, ray_session, caplog):
    """The run loop's actor is SIGKILLed: its stage actors go with it, a new driver actor resumes from the
    newest checkpoint, and the run ends with the weights of an uninterrupted run."""
    killer = KillActor(at=12, title="DriverActor")
    caplog.set_level(logging.INFO, logger="rayspec")
    summary = run_training(from_mapping(settings()), tmp_path / "ray", callbacks=[killer])
    assert killer.pid is not None and summary["updates"] == 30
    (restart,) = summary["restarts"]
    assert restart["kind"] == "driver" and "the driver actor died after update" in restart["error"]
    assert restart["resumed_from"] % 5 == 0 and restart["resumed_from"] <= restart["failed_at_update"]
    assert restart["failed_at_update"] >= 12 and restart["recovery_s"] > 0
    assert any(line.startswith("restart 1/2:") and "new driver actor" in line for line in caplog.messages)
    records = [json.loads(line) for line in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 31))
    assert _no_actors_left()  # the dead driver's stages and the finished run's
    run_training(from_mapping(settings("local")), tmp_path / "local")
    a = torch.load(tmp_path / "ray" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_without_restarts_a_dead_driver_actor_stops_the_run_and_names_the_checkpoint(tmp_path, ray_session):
    with pytest.raises(RunFailed) as info:
        run_training(from_mapping(settings(max_restarts=0)), tmp_path, callbacks=[KillActor(at=7, title="DriverActor")])
    text = str(info.value)
    assert "the driver actor died after update" in text and "fault.max_restarts=0" in text
    newest = sorted((tmp_path / "checkpoints").glob("step_*.pt"))[-1]
    assert str(newest) in text and "checkpoint.resume=auto" in text
    assert not (tmp_path / "summary.json").exists()
    assert _no_actors_left()


@pytest.mark.slow  # a Ray run killed and restarted: tens of seconds
def test_a_callback_error_stops_the_driver_actor_and_its_stages(tmp_path, ray_session):
    class Stop:
        def on_metrics(self, record: dict) -> None:
            if record.get("step", 0) >= 5:
                raise KeyError("stop here")

    with pytest.raises(KeyError, match="stop here"):
        run_training(from_mapping(settings()), tmp_path, callbacks=[Stop()])
    assert _no_actors_left()
    assert not (tmp_path / "summary.json").exists()
