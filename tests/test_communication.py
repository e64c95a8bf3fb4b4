"""Bytes moved per update: the stages' counters equal the analytic activation volume (tuple activations with
integer ids and boolean masks included), and the data-parallel counter equals the all-reduced gradient, ``P * 4``."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from test_train import compose_config

from rayspec.config import from_mapping
from rayspec.core.optim import OptimSpec
from rayspec.core.schedule import build_schedule
from rayspec.core.stage import make_stages as stages_for
from rayspec.core.stage_spec import StageSpec
from rayspec.data import build_data
from rayspec.exec import LocalExecutor
from rayspec.models import build_model
from rayspec.partition import split, uniform
from rayspec.training import run_training
from rayspec.training.prepare import prepare

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package lives next to tests/
from benchmarks.communication.bench import block_bytes, boundaries, dp_bytes, mp_total  # noqa: E402

UPDATES, BATCH = 2, 4


def workload(name: str):
    """Model ``name`` (tiny) and ``UPDATES`` real batches of its synthetic data (text: right-padded token ids)."""
    if name in ("transformer", "residual_lstm"):
        data = build_data("synthetic_text", seed=0, train_size=UPDATES * BATCH, val_size=0)
    else:
        data = build_data("synthetic_image", seed=0, train_size=UPDATES * BATCH, val_size=0, image_size=32)
    torch.manual_seed(0)
    model = build_model(name, data.info, "tiny")
    x, y = data.train.tensors
    return model, data.info, list(zip(x.split(BATCH), y.split(BATCH)))


def real_boundaries(model, x, balance):
    """Per boundary, by a real forward: bytes of every tensor crossing it, and of the float ones (their gradients)."""
    out = []
    with torch.no_grad():
        for part in split(copy.deepcopy(model), balance)[:-1]:
            x = part(x)
            tensors = x if isinstance(x, tuple) else (x,)
            out.append({"F": sum(t.numel() * t.element_size() for t in tensors),
                        "B": sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point())})
    return out


def expected_per_stage(cuts, n):
    """Stage k sends boundary k's activation forward and boundary k-1's gradient back, once per update."""
    return [{"F": UPDATES * cuts[k]["F"] if k < n - 1 else 0, "B": UPDATES * cuts[k - 1]["B"] if k > 0 else 0}
            for k in range(n)]


def make_stages(model, n, method):
    return stages_for(split(copy.deepcopy(model), uniform(len(model), n)), method,
                      StageSpec(lr=0.01, optim=OptimSpec(momentum=0.9)))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", ["transformer", "residual_lstm", "resnet50"])
def test_stage_counters_equal_the_analytic_volume(name, n):
    model, info, batches = workload(name)
    balance = uniform(len(model), n)
    cuts = real_boundaries(model, batches[0][0], balance)
    # The benchmark's shape-only (meta device) volume is the same, and linear in the batch.
    assert boundaries(block_bytes(model, info, BATCH), balance) == cuts
    assert mp_total(boundaries(block_bytes(model, info, 8 * BATCH), balance)) == 8 * mp_total(cuts)
    if name == "transformer":  # (hidden float, pad mask bool): the mask goes forward only
        assert all(c["F"] - c["B"] == BATCH * info.input_shape[0] for c in cuts)
    elif name == "residual_lstm":  # (hidden float, last index int64)
        assert all(c["F"] - c["B"] == BATCH * 8 for c in cuts)
    else:
        assert all(c["F"] == c["B"] for c in cuts)
    stages = make_stages(model, n, "async")
    LocalExecutor(stages, "async").run(build_schedule("1f1b", n, UPDATES), batches)
    assert [s.stats.sent_bytes for s in stages] == expected_per_stage(cuts, n)


def test_ray_transport_counts_the_same_bytes(ray_session):
    """Through RayExecutor's stage actors (spectrain), the counters equal the analytic volume too."""
    from rayspec.exec.ray import RayExecutor

    model, _info, batches = workload("transformer")
    n = 2
    cuts = real_boundaries(model, batches[0][0], uniform(len(model), n))
    with RayExecutor(make_stages(model, n, "spectrain"), "spectrain", transport="object_store",
                     cpus_per_stage=0.5) as ex:
        ex.run(build_schedule("1f1b", n, UPDATES), batches)
        sent = [st["sent_bytes"] for st in ex.stage_stats()]
    assert sent == expected_per_stage(cuts, n)


def test_ring_allreduce_volume():
    assert dp_bytes(1000, 4) == {"allreduce_buffer_per_worker": 1000, "ring_per_worker": 1500, "ring_total": 6000}
    assert dp_bytes(1000, 2)["ring_total"] == 2000


@pytest.mark.slow
def test_dataparallel_counts_the_gradient_bytes_once_per_update(tmp_path, ray_session):
    """Two Ray Train workers: each hands every gradient to all-reduce once per update, P * 4 bytes."""
    updates = 3
    config = from_mapping(compose_config("pipeline.method=dataparallel", "model=mlp", "model.size=tiny",
                                         "pipeline.stages=2", f"train.max_steps={updates}", "train.log_every=3",
                                         "data.train_size=256", "data.val_size=64"))
    model = prepare(config).model
    expected = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert expected == 4 * sum(p.numel() for p in model.parameters())
    summary = run_training(config, tmp_path)
    assert summary["bytes_per_update"] == expected
    assert [st["sent_bytes"] for st in summary["stage_stats"]] == [{"allreduce": updates * expected}] * 2
