"""SpecTrain's predictors and the prediction probe (``rayspec.predict``), checked against the optimizer and
against distances computed from every recorded action."""

from __future__ import annotations

import pytest
import torch
from conftest import run_local

from rayspec.core.optim import SGD, LRSchedule
from rayspec.core.predict import PredictionProbe, step_scale


def _after_steps(lr: LRSchedule, momentum: float, s: int, grad_of) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One parameter after a first update (velocity set), then ``s`` more with gradients ``grad_of(velocity)``:
    (weights and velocity before the ``s`` updates, weights after)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50))
    opt = SGD([p], momentum=momentum)
    p.grad = torch.randn(50)
    opt.step(lr(0))
    w, v = p.data.clone(), opt.buffers[0].clone()
    for i in range(s):
        p.grad = grad_of(opt.buffers[0])
        opt.step(lr(1 + i))
    return w, v, p.data.clone()


@pytest.mark.parametrize("s", [1, 3, 6])
def test_each_predictor_is_exact_where_its_assumption_holds(s):
    poly = LRSchedule(0.1, "poly", total=20)
    # momentum: no new gradient, so only the momentum in v moves the weights (lr following the schedule)
    w, v, reached = _after_steps(poly, 0.9, s, lambda buf: torch.zeros_like(buf))
    torch.testing.assert_close(w + step_scale("momentum", s, 1, poly, 0.9, 1.0) * v, reached, rtol=1e-5, atol=1e-6)
    # linear (the paper's): a gradient that keeps the velocity as it is, at a constant rate
    const = LRSchedule(0.1)
    w, v, reached = _after_steps(const, 0.9, s, lambda buf: (1 - 0.9) * buf)
    torch.testing.assert_close(w + step_scale("linear", s, 1, const, 0.9, 1.0) * v, reached, rtol=1e-5, atol=1e-6)
    assert step_scale("linear", s, 1, const, 0.9, 1.0) == pytest.approx(-s * 0.1)
    assert step_scale("adaptive", s, 1, const, 0.9, 0.25) == pytest.approx(-0.25 * s * 0.1)
    assert step_scale("momentum", s, 1, const, 0.0, 1.0) == 0.0  # plain SGD: the momentum predictor predicts nothing
    with pytest.raises(ValueError, match="predictor='cubic' is unknown"):
        step_scale("cubic", s, 1, const, 0.9, 1.0)


def _probe(n: int = 40) -> tuple[PredictionProbe, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(torch.zeros(n))]
    return PredictionProbe(params, 10**6, seed=0), params


@pytest.mark.parametrize("moved,quality,scale,damping", [
    (0.5, 1.0, 0.5, 0.5),   # the paper's step went twice too far: no nearer than the stale weights
    (1.0, 0.0, 1.0, 1.0),   # exact
    (2.0, 0.5, 2.0, 1.0),   # too short: the damping stays at most 1
    (-1.0, 2.0, -1.0, 0.0),  # the wrong way: no prediction
])
def test_probe_scores_and_damps(moved, quality, scale, damping):
    probe, params = _probe()
    step = torch.linspace(-1, 1, 40, dtype=torch.float64)
    stale = torch.zeros(40, dtype=torch.float64)
    probe.predicted(3, stale, stale + step, step)
    probe.predicted(4, stale, stale + step, step)  # never reached: not scored
    params[0].data.copy_(moved * step)
    velocity = [torch.linspace(1, -1, 40)]  # v = -step / (s lr): on the half where it turns positive it flipped
    velocity[0][:20] *= -1
    probe.reached(2, params, velocity)
    assert probe.totals["actions"] == 0 and probe.damping() == 1.0  # nothing scored yet: the paper's step
    probe.reached(3, params, velocity)
    summary = probe.summary()
    assert summary["actions"] == 1 and summary["coordinates"] == 40
    assert summary["quality"] == pytest.approx(quality, rel=1e-6, abs=1e-6)
    assert summary["best_scale"] == pytest.approx(scale, rel=1e-6)
    assert probe.damping() == pytest.approx(damping, rel=1e-6)
    assert list(probe.pending) == [4]
    assert summary["flipped_share"] == 0.5 and summary["quality_flipped"] == pytest.approx(quality, rel=1e-6, abs=1e-6)


def test_probe_samples_a_fixed_subset():
    params = [torch.nn.Parameter(torch.arange(1000.0)), torch.nn.Parameter(torch.arange(10.0) + 1000)]
    a, b = PredictionProbe(params, 64, seed=1), PredictionProbe(params, 64, seed=1)
    assert a.size == 64 and torch.equal(a.sample([p.data for p in params]), b.sample([p.data for p in params]))
    values = a.sample([p.data for p in params])
    assert len(set(values.tolist())) == 64 and values.max() < 1010  # distinct coordinates of both parameters
    assert not torch.equal(values, PredictionProbe(params, 64, seed=2).sample([p.data for p in params]))
    assert torch.equal(a.sample([None, None]), torch.zeros(64, dtype=torch.float64))


@pytest.mark.parametrize("variant", ["paper", "consistent"])
def test_probe_equals_distances_from_every_recorded_action(tiny, variant):
    """With every coordinate sampled, the probe's sums are the full-weight distances of every predicted action
    to the weights the stage held at the target version (read from the records of the same run)."""
    model, data = tiny
    ex, _, _ = run_local(model, data, "spectrain", 4, updates=16, record=True, variant=variant, probe=10**7)
    for stage in ex.stages:
        held = {rec["version"]: rec["before"] for rec in stage.records}
        held[stage.version] = [p.data.clone() for p in stage.params]
        moment = {rec["version"]: rec["velocity"] for rec in stage.records}
        moment[stage.version] = [None if b is None else b.clone() for b in stage.optimizer.buffers]
        want = dict.fromkeys(("actions", "pred_sq", "stale_sq", "cross", "step_sq", "pred_sq_flipped",
                              "stale_sq_flipped", "flipped", "coords"), 0)
        for rec in stage.records:
            target = rec["version"] + rec["s"]
            if rec["s"] == 0 or all(v is None for v in rec["velocity"]) or target not in held:
                continue
            want["actions"] += 1
            for before, used, true, v, v_now in zip(rec["before"], rec["used"], held[target], rec["velocity"],
                                                    moment[target]):
                before, used, true = before.double(), used.double(), true.double()
                step = torch.zeros_like(before) if v is None else -rec["s"] * rec["lr"] * v.double()
                flipped = (torch.sign(v) * torch.sign(v_now) < 0 if v is not None and v_now is not None
                           else torch.zeros_like(before, dtype=torch.bool))
                want["pred_sq"] += float((used - true).square().sum())
                want["stale_sq"] += float((before - true).square().sum())
                want["pred_sq_flipped"] += float((used - true)[flipped].square().sum())
                want["stale_sq_flipped"] += float((before - true)[flipped].square().sum())
                want["flipped"] += int(flipped.sum())
                want["coords"] += before.numel()
                want["cross"] += float(((true - before) * step).sum())
                want["step_sq"] += float(step.square().sum())
        got = stage.probe.summary() if stage.probe else None
        if stage.is_last and variant == "consistent":  # the last stage's target is its own version: no prediction
            assert want["actions"] == 0 and got["actions"] == 0
            continue
        assert got["actions"] == want["actions"] > 5
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-6), (stage.index, key)
        assert 0 < got["flipped"] < got["coords"]  # some velocities change sign over s updates, most do not
        assert 0 < got["quality"] < 1  # at this small rate the prediction lands nearer than the stale weights


def test_adaptive_steps_along_the_velocity_by_at_most_the_paper_step(tiny):
    model, data = tiny
    ex, _, _ = run_local(model, data, "spectrain", 4, updates=16, record=True, predictor="adaptive", lr=0.2)
    factors = []
    for stage in ex.stages:
        for rec in stage.records:
            if rec["s"] == 0 or rec["velocity"][0] is None:
                continue
            moved = torch.cat([(u - b).reshape(-1) for u, b in zip(rec["used"], rec["before"])]).double()
            v = torch.cat([x.reshape(-1) for x in rec["velocity"]]).double()
            factor = float(moved @ v / (v @ v))
            torch.testing.assert_close(moved, factor * v, rtol=1e-4, atol=1e-6)  # along v
            factors.append(factor / (-rec["s"] * rec["lr"]))  # the damping used
    assert len(factors) > 50 and all(-1e-6 <= f <= 1 + 1e-6 for f in factors)
    assert min(factors) < 0.99  # damped once predictions were scored
    linear = run_local(model, data, "spectrain", 4, updates=16, lr=0.2)[0]
    adaptive = ex.state_dict()
    assert any(not torch.equal(adaptive[k], w) for k, w in linear.state_dict().items())

