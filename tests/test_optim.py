"""The stage optimizers (``rayspec.core.optim``): torch's, stepping aliases of the parameters."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from rayspec.core.optim import OPTIMIZERS, Optimizer, OptimSpec, sgd_state
from rayspec.core.swap import WeightSwap


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _grads(net: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    net.zero_grad()
    net(torch.randn(6, 5)).pow(2).sum().backward()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_matches_torch(name, fused):
    """Over aliases of the parameters: bit-exact with torch's optimizer on the parameters, of the same kernel."""
    a, b = _net(), _net()
    ours = Optimizer(list(a.parameters()), OptimSpec(name, weight_decay=0.05, betas=(0.8, 0.95), eps=1e-6,
                                                     fused=fused))
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    ref = cls(b.parameters(), lr=0.1, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05,
              **({"fused": True} if fused else {}))
    for i in range(10):
        _grads(a, i)
        _grads(b, i)
        ours.step(0.1)
        ref.step()
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_update_between_forward_and_backward_leaves_the_pending_backward_alone(name):
    """The aliases carry their own version counter: an in-place update after a forward does not fail its backward
    (the parameter's counter is unchanged), and the update is in the parameter's storage."""
    net = _net()
    opt = Optimizer(list(net.parameters()), OptimSpec(name))
    _grads(net, 0)
    out = net(torch.randn(6, 5)).sum()  # saves the weights for its backward
    versions = [p._version for p in net.parameters()]
    before = [p.detach().clone() for p in net.parameters()]
    opt.step(0.1)
    assert [p._version for p in net.parameters()] == versions
    assert all(not torch.equal(p, w) for p, w in zip(net.parameters(), before))
    net.zero_grad()
    out.backward()  # "modified by an inplace operation" if the update had bumped the parameters' versions


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_weight_swap_restores_bit_exactly_and_the_aliases_follow_it(name):
    """The aliases share the storage object: during a swap they see the swapped-in weights, and an optimizer step
    after the swap updates the restored weights, as without a swap."""
    a, b = _net(), _net()
    opts = [Optimizer(list(n.parameters()), OptimSpec(name)) for n in (a, b)]
    for step in range(3):
        for n, opt in zip((a, b), opts):
            _grads(n, step)
            opt.step(0.1)
        params = list(a.parameters())
        other = [torch.randn_like(p) for p in params]
        want = [t.clone() for t in other]
        with WeightSwap(params, list(other), lambda: []):  # exchanges the memory: `other` holds the weights now
            for alias, t in zip(opts[0].aliases, want):
                assert torch.equal(alias, t)
        for x, y in zip(a.parameters(), b.parameters()):
            assert torch.equal(x, y)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_copy_steps_its_own_parameters(name):
    """Pickled or deep-copied with its module, the optimizer steps the copy's parameters and continues from the same
    state: the copy trains as the original does."""
    net = _net()
    module = torch.nn.ModuleList([net])  # the optimizer and the module in one object, as a stage holds them
    opt = Optimizer(list(net.parameters()), OptimSpec(name))
    _grads(net, 0)
    opt.step(0.1)
    for twin_module, twin_opt in (copy.deepcopy((module, opt)), pickle.loads(pickle.dumps((module, opt)))):
        twin = twin_module[0]
        assert all(x.data_ptr() == p.data_ptr() for x, p in zip(twin_opt.aliases, twin.parameters()))
        frozen = [p.detach().clone() for p in net.parameters()]
        _grads(twin, 1)
        twin_opt.step(0.1)
        assert all(torch.equal(p, w) for p, w in zip(net.parameters(), frozen))  # the original is untouched
        reference = copy.deepcopy(net)
        ref_opt = Optimizer(list(reference.parameters()), OptimSpec(name))
        ref_opt.load_state_dict(opt.state_dict())
        _grads(reference, 1)
        ref_opt.step(0.1)
        for x, y in zip(twin.parameters(), reference.parameters()):
            assert torch.equal(x, y)


def test_state_dict_round_trip_and_the_old_checkpoint_format():
    net = _net()
    opt = Optimizer(list(net.parameters()), OptimSpec("sgd", momentum=0.9))
    _grads(net, 0)
    opt.step(0.1)
    state = opt.state_dict(device="cpu")
    buffers = [state["state"][i]["momentum_buffer"] for i in range(4)]
    old = sgd_state(buffers, 0.9)  # a checkpoint that held the momentum buffers as a list
    for saved in (state, old):
        twin = copy.deepcopy(net)
        twin_opt = Optimizer(list(twin.parameters()), OptimSpec("sgd", momentum=0.9))
        twin_opt.load_state_dict(saved)
        assert all(torch.equal(x, y) for x, y in zip(twin_opt.direction(), opt.direction()))
    with pytest.raises(ValueError, match="the optimizer state is sgd's, this optimizer is adamw"):
        Optimizer(list(net.parameters()), OptimSpec("adamw")).load_state_dict(state)
