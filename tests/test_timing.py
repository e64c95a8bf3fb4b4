"""A stage's clock and finite checks: host time and immediate errors on CPU; on a GPU events and flags that are
read only when asked. The GPU behaviour runs here with stand-in events and forced deferral (CUDA: test_cuda)."""

from __future__ import annotations

import time

import pytest
import torch

from rayspec.core.finite import FiniteChecks
from rayspec.core.stage import StageStats
from rayspec.core.timing import StageClock


class HostEvent:
    """A CUDA event's interface on the host clock."""

    recorded = 0

    def record(self):
        self.t = time.perf_counter()
        HostEvent.recorded += 1

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_host_time_on_cpu():
    clock, stats, timeline = StageClock(trace=True), StageStats(), []
    mark = clock.start(torch.device("cpu"))
    time.sleep(0.01)
    clock.stop("F", 3, mark, stats, timeline)
    assert stats.actions["F"] == 1 and stats.busy_s["F"] >= 0.01
    assert len(timeline) == 1 and timeline[0][:2] == ("F", 3) and timeline[0][3] - timeline[0][2] >= 0.01
    assert clock.pending == []


def test_events_are_read_only_when_settled():
    clock, stats, timeline = StageClock(trace=True, event=HostEvent), StageStats(), []
    wall = time.time()
    for m in range(3):
        mark = clock.start(torch.device("cpu"))
        time.sleep(0.005)
        clock.stop("B", m, mark, stats, timeline)
    assert stats.actions["B"] == 3 and stats.busy_s["B"] == 0.0 and timeline == []  # nothing read yet
    clock.settle()
    assert stats.busy_s["B"] >= 0.015 and [e[:2] for e in timeline] == [("B", 0), ("B", 1), ("B", 2)]
    assert all(wall - 0.1 <= start < end <= time.time() + 0.1 for _, _, start, end in timeline)
    assert all(a[3] <= b[2] for a, b in zip(timeline, timeline[1:]))  # in order, on the wall clock
    assert clock.pending == []


def test_finite_checks_raise_at_once_on_cpu():
    checks = FiniteChecks(3)
    checks.loss(torch.tensor(1.5), 0, 1)
    with pytest.raises(FloatingPointError, match="the loss of micro-batch 7 is nan at update 2 on stage 3"):
        checks.loss(torch.tensor(float("nan")), 7, 2)
    module = torch.nn.Linear(2, 2)
    module.weight.grad = torch.ones(2, 2)
    module.bias.grad = torch.tensor([1.0, float("inf")])
    with pytest.raises(FloatingPointError, match="the gradient of bias is not finite at update 5 on stage 3"):
        checks.grads_of(module, 5)
    module.bias.grad = torch.tensor([3e38, 3e38])  # the sum overflows, every element is finite
    checks.grads_of(module, 5)


def test_deferred_checks_raise_the_earliest_at_flush():
    checks = FiniteChecks(1, defer=True)
    module = torch.nn.Linear(2, 2)
    for update in (1, 2, 3):
        module.weight.grad = torch.full((2, 2), float("nan") if update >= 2 else 1.0)
        module.bias.grad = torch.ones(2)
        checks.grads_of(module, update)  # no error yet: flags kept
        checks.loss(torch.tensor(float("inf") if update == 3 else 0.5), update, update)
    with pytest.raises(FloatingPointError, match="the gradient of weight is not finite at update 2 on stage 1"):
        checks.flush()
    checks.flush()  # read once: nothing left
    checks.loss(torch.tensor(2.0), 9, 9)
    checks.flush()
