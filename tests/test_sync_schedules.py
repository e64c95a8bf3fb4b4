"""The synchronous schedules users run today (1F1B, ZB-H1, interleaved 1F1B) equal SGD on the whole batch."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_weights, make_stages, microbatches, plain_sgd, plain_torch

from rayspec.config import ConfigError, from_mapping
from rayspec.core.methods import METHODS
from rayspec.core.schedule import build_schedule
from rayspec.core.schedule_text import load_schedule, to_csv
from rayspec.exec import LocalExecutor
from rayspec.models import build_model
from rayspec.training import run_training as train


@pytest.fixture(scope="module")
def deep(tiny):
    """The tiny MLP with 8 blocks: 4 ranks of 2 chunks."""
    torch.manual_seed(0)
    return build_model("mlp", tiny[1].info, "tiny", depth=7), tiny[1]


def run_sync(model, data, method, n, virtual=1, m=4, updates=4, schedule=None, **kw):
    """``updates`` batches of 32 through ``n`` ranks (``n * virtual`` stages), ``m`` micro-batches per batch."""
    stages = make_stages(model, method, n * virtual, group=m, **kw)
    ex = LocalExecutor(stages, method)
    schedule = schedule or build_schedule(METHODS[method].schedule, n, updates * m, group=m, virtual=virtual)
    losses = ex.run(schedule, microbatches(data, updates, 32, m))
    return ex, losses, schedule


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("method,virtual", [("1f1b", 1), ("zb1p", 1), ("interleaved", 2)])
def test_synchronous_methods_are_sgd_on_the_batch(deep, method, virtual, n):
    model, data = deep
    ex, losses, schedule = run_sync(model, data, method, n, virtual)
    assert schedule.is_synchronous() and len(losses) == 16 and len(ex.stages) == n * virtual
    assert_same_weights(ex.state_dict(), plain_sgd(model, data, 4, 32))


def test_zero_bubble_splits_every_backward(tiny):
    model, data = tiny
    ex, _, _ = run_sync(model, data, "zb1p", 4)
    for st in ex.stages:
        assert st.stats.actions["I"] == st.stats.actions["W"] == 16 and st.stats.actions["B"] == 0
        assert st.drained()


def test_recompute_backward_splits_too(tiny):
    model, data = tiny
    ex, _, _ = run_sync(model, data, "zb1p", 2, backward="recompute")
    assert_same_weights(ex.state_dict(), plain_sgd(model, data, 4, 32))


def test_a_torch_csv_of_zb_h1_runs_and_equals_zb1p(tiny, tmp_path):
    model, data = tiny
    path = tmp_path / "zbh1.csv"
    path.write_text(to_csv(build_schedule("zb1p", 2, 4)))
    schedule = load_schedule(path, batches=4)
    assert schedule.microbatches == 16 and schedule.group == 4
    from_file = run_sync(model, data, "zb1p", 2, schedule=schedule)[0].state_dict()
    built = run_sync(model, data, "zb1p", 2)[0].state_dict()
    for k in built:
        assert torch.equal(from_file[k], built[k]), k


def _config(method, **pipeline):
    return {"model": {"name": "mlp", "size": "tiny"}, "data": {"name": "synthetic_image", "train_size": 320},
            "pipeline": {"method": method, "stages": 2, "executor": "local", "microbatches": 4, **pipeline}}


@pytest.mark.parametrize("method,pipeline,message", [
    ("interleaved", {"virtual_stages": 2, "microbatches": 3}, "use a multiple of 2"),
    ("gpipe", {"virtual_stages": 2}, "applies to pipeline.method=interleaved only"),
    ("interleaved", {"virtual_stages": 2, "executor": "ray", "transport": "gloo"},
     "a stage actor hosts one stage; use pipeline.transport=auto or p2p or p2p_nccl.*or pipeline.executor=local"),
    ("zb1p", {"executor": "ray", "transport": "object_store"}, "runs no split backward.*pipeline.transport=auto or p2p"),
    ("pipedream-2bw", {"stages": 4, "accumulate": 2}, r"pipeline.accumulate >= 3 \(pipeline.stages - 1\)"),
    ("async", {"schedule_file": "x.csv"}, "use 1f1b, zb1p or interleaved"),
    ("zb1p", {"schedule_file": "missing.csv"}, "pipeline.schedule_file=missing.csv"),
    ("interleaved", {"balance": [2, 2, 3]}, "x pipeline.virtual_stages=1"),
])
def test_config_refuses_what_cannot_run_with_the_fix(method, pipeline, message):
    with pytest.raises(ConfigError, match=message):
        from_mapping(_config(method, **pipeline))


def test_a_schedule_file_must_fit_the_pipeline(tmp_path):
    path = tmp_path / "zb.csv"
    path.write_text(to_csv(build_schedule("zb1p", 2, 8)))
    with pytest.raises(ConfigError, match="pipeline.microbatches=8"):
        from_mapping(_config("zb1p", schedule_file=str(path)))
    assert from_mapping(_config("zb1p", schedule_file=str(path), microbatches=8)).pipeline.schedule_file == str(path)


@pytest.mark.parametrize("method,pipeline", [("interleaved", {"virtual_stages": 2}), ("zb1p", {"schedule_file": True})])
def test_training_runs_them_from_the_config(tiny, tmp_path, method, pipeline):
    """``train`` cuts stages x virtual_stages chunks for interleaved and runs a schedule file per batch: SGD's numbers."""
    if pipeline.get("schedule_file"):
        (tmp_path / "zb.csv").write_text(to_csv(build_schedule("zb1p", 2, 4)))
        pipeline = {"schedule_file": str(tmp_path / "zb.csv")}
    cfg = _config(method, **pipeline)
    cfg["train"] = {"max_steps": 3, "batch_size": 16, "log_every": 1, "eval_every": 0}
    cfg["optim"] = {"lr": 0.05}
    reference = train(from_mapping(_config("gpipe") | {"train": cfg["train"], "optim": cfg["optim"]}), tmp_path / "g")
    got = train(from_mapping(cfg), tmp_path / "r")
    assert len(got["stage_stats"]) == 2 * pipeline.get("virtual_stages", 1)
    a = torch.load(tmp_path / "g" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "r" / "model.pt", weights_only=True)
    assert_same_weights(b, a)
    assert got["final_train_loss"] == pytest.approx(reference["final_train_loss"])


@pytest.mark.parametrize("method,virtual", [("1f1b", 1), ("zb1p", 1), ("interleaved", 2)])
def test_global_clipping_is_clipping_the_whole_model(deep, method, virtual):
    """They flush: an update waits for every stage's gradient norm, as ``clip_grad_norm_`` on the whole model."""
    model, data = deep
    ex, _, _ = run_sync(model, data, method, 2, virtual, clip_grad_norm=0.05)
    assert all(st.clip_scope == "global" for st in ex.stages)
    assert_same_weights(ex.state_dict(), plain_torch(model, data, 4, 32, clip_grad_norm=0.05))
