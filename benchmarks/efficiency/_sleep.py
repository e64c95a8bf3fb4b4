"""A block that sleeps through its forward and backward: stage time that uses no CPU."""

from __future__ import annotations

import time

import torch
from torch import nn


class _SleepGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, backward_s):  # type: ignore[override]
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        time.sleep(ctx.backward_s)
        return g, None


class SleepBlock(nn.Module):
    """A block that takes ``forward_s`` to run forward and ``backward_s`` backward, using no CPU."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_s)
        return _SleepGrad.apply(x * self.scale, self.backward_s)
