"""Checkpoints and exact resume: a run stopped after K updates and resumed ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import Stop, StopAfter

from rayspec.config import ConfigError, from_mapping
from rayspec.core.stage import Stage
from rayspec.core.stage_spec import StageSpec
from rayspec.training import run_training
from rayspec.training.checkpoint import CheckpointStore, load_checkpoint


def settings(method: str, variant: str = "paper", executor: str = "local", predictor: str = "linear",
             optim: dict | None = None, **train_opts) -> dict:
    return {
        "model": {"name": "mlp", "size": "tiny"},
        "data": {"name": "synthetic_image", "train_size": 320, "val_size": 64},
        "pipeline": {"method": method, "variant": variant, "stages": 3, "executor": executor, "microbatches": 2,
                     "cpus_per_stage": 0.5, "predictor": predictor},
        # 12 updates of 16 from 320 samples: the run crosses an epoch (20 batches) only when resumed late; eval_every
        # and checkpoint.every interleave so that segments end at 4, 5, 8, 10, 12.
        "train": {"max_steps": 12, "batch_size": 16, "log_every": 1, "eval_every": 4, **train_opts},
        "optim": {"lr": 0.08, "weight_decay": 1e-3, "schedule": "poly", **(optim or {})},
        "checkpoint": {"every": 5, "keep": 2},
    }


def steps_and_values(run_dir: Path) -> list[tuple]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val_loss"), r.get("val_accuracy")) for r in records]


def interrupted_then_resumed(cfg: dict, tmp_path: Path, stop_at: int = 7, resume_executor: str | None = None) -> dict:
    with pytest.raises(Stop):
        run_training(from_mapping(cfg), tmp_path / "b", callbacks=[StopAfter(stop_at)])
    assert not (tmp_path / "b" / "summary.json").exists()
    resumed = json.loads(json.dumps(cfg))
    resumed["checkpoint"]["resume"] = "auto"
    if resume_executor:
        resumed["pipeline"]["executor"] = resume_executor
    return run_training(from_mapping(resumed), tmp_path / "b")


@pytest.mark.parametrize("method,variant,predictor", [
    ("vanilla", "paper", "linear"), ("gpipe", "paper", "linear"), ("async", "paper", "linear"),
    ("pipedream", "paper", "linear"), ("spectrain", "paper", "linear"), ("spectrain", "consistent", "linear"),
    ("spectrain", "paper", "adaptive"),  # the damping and the probe's pending predictions are checkpointed too
    ("spectrain accumulate=2", "paper", "linear"),
    ("spectrain adamw", "paper", "momentum"),  # AdamW's moments and step counts
    ("gpipe adamw clip bf16", "paper", "linear"),  # global clipping, bfloat16 between stages
    ("spectrain adamw clip bf16", "consistent", "adaptive"),
])
def test_resumed_run_equals_uninterrupted_run(tmp_path, method, variant, predictor):
    method, *options = method.split(" ")
    optim = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01} if "adamw" in options else {}
    cfg = settings(method, variant, predictor=predictor, optim=optim)
    if "clip" in options:
        cfg["optim"]["clip_grad_norm"] = 0.5
    if "bf16" in options:
        cfg["train"]["precision"] = "bf16"
    accumulate = [o.split("=")[1] for o in options if o.startswith("accumulate=")]
    cfg["pipeline"]["accumulate"] = int(accumulate[0]) if accumulate else 1
    full = run_training(from_mapping(cfg), tmp_path / "a")
    resumed = interrupted_then_resumed(cfg, tmp_path)
    assert resumed["resumed_from"] == 5 and full["resumed_from"] is None
    a = torch.load(tmp_path / "a" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "model.pt", weights_only=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert steps_and_values(tmp_path / "a") == steps_and_values(tmp_path / "b")  # the same records, none twice
    assert resumed["updates"] == 12 and resumed["final_train_loss"] == full["final_train_loss"]
    assert [st["actions"] for st in resumed["stage_stats"]] == [st["actions"] for st in full["stage_stats"]]
    assert [st.get("prediction") for st in resumed["stage_stats"]] == [st.get("prediction") for st in full["stage_stats"]]
    # keep=2: the final checkpoint and the one before it
    assert [p.name for p in CheckpointStore(tmp_path / "b" / "checkpoints").paths()] == \
        ["step_00000010.pt", "step_00000012.pt"]


def test_resume_depends_on_the_saved_optimizer_state(tmp_path):
    """The control: resuming from a checkpoint with its momentum zeroed ends elsewhere, so the equality above is
    not the result of restarting from scratch or of ignoring the saved state."""
    cfg = settings("spectrain")
    run_training(from_mapping(cfg), tmp_path / "a")
    with pytest.raises(Stop):
        run_training(from_mapping(cfg), tmp_path / "b", callbacks=[StopAfter(7)])
    path = CheckpointStore(tmp_path / "b" / "checkpoints").latest()
    state = load_checkpoint(path)
    buffers = [b["momentum_buffer"] for st in state["stages"] for b in st["optimizer"]["state"].values()]
    assert state["step"] == 5 and len(buffers) == sum(st["parameters"] for st in state["stages"])
    for b in buffers:
        b.zero_()
    torch.save(state, path)
    cfg["checkpoint"]["resume"] = str(path)
    run_training(from_mapping(cfg), tmp_path / "c")
    a = torch.load(tmp_path / "a" / "model.pt", weights_only=True)
    c = torch.load(tmp_path / "c" / "model.pt", weights_only=True)
    assert max((a[k] - c[k]).abs().max().item() for k in a) > 1e-4


def test_a_ray_checkpoint_resumes_on_either_executor(tmp_path, ray_session):
    """Stopped on the Ray executor, resumed locally: the same weights as an uninterrupted local run (the Ray and
    local executors compute the same numbers; the checkpoint does not depend on where the stages ran)."""
    cfg = settings("spectrain", executor="ray")
    local = settings("spectrain")
    run_training(from_mapping(local), tmp_path / "a")
    interrupted_then_resumed(cfg, tmp_path, resume_executor="local")
    a = torch.load(tmp_path / "a" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "model.pt", weights_only=True)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_resume_refuses_a_different_run(tmp_path):
    """Settings the state depends on are refused; the layout may change (tests/test_resplit.py)."""
    cfg = settings("spectrain")
    run_training(from_mapping(cfg), tmp_path / "a")
    for section, key, value, message in [
        ("pipeline", "method", "pipedream", "pipeline.method='spectrain' but this run has pipeline.method='pipedream'"),
        ("optim", "momentum", 0.5, "optim.momentum=0.9 but this run has optim.momentum=0.5"),
        ("pipeline", "accumulate", 2, "pipeline.accumulate=1 but this run has pipeline.accumulate=2"),
        ("train", "batch_size", 32, "train.batch_size=16 but this run has train.batch_size=32"),
        ("train", "max_steps", 12, "already reaches train.max_steps=12"),
    ]:
        other = json.loads(json.dumps(cfg))
        other[section][key] = value
        other["checkpoint"]["resume"] = str(tmp_path / "a")
        with pytest.raises(ConfigError) as info:
            run_training(from_mapping(other), tmp_path / "x")
        assert message in str(info.value)
    with pytest.raises(ConfigError, match="already holds checkpoints of an earlier run"):  # never mixed or overwritten
        run_training(from_mapping(cfg), tmp_path / "a")
    longer = json.loads(json.dumps(cfg))  # max_steps may grow: train on from the final checkpoint
    longer["train"]["max_steps"] = 16
    longer["checkpoint"]["resume"] = str(tmp_path / "a")
    assert run_training(from_mapping(longer), tmp_path / "c")["updates"] == 16
    with pytest.raises(ConfigError, match="not a readable rayspec checkpoint"):
        (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
        cfg["checkpoint"]["resume"] = str(tmp_path / "junk.pt")
        run_training(from_mapping(cfg), tmp_path / "y")


def test_checkpoint_writes_are_atomic(tmp_path, monkeypatch):
    """A write that dies half way leaves the earlier checkpoints and no file under a checkpoint's name."""
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, {"x": torch.ones(3)})

    def die(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", die)
    with pytest.raises(OSError, match="disk full"):
        store.save(2, {"x": torch.ones(3)})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001.pt"]
    assert torch.equal(load_checkpoint(store.latest())["x"], torch.ones(3))


@pytest.mark.parametrize("executor", ["local", "ray"])  # ray: raised in the driver actor, re-raised here
def test_non_finite_loss_names_the_update_and_stage_and_keeps_the_last_checkpoint(executor, tmp_path, request):
    if executor == "ray":
        request.getfixturevalue("ray_session")
    cfg = settings("spectrain", executor=executor, max_steps=40)
    cfg["optim"] = {"lr": 40.0, "momentum": 0.9}  # diverges within a few dozen updates
    cfg["checkpoint"] = {"every": 2}
    with pytest.raises(FloatingPointError) as info:
        run_training(from_mapping(cfg), tmp_path)
    text = str(info.value)
    found = re.search(r"(loss of micro-batch \d+|gradient of \S+) is (nan|inf|-inf|not finite) at update (\d+) "
                      r"on stage (\d)", text)
    assert found and "the last good checkpoint is" in text, text
    update = int(found.group(3))
    latest = CheckpointStore(tmp_path / "checkpoints").latest()
    assert latest is not None and str(latest) in text
    state = load_checkpoint(latest)
    assert state["step"] < update
    assert all(torch.isfinite(t).all() for st in state["stages"] for t in st["module"].values())


def test_non_finite_gradient_names_the_parameter_update_and_stage():
    class ZeroSqrt(torch.nn.Module):  # sqrt at 0: a finite output whose gradient is not
        def forward(self, x):
            return torch.sqrt(x * 0)

    stage = Stage(torch.nn.Sequential(torch.nn.Linear(4, 3), ZeroSqrt()), StageSpec(lr=0.1), 1, 2)
    stage.forward(0, torch.randn(2, 4), torch.tensor([0, 1]))
    with pytest.raises(FloatingPointError, match=r"gradient of 0.weight is not finite at update 1 on stage 1"):
        stage.backward(0, update=True)


def test_cli_reports_divergence_in_one_line(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "rayspec.train", "pipeline.executor=local", "model.size=tiny", "optim.lr=40",
         "train.max_steps=40", "checkpoint.every=2", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert re.match(r"error: the (loss of micro-batch \d+ is \S+|gradient of \S+ is not finite) at update \d+ "
                    r"on stage \d", last), last
    assert "Traceback" not in res.stderr and str(tmp_path / "checkpoints" / "step_") in last
