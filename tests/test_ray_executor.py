"""RayExecutor equals LocalExecutor for every method and transport; no-staleness runs equal plain SGD."""

from __future__ import annotations

import pytest
import torch
from conftest import ADAMW, METHODS, assert_same_weights, make_stages, microbatches, plain_sgd, run_local, threads

from rayspec.config import ConfigError
from rayspec.core.methods import METHODS as REGISTRY
from rayspec.core.schedule import build_schedule
from rayspec.exec.ray import RayExecutor

N = 4
UPDATES = 16


# The default run checks p2p (what pipeline.transport=auto picks on CPU); the other transports run in the slow set.
@pytest.fixture(scope="module", params=[pytest.param("object_store", marks=pytest.mark.slow),
                                        pytest.param("gloo", marks=pytest.mark.slow),
                                        pytest.param("compiled", marks=pytest.mark.slow), "p2p"])
def executor(request, ray_session, tiny):
    """One set of 4 stage actors per transport, reloaded with fresh stages for each method; p2p in chunks of 5
    micro-batches, so that 1F1B crosses from chunk to chunk."""
    model, _ = tiny
    ex = RayExecutor(make_stages(model, "vanilla", N), "vanilla", transport=request.param, cpus_per_stage=0.5,
                     chunk=5 if request.param == "p2p" else 16)
    yield ex
    ex.close()


def _run_ray(ex, model, data, method, variant="paper", backward="mixed", updates=UPDATES, batch=32, predictor="linear",
             group=None, **settings):
    group = group or (4 if method == "gpipe" else 1)
    ex.load(make_stages(model, method, N, group=group, backward=backward, predictor=predictor, **settings))
    ex.method, ex.variant = method, variant
    schedule = build_schedule(REGISTRY[method].schedule, N, updates * group, group=group)
    seen = []
    losses = ex.run(schedule, iter(microbatches(data, updates, batch, group)), on_loss=lambda m, v: seen.append(m))
    assert sorted(seen) == list(range(updates * group))  # progress reports every micro-batch once
    return ex.state_dict(), losses


@pytest.mark.parametrize("method", METHODS)
def test_ray_equals_local(executor, tiny, method):
    model, data = tiny
    got, losses = _run_ray(executor, model, data, method)
    ref_ex, ref_losses, _ = run_local(model, data, method, N, updates=UPDATES)
    assert_same_weights(got, ref_ex.state_dict())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    stats = executor.stage_stats()
    assert [s["version"] for s in stats] == [UPDATES] * N
    assert all(s["actions"]["F"] == s["actions"]["B"] == UPDATES * (4 if method == "gpipe" else 1) for s in stats)


@pytest.mark.parametrize("method", METHODS)
def test_ray_equals_local_with_adamw(executor, tiny, method):
    """``optim.name=adamw``: the same numbers on every transport as in one process, SpecTrain's predictions from
    AdamW's next step included."""
    model, data = tiny
    got, losses = _run_ray(executor, model, data, method, **ADAMW)
    with threads(1):  # as the stage actors
        ref_ex, ref_losses, _ = run_local(model, data, method, N, updates=UPDATES, **ADAMW)
    assert_same_weights(got, ref_ex.state_dict())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))


@pytest.mark.parametrize("method", ["vanilla", "gpipe"])
def test_ray_global_clipping_equals_local(executor, tiny, method):
    """Where the pipeline flushes, every transport that can gather the stages' gradient norms before an update clips
    by the global norm as the local executor does (= clipping the whole model); ``compiled`` refuses, naming the
    ones that can."""
    model, data = tiny
    if executor.transport == "compiled":
        with pytest.raises(ConfigError, match=r"pipeline.transport=compiled cannot gather .* use pipeline.transport= "
                                              r"one of p2p, p2p_nccl, object_store, gloo, nccl, or pipeline.executor=local"):
            _run_ray(executor, model, data, method, clip_grad_norm=0.05)
        return
    got, losses = _run_ray(executor, model, data, method, clip_grad_norm=0.05, **ADAMW)
    with threads(1):
        ref_ex, ref_losses, _ = run_local(model, data, method, N, updates=UPDATES, clip_grad_norm=0.05, **ADAMW)
    assert_same_weights(got, ref_ex.state_dict())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))


@pytest.mark.parametrize("method", ["gpipe", "spectrain"])
def test_ray_equals_local_in_bf16(executor, tiny, method):
    """``train.precision=bf16``: bfloat16 activations and gradients cross every transport (numpy has no bfloat16:
    the object store carries torch tensors) and the numbers equal the local executor's."""
    model, data = tiny
    got, losses = _run_ray(executor, model, data, method, precision="bf16", **ADAMW)
    with threads(1):
        ref_ex, ref_losses, _ = run_local(model, data, method, N, updates=UPDATES, precision="bf16", **ADAMW)
    assert_same_weights(got, ref_ex.state_dict())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    sent = [st["sent_bytes"]["F"] for st in executor.stage_stats()][:-1]
    assert sent == [st.stats.sent_bytes["F"] for st in ref_ex.stages][:-1] and all(sent)


@pytest.mark.parametrize("variant,backward,predictor", [("consistent", "mixed", "linear"),
                                                       ("paper", "recompute", "linear"),
                                                       ("paper", "mixed", "adaptive"),
                                                       ("consistent", "mixed", "momentum")])
def test_ray_equals_local_spectrain_options(executor, tiny, variant, backward, predictor):
    model, data = tiny
    got, _ = _run_ray(executor, model, data, "spectrain", variant=variant, backward=backward, predictor=predictor)
    ref = run_local(model, data, "spectrain", N, updates=UPDATES, variant=variant, backward=backward,
                    predictor=predictor)[0]
    assert_same_weights(got, ref.state_dict())
    # each stage actor scores its predictions itself, and scores them as the reference does
    scores, want = [st["prediction"] for st in executor.stage_stats()], [st["prediction"] for st in ref.stage_stats()]
    assert scores[0]["actions"] > 0
    for got, expected in zip(scores, want):  # float32 weights equal to rounding: sums equal to 1e-6
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == (value if value is None else pytest.approx(value, rel=1e-6, abs=1e-12)), key


@pytest.mark.parametrize("method", ["pipedream", "spectrain"])
def test_ray_equals_local_accumulated(executor, tiny, method):
    """``pipeline.accumulate = 4``: 1F1B across batches, one update per 4 micro-batches, on every transport."""
    model, data = tiny
    got, losses = _run_ray(executor, model, data, method, updates=8, group=4)
    ref_ex, ref_losses, _ = run_local(model, data, method, N, updates=8, group=4)
    assert_same_weights(got, ref_ex.state_dict())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert [s["version"] for s in executor.stage_stats()] == [8] * N


@pytest.mark.parametrize("method", ["vanilla", "gpipe"])
def test_ray_without_staleness_is_plain_sgd(executor, tiny, method):
    model, data = tiny
    got, _ = _run_ray(executor, model, data, method, updates=12)
    assert_same_weights(got, plain_sgd(model, data, 12, 32))


def test_in_flight_bound_and_lazy_feed(executor, tiny):
    """A long segment streams through with a small in-flight bound: data is pulled lazily, in order."""
    model, data = tiny
    executor.load(make_stages(model, "spectrain", N))
    executor.method, executor.max_in_flight = "spectrain", 1  # raised to the schedule's own need (N)
    pulled = []

    def feed():
        for i, mb in enumerate(microbatches(data, 48, 32)):
            pulled.append(i)
            yield mb

    try:
        losses = executor.run(build_schedule("1f1b", N, 48), feed())
    finally:
        executor.max_in_flight = None
    assert pulled == list(range(48)) and len(losses) == 48
    ref = run_local(model, data, "spectrain", N, updates=48)[0]
    assert_same_weights(executor.state_dict(), ref.state_dict())


def test_a_stage_error_reaches_the_driver_and_the_actors_train_on(executor, tiny):
    """A non-finite loss raises the stage's FloatingPointError at the driver; reloaded, the same actors
    (and, ``compiled``, a new graph) train as the reference does."""
    model, data = tiny
    executor.load(make_stages(model, "spectrain", N))
    executor.method = "spectrain"
    bad = microbatches(data, 24, 32)
    bad[9] = (torch.full_like(bad[9][0], float("inf")), bad[9][1])
    with pytest.raises(FloatingPointError, match="the loss of micro-batch 9 is nan"):
        executor.run(build_schedule("1f1b", N, 24), iter(bad))
    got, _ = _run_ray(executor, model, data, "spectrain")
    assert_same_weights(got, run_local(model, data, "spectrain", N, updates=UPDATES)[0].state_dict())


def test_default_gpus_follow_the_cluster_not_the_driver():
    from rayspec.config import ConfigError
    from rayspec.exec.ray.cluster import default_gpus

    assert default_gpus(0.0, 4) == 0.0 and default_gpus(4.0, 4) == 1.0 and default_gpus(8.0, 2) == 1.0
    with pytest.raises(ConfigError, match="4 stages need one GPU each but the Ray cluster has 2"):
        default_gpus(2.0, 4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_stage_moved_to_cuda_trains_like_the_cpu_one(tiny):
    model, data = tiny
    cpu = make_stages(model, "vanilla", 1)[0]
    gpu = make_stages(model, "vanilla", 1)[0].to("cuda")
    for m, (x, y) in enumerate(microbatches(data, 4, 32)):
        cpu.forward(m, x, y)
        cpu.backward(m, update=True)
        gpu.forward(m, x, y)
        gpu.backward(m, update=True)
    for k, v in cpu.state_dict().items():
        torch.testing.assert_close(gpu.state_dict()[k], v, rtol=1e-4, atol=1e-5)


def test_stage_bundles_the_cluster_cannot_hold_are_a_clear_error(ray_session):
    from rayspec.config import ConfigError
    from rayspec.exec.ray.cluster import reserve_stages

    with pytest.raises(ConfigError, match=r"could not place 2 stage bundle\(s\) of \{'CPU': 5.0\} \(PACK\) in 1 s.*"
                                          r"lower pipeline.stages or pipeline.cpus_per_stage"):
        reserve_stages(2, 5.0, 0.0, timeout_s=1)
