"""On a GPU: stage actors on CUDA train as the local executor does on the CPU, on the transports the placement
allows; events time the actions; checks and losses stay on the device. Skipped without CUDA (``pytest -m cuda``;
``benchmarks/gpu_check/gpu_run.sh`` runs them)."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import assert_same_weights, make_stages, microbatches, run_local

from rayspec.core.device import deterministic, nccl_problem, restore, to_device
from rayspec.core.finite import FiniteChecks
from rayspec.core.schedule import build_schedule
from rayspec.core.stage import StageStats
from rayspec.core.timing import StageClock

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture
def exact():
    before = deterministic(True)
    yield
    restore(before)


def test_torchs_nccl_is_there():
    assert nccl_problem("torch", "p2p_nccl") is None


def test_pinned_copies_to_the_gpu():
    x = torch.randn(64, 32)
    got = to_device((x, None), torch.device("cuda"))
    assert got[0].is_cuda and got[1] is None and torch.equal(got[0].cpu(), x)


def test_events_time_the_work_not_the_queueing():
    clock, stats, timeline = StageClock(trace=True), StageStats(), []
    a = torch.randn(4096, 4096, device="cuda")
    wall = time.time()
    t_host = time.perf_counter()
    mark = clock.start(torch.device("cuda"))
    for _ in range(20):
        a = a @ a / 4096
    clock.stop("F", 0, mark, stats, timeline)
    queued = time.perf_counter() - t_host  # what host time around the call measured
    assert stats.busy_s["F"] == 0.0 and timeline == []  # not read yet: no synchronization
    clock.settle()
    assert stats.busy_s["F"] > 0 and len(timeline) == 1
    _, _, start, end = timeline[0]
    assert wall - 0.5 <= start < end <= time.time() + 0.5
    assert stats.busy_s["F"] >= 0.5 * queued


def test_checks_on_the_gpu_wait_for_flush():
    checks = FiniteChecks(0)
    checks.loss(torch.tensor(float("nan"), device="cuda"), 3, 1)  # no host round trip: not raised yet
    with pytest.raises(FloatingPointError, match="the loss of micro-batch 3 is nan at update 1"):
        checks.flush()


def _ray_equals_local(tiny, transport, gpus, method="spectrain", n=2, updates=8):
    import ray

    from rayspec.exec.ray import RayExecutor

    model, data = tiny
    ex = RayExecutor(make_stages(model, method, n), method, transport=transport, cpus_per_stage=0.5,
                     gpus_per_stage=gpus, chunk=4)
    try:
        ray.get([a.deterministic.remote(True) for a in ex.actors])
        losses = ex.run(build_schedule("1f1b", n, updates), iter(microbatches(data, updates, 32)))
        assert {st["device"] for st in ex.stage_stats()} == {"cuda:0"}
        assert all(st["cuda_peak_bytes"] > 0 for st in ex.stage_stats())
        ref, ref_losses, _ = run_local(model, data, method, n, updates=updates)
        assert_same_weights(ex.state_dict(), ref.state_dict(), **TOLERANCE)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOLERANCE)
    finally:
        ex.close()


def test_stages_sharing_a_gpu_train_like_the_cpu_through_host_memory(ray_session, tiny, exact):
    _ray_equals_local(tiny, "auto", 0.5)  # auto: p2p, GPU tensors through pinned host memory


def test_object_store_on_a_shared_gpu(ray_session, tiny, exact):
    _ray_equals_local(tiny, "object_store", 0.5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_gpu_per_stage_trains_like_the_cpu_over_nccl(ray_session, tiny, exact):
    _ray_equals_local(tiny, "auto", 1.0)  # auto: p2p_nccl
