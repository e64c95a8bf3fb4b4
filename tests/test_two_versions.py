"""PipeDream-2BW (two weight versions, each backward at its forward's version) and 2BW with SpecTrain's prediction."""

from __future__ import annotations

import pytest
import torch
from conftest import Stop, StopAfter, make_stages, microbatches

from rayspec.config import from_mapping
from rayspec.core.methods import METHODS
from rayspec.core.schedule import build_schedule
from rayspec.exec import LocalExecutor
from rayspec.training import run_training as train


def run_2bw(model, data, method, n, group, updates=6, **kw):
    ex = LocalExecutor(make_stages(model, method, n, group=group, record=True, **kw), method)
    schedule = build_schedule(METHODS[method].schedule, n, updates * group, group=group)
    ex.run(schedule, microbatches(data, updates, 32, group))
    return ex, schedule


def backwards_at_forward_weights(stage) -> int:
    """How many backwards ran at exactly the weights their forward ran at (all of them, or this raises)."""
    forwards = {r["microbatch"]: r for r in stage.records if r["kind"] == "F"}
    backwards = [r for r in stage.records if r["kind"] == "B"]
    for b in backwards:
        for w_f, w_b in zip(forwards[b["microbatch"]]["used"], b["used"]):
            assert torch.equal(w_f, w_b), (stage.index, b["microbatch"])
    return len(backwards)


@pytest.mark.parametrize("method", ["pipedream-2bw", "spectrain-2bw"])
def test_every_backward_runs_at_its_forwards_weights_one_update_late(tiny, method):
    model, data = tiny
    n, group = 4, 4
    ex, schedule = run_2bw(model, data, method, n, group)
    held = schedule.versions()
    for st in ex.stages:
        assert backwards_at_forward_weights(st) == 6 * group
        delays = {held[(st.index, "B", m)] - held[(st.index, "F", m)] for m in range(6 * group)}
        assert delays == ({0, 1} if st.index < n - 1 else {0})  # the delay is at most one update
        assert not st.weights.stash and st.drained()


def test_2bw_gradients_are_the_old_versions(tiny):
    """A backward after the update runs at the old weights (not the stored ones), and SpecTrain-2BW's at the
    prediction of the new ones its forward ran at (neither the old nor the stored)."""
    model, data = tiny
    plain = run_2bw(model, data, "pipedream-2bw", 2, 2)[0].stages[0].records
    late = [r for r in plain if r["kind"] == "B" and r["version"] > 0 and not torch.equal(r["used"][0], r["before"][0])]
    assert late  # ran at the kept copy of the version before
    predicted = run_2bw(model, data, "spectrain-2bw", 2, 2)[0].stages[0].records
    ahead = [r for r in predicted if r["kind"] == "F" and r["s"] == 1 and r["version"] > 0]
    assert ahead and all(not torch.equal(r["used"][0], r["before"][0]) for r in ahead)


@pytest.mark.parametrize("method,group", [("pipedream-2bw", 3), ("spectrain-2bw", 6)])
def test_two_weight_copies_at_most(tiny, method, group):
    """Two versions: the weights and one copy. 2BW's old copy is made at the update, so N-1 micro-batches per update
    suffice; SpecTrain-2BW's prediction at the first forward that needs it, before the last backward at the
    previous one, so it takes 2(N-1) (fewer: at most two predictions at once)."""
    model, data = tiny
    n = 4
    ex, _ = run_2bw(model, data, method, n, group=group, updates=4)
    for st in ex.stages:
        size = st.weight_bytes()["weights"]
        copies = 1 if st.index < n - 1 else 0  # the last stage's backward follows its forward at once
        assert st.stats.peak_stash == copies
        # weights, momentum, the one kept copy (spectrain-2bw: a prediction, computed into it directly)
        assert st.stats.peak_weight_bytes == size * (2 + copies)


def test_spectrain_2bw_below_2n_minus_2_holds_two_predictions(tiny):
    model, data = tiny
    ex, _ = run_2bw(model, data, "spectrain-2bw", 4, group=4, updates=4)
    assert ex.stages[0].stats.peak_stash == 2


def test_too_few_microbatches_per_update_for_two_versions(tiny):
    model, data = tiny
    with pytest.raises(RuntimeError, match="pipeline.accumulate to at least pipeline.stages - 1"):
        run_2bw(model, data, "pipedream-2bw", 4, group=1)


@pytest.mark.parametrize("method", ["pipedream-2bw", "spectrain-2bw"])
def test_resumed_run_equals_uninterrupted_run(tmp_path, method):
    """Checkpoints fall between segments, where no micro-batch is in flight: the kept copies are empty, and the
    resumed run ends bit-exactly where the uninterrupted one does."""
    cfg = {
        "model": {"name": "mlp", "size": "tiny"},
        "data": {"name": "synthetic_image", "train_size": 320, "val_size": 64},
        "pipeline": {"method": method, "stages": 3, "executor": "local", "accumulate": 2},
        "train": {"max_steps": 12, "batch_size": 16, "log_every": 1, "eval_every": 4},
        "optim": {"lr": 0.08, "weight_decay": 1e-3, "schedule": "poly"},
        "checkpoint": {"every": 5, "keep": 2},
    }
    full = train(from_mapping(cfg), tmp_path / "a")
    with pytest.raises(Stop):
        train(from_mapping(cfg), tmp_path / "b", callbacks=[StopAfter(7)])
    cfg["checkpoint"]["resume"] = "auto"
    resumed = train(from_mapping(cfg), tmp_path / "b")
    assert resumed["resumed_from"] == 5
    a = torch.load(tmp_path / "a" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "model.pt", weights_only=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert resumed["final_train_loss"] == full["final_train_loss"]
    if method == "pipedream-2bw":  # (spectrain-2bw needs 2(N-1) = 4 micro-batches per update for one copy)
        assert [st["peak_stash"] for st in full["stage_stats"]] == [1, 1, 0]
