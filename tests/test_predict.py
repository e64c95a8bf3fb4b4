"""SpecTrain's predictors and the prediction probe (``rayspec.predict``), checked against the optimizer and
against distances computed from every recorded action."""

from __future__ import annotations

import pytest
import torch
from conftest import ADAMW, run_local

from rayspec.core.lr import LRSchedule
from rayspec.core.optim import Optimizer, OptimSpec
from rayspec.core.predict import PredictionProbe, coefficients


def _first_update(name: str, **spec) -> tuple[torch.nn.Parameter, Optimizer]:
    """One parameter after one update at lr 0.1 from a random gradient (its optimizer has a direction)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50))
    opt = Optimizer([p], OptimSpec(name, **spec))
    p.grad = torch.randn(50)
    opt.step(0.1)
    return p, opt


def _prediction(p: torch.nn.Parameter, opt: Optimizer, predictor: str, s: int, version: int,
                lr: LRSchedule) -> torch.Tensor:
    a, b = coefficients(predictor, s, version, lr, opt)
    return a * p.data + b * opt.direction()[0]


def _steps(p: torch.nn.Parameter, opt: Optimizer, s: int, version: int, lr: LRSchedule, grad_of) -> torch.Tensor:
    """The weights after ``s`` more updates from ``version``, with gradients ``grad_of()``."""
    for i in range(s):
        p.grad = grad_of()
        opt.step(lr(version + i))
    return p.data.clone()


@pytest.mark.parametrize("s", [1, 3, 6])
def test_each_predictor_is_exact_where_its_assumption_holds_sgd(s):
    poly, const = LRSchedule(0.1, "poly", total=20), LRSchedule(0.1)
    # momentum: no new gradient, so only the momentum in v moves the weights (lr following the schedule)
    p, opt = _first_update("sgd", momentum=0.9)
    want = _prediction(p, opt, "momentum", s, 1, poly)
    torch.testing.assert_close(want, _steps(p, opt, s, 1, poly, lambda: torch.zeros(50)), rtol=1e-5, atol=1e-6)
    # linear (the paper's): a gradient that keeps the velocity as it is, at a constant rate
    p, opt = _first_update("sgd", momentum=0.9)
    want = _prediction(p, opt, "linear", s, 1, const)
    v = opt.direction()[0].clone()
    torch.testing.assert_close(want, _steps(p, opt, s, 1, const, lambda: (1 - 0.9) * v), rtol=1e-5, atol=1e-6)
    assert coefficients("linear", s, 1, const, opt) == (1.0, pytest.approx(-s * 0.1))
    assert coefficients("adaptive", s, 1, const, opt, 0.25) == (1.0, pytest.approx(-0.25 * s * 0.1))
    _, plain = _first_update("sgd", momentum=0.0)
    assert coefficients("momentum", s, 1, const, plain) == (1.0, 0.0)  # plain SGD: momentum predicts nothing
    with pytest.raises(ValueError, match="predictor='cubic' is unknown"):
        coefficients("cubic", s, 1, const, opt)


def _frozen(p: torch.nn.Parameter, opt: Optimizer, step: int | None = None) -> torch.Tensor:
    """Make Adam's state one that a gradient ``g = m`` keeps as it is (``v = m^2``), at ``step`` if given; ``m``."""
    st = opt.torch.state[opt.aliases[0]]
    st["exp_avg_sq"].copy_(st["exp_avg"].square())
    if step is not None:
        st["step"].fill_(step)
    return st["exp_avg"].clone()


@pytest.mark.parametrize("name,wd", [("adam", 0.0), ("adamw", 0.0), ("adamw", 0.05)])
@pytest.mark.parametrize("s", [1, 3, 6])
def test_each_predictor_is_exact_where_its_assumption_holds_adam(name, wd, s):
    const, poly = LRSchedule(0.1), LRSchedule(0.1, "poly", total=20)
    # linear: the state stays as it is (g = m with v = m^2); its next step, with the bias corrections of the target
    # step, s times. Exact for one step; for more, where the corrections no longer change (late) and without decay.
    p, opt = _first_update(name, weight_decay=wd, betas=(0.8, 0.9))
    m = _frozen(p, opt)
    want = _prediction(p, opt, "linear", 1, 1, const)
    torch.testing.assert_close(want, _steps(p, opt, 1, 1, const, lambda: m.clone()), rtol=1e-5, atol=1e-6)
    if wd == 0.0:
        p, opt = _first_update(name, weight_decay=wd, betas=(0.8, 0.9))
        m = _frozen(p, opt, step=10**6)
        want = _prediction(p, opt, "linear", s, 10**6, const)
        reached = _steps(p, opt, s, 10**6, const, lambda: m.clone())
        torch.testing.assert_close(want, reached, rtol=1e-5, atol=1e-6)
    # momentum: no new gradient; the moments decay, the bias corrections and the lr schedule move on, AdamW's decay
    # compounds. Exact with eps = 0 (eps enters each step's denominator unscaled).
    if name == "adam" and wd:
        return  # Adam's decay enters the gradient: there is no step without a new gradient
    p, opt = _first_update(name, weight_decay=wd, betas=(0.8, 0.9), eps=0.0)
    want = _prediction(p, opt, "momentum", s, 1, poly)
    torch.testing.assert_close(want, _steps(p, opt, s, 1, poly, lambda: torch.zeros(50)), rtol=1e-5, atol=1e-6)


def test_adam_direction_is_its_next_step():
    """With the state as it is, Adam's next step is ``lr * D`` (AdamW: and the decoupled decay): ``D`` uses the bias
    corrections of that step."""
    p, opt = _first_update("adamw", weight_decay=0.1)
    m = _frozen(p, opt)
    w, d = p.data.clone(), opt.direction()[0].clone()
    reached = _steps(p, opt, 1, 1, LRSchedule(0.05), lambda: m.clone())
    torch.testing.assert_close(reached, w * (1 - 0.05 * 0.1) - 0.05 * d, rtol=1e-6, atol=1e-7)


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


@pytest.mark.parametrize("variant,optimizer", [("paper", "sgd"), ("consistent", "sgd"), ("paper", "adamw")])
def test_probe_equals_distances_from_every_recorded_action(tiny, variant, optimizer):
    """With every coordinate sampled, the probe's sums are the full-weight distances of every predicted action
    to the weights the stage held at the target version (read from the records of the same run); the paper's step is
    ``s`` times the optimizer's next step (AdamW: its decoupled decay included)."""
    model, data = tiny
    settings = ADAMW if optimizer == "adamw" else {}
    ex, _, _ = run_local(model, data, "spectrain", 4, updates=16, record=True, variant=variant, probe=10**7,
                         **settings)
    for stage in ex.stages:
        held = {rec["version"]: rec["before"] for rec in stage.records}
        held[stage.version] = [p.data.clone() for p in stage.params]
        moment = {rec["version"]: rec["direction"] for rec in stage.records}
        moment[stage.version] = [None if b is None else b.clone() for b in stage.optimizer.direction()]
        want = dict.fromkeys(("actions", "pred_sq", "stale_sq", "cross", "step_sq", "pred_sq_flipped",
                              "stale_sq_flipped", "flipped", "coords"), 0)
        for rec in stage.records:
            target = rec["version"] + rec["s"]
            if rec["s"] == 0 or all(v is None for v in rec["direction"]) or target not in held:
                continue
            want["actions"] += 1
            a, b = coefficients("linear", rec["s"], rec["version"], stage.lr, stage.optimizer)  # the paper's step
            for before, used, true, v, v_now in zip(rec["before"], rec["used"], held[target], rec["direction"],
                                                    moment[target]):
                before, used, true = before.double(), used.double(), true.double()
                step = torch.zeros_like(before) if v is None else (a - 1) * before + b * v.double()
                # flipped: the paper's step goes against the direction at the target (SGD: the velocity changed sign)
                flipped = (step * v_now.double() > 0 if v is not None and v_now is not None
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
            if rec["s"] == 0 or rec["direction"][0] is None:
                continue
            moved = torch.cat([(u - b).reshape(-1) for u, b in zip(rec["used"], rec["before"])]).double()
            v = torch.cat([x.reshape(-1) for x in rec["direction"]]).double()
            factor = float(moved @ v / (v @ v))
            torch.testing.assert_close(moved, factor * v, rtol=1e-4, atol=1e-6)  # along v
            factors.append(factor / (-rec["s"] * rec["lr"]))  # the damping used
    assert len(factors) > 50 and all(-1e-6 <= f <= 1 + 1e-6 for f in factors)
    assert min(factors) < 0.99  # damped once predictions were scored
    linear = run_local(model, data, "spectrain", 4, updates=16, lr=0.2)[0]
    adaptive = ex.state_dict()
    assert any(not torch.equal(adaptive[k], w) for k, w in linear.state_dict().items())

