"""Gradient checks and clipping (``rayspec.core.grads``): per-stage norms gathered in stage order clip exactly as
``torch.nn.utils.clip_grad_norm_`` on the whole model."""

from __future__ import annotations

import pytest
import torch

from rayspec.core.finite import FiniteChecks
from rayspec.core.grads import clip_grads, tensor_norms, total_norm


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


@pytest.mark.parametrize("max_norm", [0.05, 1e6])  # clipped, and not
def test_stage_norms_in_stage_order_clip_bit_exactly_as_the_whole_model(max_norm):
    whole, cut = _model(), _model()
    x = torch.randn(32, 8)
    for net in (whole, cut):
        net(x).pow(2).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(whole.parameters(), max_norm)
    stages = [cut[0:2], cut[2:4], cut[4:]]
    norms = [tensor_norms([p.grad for p in st.parameters()]) for st in stages]
    assert torch.equal(total_norm(norms), want)
    for st in stages:
        assert clip_grads([p.grad for p in st.parameters()], max_norm, norms) is None
    for a, b in zip(whole.parameters(), cut.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_stage_alone_clips_by_its_own_norm_and_names_a_bad_gradient():
    net, ref = _model(), _model()
    x = torch.randn(4, 8)
    for n in (net, ref):
        n(x).sum().backward()
    grads = [p.grad for p in net.parameters()]
    assert clip_grads(grads, 0.1, [tensor_norms(grads)]) is None
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(net.parameters(), ref.parameters()))
    net[2].weight.grad[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="the gradient of 2.weight is not finite at update 3 on stage 1"):
        FiniteChecks(1).grads_of(net, 3, tensor_norms(grads))
    assert clip_grads(grads, 0.1, [tensor_norms(grads)]) == "the gradient norm over the stage is inf"
    good = torch.zeros(2)
    other = [good, torch.tensor([float("nan")])]  # another stage's gradient is bad: this one's norm is fine
    net[2].weight.grad[0, 0] = 0.0
    FiniteChecks(1).grads_of(net, 3, tensor_norms(grads))
    assert clip_grads(grads, 0.1, other) == "the gradient norm over all stages is nan"
