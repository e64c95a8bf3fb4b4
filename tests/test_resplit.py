"""Resuming on another layout: a checkpoint's state re-split by parameter name onto other stages or another balance."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import Stop, StopAfter, spec_of

from rayspec.config import ConfigError, from_mapping
from rayspec.core.stage import make_stages
from rayspec.partition import split
from rayspec.training import run_training
from rayspec.training.checkpoint import CheckpointStore, check_compatible, load_checkpoint
from rayspec.training.resplit import parameter_names, resplit, stream_seed


def settings(method: str, stages: int, **pipeline) -> dict:
    return {
        "model": {"name": "mlp", "size": "tiny"},  # 7 blocks
        "data": {"name": "synthetic_image", "train_size": 320, "val_size": 64},
        "pipeline": {"method": method, "stages": stages, "executor": "local", "microbatches": 4, **pipeline},
        "train": {"max_steps": 12, "batch_size": 16, "log_every": 1, "eval_every": 4},
        "optim": {"lr": 0.08, "weight_decay": 1e-3, "schedule": "poly"},
        "checkpoint": {"every": 4, "keep": 5},
    }


def resumed(cfg: dict, stages: int | None = None, **pipeline) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["checkpoint"]["resume"] = "auto"
    if stages is not None:
        cfg["pipeline"]["stages"] = stages
    cfg["pipeline"].update(pipeline)
    return cfg


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.mark.parametrize("method,executor,optimizer", [("gpipe", "local", "sgd"), ("vanilla", "local", "sgd"),
                                                      pytest.param("gpipe", "ray", "sgd", marks=pytest.mark.slow),
                                                      ("gpipe", "local", "adamw")])
def test_synchronous_run_resumed_on_2_stages_then_on_4_equals_the_uninterrupted_run(tmp_path, request, method,
                                                                                     executor, optimizer, caplog):
    """4 stages to update 4, 2 stages to update 8 (on ``executor``: the Ray run re-splits in its driver actor), 4
    stages to the end: the weights of an uninterrupted 4-stage run, to rounding (the optimizer's state, SGD's
    momentum or AdamW's moments and step counts, is re-split with the weights)."""
    if executor == "ray":
        request.getfixturevalue("ray_session")
    cfg = settings(method, 4)
    if optimizer == "adamw":
        cfg["optim"] |= {"name": "adamw", "lr": 0.003, "weight_decay": 0.01}
    full = run_training(from_mapping(cfg), tmp_path / "a")
    run = tmp_path / "b"
    with pytest.raises(Stop):
        run_training(from_mapping(cfg), run, callbacks=[StopAfter(5)])
    caplog.set_level(logging.INFO, logger="rayspec")
    with pytest.raises(Stop):
        run_training(from_mapping(resumed(cfg, 2, executor=executor, cpus_per_stage=0.5)), run, callbacks=[StopAfter(9)])
    assert any("re-splitting its partition [2, 2, 2, 1] onto [4, 3]" in line for line in caplog.messages), caplog.messages
    assert load_checkpoint(CheckpointStore(run / "checkpoints").latest())["balance"] == [4, 3]
    summary = run_training(from_mapping(resumed(cfg, 4)), run)
    a, b = weights(tmp_path / "a"), weights(run)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-7, msg=k)
    assert summary["balance"] == full["balance"] == [2, 2, 2, 1] and summary["resumed_from"] == 8
    assert [(c["update"], c["from"], c["to"]) for c in summary["layout_changes"]] == [(4, [2, 2, 2, 1], [4, 3]),
                                                                                      (8, [4, 3], [2, 2, 2, 1])]
    assert [(c["from_stages"], c["to_stages"], c["reason"]) for c in summary["layout_changes"]] == [
        (4, 2, "resumed on another layout"), (2, 4, "resumed on another layout")]
    assert full["layout_changes"] == []
    assert summary["final_train_loss"] == pytest.approx(full["final_train_loss"], rel=1e-5)


def test_spectrain_resumes_on_another_balance_with_fresh_probes(tmp_path):
    """An asynchronous method goes on from the re-split state (not equal to the unchanged layout: its staleness
    changes); the probes start afresh, and settings that are not the layout are still refused."""
    cfg = settings("spectrain", 3)
    with pytest.raises(Stop):
        run_training(from_mapping(cfg), tmp_path, callbacks=[StopAfter(9)])
    before = load_checkpoint(CheckpointStore(tmp_path / "checkpoints").latest())
    assert before["step"] == 8 and all("probe" in st for st in before["stages"])
    other = resumed(cfg, method="pipedream", balance=[1, 1, 5])
    with pytest.raises(ConfigError, match="pipeline.method='spectrain' but this run has pipeline.method='pipedream'"):
        run_training(from_mapping(other), tmp_path)
    summary = run_training(from_mapping(resumed(cfg, balance=[1, 1, 5])), tmp_path)
    assert summary["balance"] == [1, 1, 5] and summary["updates"] == 12
    assert summary["layout_changes"][0] | {"train_s": 0} == {"update": 8, "from_stages": 3, "to_stages": 3,
                                                           "reason": "resumed on another layout", "from": [3, 2, 2],
                                                           "to": [1, 1, 5], "train_s": 0}
    # counters and probes count from the re-split: 4 updates of one micro-batch, a forward and a backward each
    assert [st["actions"] for st in summary["stage_stats"]] == [{"F": 4, "B": 4}] * 3
    assert all(st["prediction"]["actions"] <= 8 for st in summary["stage_stats"][:2])
    assert all(0.0 <= st["busy_fraction"] <= 1.0 for st in summary["stage_stats"])


def tiny_stages(tiny, balance, steps=2, **settings):
    """Stages of ``balance`` after ``steps`` updates (optimizer state set), drained."""
    model, data = tiny
    stages = make_stages(split(copy.deepcopy(model), balance), "spectrain",
                         spec_of(lr=0.05, seed=3, **({"momentum": 0.9} | settings)))
    x, y = data.train.tensors
    for step in range(steps):
        acts = [x[step * 8:(step + 1) * 8]]
        for st in stages:
            acts.append(st.forward(step, acts[-1], y[step * 8:(step + 1) * 8] if st.is_last else None))
        grad = None
        for st in reversed(stages):
            grad = st.backward(step, grad, update=True)
    return stages


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_every_per_parameter_entry_is_cut_by_name(tiny, optimizer):
    """Weights and the optimizer's state per parameter (torch's, keyed by parameter index: SGD's momentum, AdamW's
    moments and step counts) follow their parameter, as do the kept directions; an entry every stage shares (the
    optimizer's name) is copied; the stage's own entries start afresh."""
    model = tiny[0]
    old, new = [2, 2, 2, 1], [4, 3]
    states = [st.checkpoint_state() for st in tiny_stages(tiny, old, optimizer=optimizer)]
    names = parameter_names(model, old)
    by_name = {n: st["optimizer"]["state"][i] for st, stage_names in zip(states, names)
               for i, n in enumerate(stage_names)}
    last = {n: d for st, stage_names in zip(states, names) for n, d in zip(stage_names, st["optimizer"]["last"])}
    assert all(by_name.values()) and len(by_name) == sum(map(len, names))
    cut = resplit(states, model, old, new, seed=3, step=2)
    assert len(cut) == 2
    for k, (st, stage_names) in enumerate(zip(cut, parameter_names(model, new))):
        assert [n for n in st["module"]] == list(split(copy.deepcopy(model), new)[k].state_dict())
        assert st["parameters"] == len(stage_names) and st["optimizer"]["name"] == optimizer
        assert all(st["optimizer"]["state"][i] is by_name[n] for i, n in enumerate(stage_names))
        assert all(d is last[n] for n, d in zip(stage_names, st["optimizer"]["last"]))
        assert st["version"] == 2 and "probe" not in st
        assert json.loads(st["stats"])["actions"] == {"F": 0, "B": 0}
        assert torch.equal(st["rng"][0], torch.Generator().manual_seed(stream_seed(3, k, 2)).get_state())
    # loaded into stages of the new partition: the same whole model and optimizer state as before, by name
    fresh = make_stages(split(copy.deepcopy(model), new), "spectrain",
                        spec_of(lr=0.05, seed=3, momentum=0.9, optimizer=optimizer))
    for stage, st in zip(fresh, cut):
        stage.load_checkpoint_state(st)
    merged = {k: v for stage in fresh for k, v in stage.state_dict().items()}
    assert all(torch.equal(merged[k], v) for st in states for k, v in st["module"].items())
    reloaded = {n: stage.optimizer.state_dict()["state"][i] for stage, stage_names in
                zip(fresh, parameter_names(model, new)) for i, n in enumerate(stage_names)}
    assert all(torch.equal(reloaded[n][key], value) for n, st in by_name.items() for key, value in st.items())
    assert stream_seed(3, 0, 2) != stream_seed(3, 1, 2) != stream_seed(3, 1, 4)

    states[1]["optimizer"]["name"] = "adam"  # not per parameter and not shared: cannot be cut
    with pytest.raises(ValueError, match="entry 'optimizer.name' is neither one item per parameter nor the same"):
        resplit(states, model, old, new, seed=3, step=2)
    states[1]["version"] = 3
    with pytest.raises(ValueError, match="only a drained checkpoint can be re-split"):
        resplit(states, model, old, new, seed=3, step=2)


def test_dataparallel_keeps_refusing_another_worker_count(tmp_path):
    saved = settings("dataparallel", 2, executor="ray")
    with pytest.raises(ConfigError, match="written by 2 dataparallel workers but this run has pipeline.stages=4"):
        check_compatible(saved, from_mapping(settings("dataparallel", 4, executor="ray")), tmp_path / "step_00000004.pt")
    check_compatible(settings("gpipe", 2), from_mapping(settings("gpipe", 4)), tmp_path / "step_00000004.pt")
