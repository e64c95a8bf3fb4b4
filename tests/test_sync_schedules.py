"""The synchronous schedules users run today (1F1B, ZB-H1, interleaved 1F1B) equal SGD on the whole batch."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_weights, make_stages, microbatches, plain_sgd

from rayspec.core.methods import METHODS
from rayspec.core.schedule import build_schedule
from rayspec.core.schedule_text import load_schedule, to_csv
from rayspec.exec import LocalExecutor
from rayspec.models import build_model


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
