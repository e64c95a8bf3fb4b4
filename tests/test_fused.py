"""The update and the prediction in one pass (``rayspec.core.fused``, ``optim.compile``) and the prediction a stage
reuses within a version: torch's step to rounding, torch's state format, the aliases' note kept."""

from __future__ import annotations

import pytest
import torch
from conftest import ADAMW, assert_same_weights, make_stages, microbatches, run_local, threads

import rayspec.core.optim
from rayspec.core.methods import METHODS
from rayspec.core.optim import Optimizer, OptimSpec
from rayspec.core.schedule import build_schedule
from rayspec.core.stage import Stage
from rayspec.core.stage_spec import StageSpec

SETTINGS = [("sgd", {}), ("sgd", {"weight_decay": 0.01, "nesterov": True}), ("sgd", {"dampening": 0.1}),
            ("adam", {"weight_decay": 0.01}), ("adamw", {"weight_decay": 0.1, "betas": (0.8, 0.9)})]


def _params(seed: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(37, 5)), torch.nn.Parameter(torch.randn(11))]


@pytest.mark.parametrize("name,settings", SETTINGS)
def test_the_compiled_update_is_torch_step_and_the_prediction_to_rounding(name, settings):
    ps, qs = _params(0), _params(0)
    fused = Optimizer(ps, OptimSpec(name, compile=True, **settings))
    plain = Optimizer(qs, OptimSpec(name, **settings))
    out = [torch.empty_like(p) for p in ps]
    ran = []
    for _ in range(4):
        for p, q in zip(ps, qs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        ran.append(fused.step(0.05, (0.99, -0.2, out)))
        plain.step(0.05)
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p.data, q.data, rtol=1e-6, atol=1e-6)
        for o, q, d in zip(out, qs, plain.direction()):
            if ran[-1]:
                torch.testing.assert_close(o, 0.99 * q.data - 0.2 * d, rtol=1e-6, atol=1e-6)
        fused.zero_grad()
    assert ran == [False, True, True, True]  # torch's step makes the state; the compiled one continues it
    a, b = fused.state_dict(), plain.state_dict()
    assert a.keys() == b.keys() and a["state"].keys() == b["state"].keys()
    for i, st in a["state"].items():
        assert st.keys() == b["state"][i].keys()
        for key, value in st.items():
            torch.testing.assert_close(value, b["state"][i][key], rtol=1e-6, atol=1e-6)
    plain.load_state_dict(a)  # torch's format: an optimizer without compile continues from it


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_compiled_update_between_forward_and_backward_leaves_the_pending_backward_alone(name):
    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    opt = Optimizer(list(net.parameters()), OptimSpec(name, compile=True))
    out = [torch.empty_like(p) for p in net.parameters()]
    for _ in range(2):
        net(torch.randn(6, 5)).sum().backward()
        opt.step(0.1, (1.0, -0.1, out))
        opt.zero_grad()
    pending = net(torch.randn(6, 5)).sum()  # saves the weights for its backward
    versions = [p._version for p in net.parameters()]
    before = [p.detach().clone() for p in net.parameters()]
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    assert opt.step(0.1, (1.0, -0.1, out))
    assert [p._version for p in net.parameters()] == versions
    assert all(not torch.equal(p, w) for p, w in zip(net.parameters(), before))
    net.zero_grad()
    pending.backward()  # "modified by an inplace operation" if the update had bumped the parameters' versions


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_spectrain_compiled_is_spectrain_to_rounding(tiny, monkeypatch, optimizer):
    """On the local executor, 4 stages: the same weights to rounding, the compiled pass run on every update after the
    first where a prediction follows, the pointer swap and the prediction probe as without it."""
    model, data = tiny
    settings = ADAMW if optimizer == "adamw" else {}
    calls = {"n": 0}
    kernel = "adam_step" if optimizer == "adamw" else "sgd_step"
    real = getattr(rayspec.core.optim, kernel)

    def counted(*args, **kw):
        calls["n"] += 1
        return real(*args, **kw)

    monkeypatch.setattr(rayspec.core.optim, kernel, counted)
    compiled, _, _ = run_local(model, data, "spectrain", 4, updates=16, compile=True, **settings)
    plain, _, _ = run_local(model, data, "spectrain", 4, updates=16, **settings)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[name], value, rtol=1e-4, atol=1e-5)
    assert calls["n"] >= 3 * 15  # stages 0-2 predict ahead (the last one's s is 0), from the second update on
    for a, b in zip(compiled.stage_stats(), plain.stage_stats()):
        assert a["prediction"]["actions"] == b["prediction"]["actions"] > 0


def test_a_prediction_is_computed_once_per_version(monkeypatch):
    """F and B of one version that ask for the same prediction share it: the direction is read once."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    stage = Stage(module, StageSpec(lr=0.1, optim=OptimSpec("sgd"), policy="predict", probe=16), 0, 1)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    reads = {"n": 0}
    real = stage.optimizer.direction

    def counted():
        reads["n"] += 1
        return real()

    monkeypatch.setattr(stage.optimizer, "direction", counted)
    for m in range(4):
        stage.forward(m, x, y, s=1)
        stage.backward(m, None, s=1, update=True)
    assert reads["n"] == 4  # one per version (at version 0 it finds no direction yet)
    assert stage.probe is not None and stage.probe.totals["actions"] == 3 * 2  # targets 2, 3, 4: F and B each


@pytest.mark.slow
def test_spectrain_compiled_on_ray_equals_local(ray_session, tiny):
    """Each stage actor compiles its own update: the p2p run gives the local run's numbers (about a minute: every
    actor process compiles once)."""
    from rayspec.exec.ray import RayExecutor

    model, data = tiny
    ex = RayExecutor(make_stages(model, "spectrain", 2, compile=True, **ADAMW), "spectrain", transport="p2p",
                     cpus_per_stage=0.5)
    try:
        schedule = build_schedule(METHODS["spectrain"].schedule, 2, 12)
        losses = ex.run(schedule, iter(microbatches(data, 12, 32)))
        got = ex.state_dict()
    finally:
        ex.close()
    with threads(1):  # as the stage actors
        ref, ref_losses, _ = run_local(model, data, "spectrain", 2, updates=12, compile=True, **ADAMW)
    assert_same_weights(got, ref.state_dict())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))


def test_where_the_update_cannot_be_compiled_torch_steps(monkeypatch):
    """A kernel that could not be compiled here (recorded as None) leaves the update to torch's step, and the
    caller computes the prediction: nothing was written."""
    import rayspec.core.fused

    monkeypatch.setitem(rayspec.core.fused._compiled, "sgd", None)
    ps, qs = _params(1), _params(1)
    fused, plain = Optimizer(ps, OptimSpec(compile=True)), Optimizer(qs, OptimSpec())
    out = [torch.zeros_like(p) for p in ps]
    for _ in range(3):
        for p, q in zip(ps, qs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        assert not fused.step(0.1, (1.0, -0.1, out))
        plain.step(0.1)
    assert all(torch.equal(p, q) for p, q in zip(ps, qs)) and all(not o.any() for o in out)
