"""Blocks that sleep through their forward and backward: stage time that uses no CPU."""

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


class SplitSleepBlock(nn.Module):
    """A block whose backward splits as zero-bubble schedules ask for it: ``input_s`` on the input gradient (I),
    ``weight_s`` on the weight gradient (W), both on a full backward (B = I + W); ``forward_s`` forward.

    The output is the sum of two branches, one reaching only the input and one only a parameter, so autograd
    asked for the input alone (``inputs=`` the input) sleeps only in the first, asked for the parameters alone
    only in the second::

        x --- sleep I on backward ---+
                                     +--> out
        bias --- sleep W on backward -+

    On the first stage the input needs no gradient and both torch and rayspec run the whole backward as W:
    there the first branch hangs on a parameter of its own, so that W still sleeps I + W.
    """

    def __init__(self, forward_s: float, input_s: float, weight_s: float) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1))
        self.anchor = nn.Parameter(torch.ones(1))  # the input branch's parameter on the first stage only
        self.forward_s, self.input_s, self.weight_s = forward_s, input_s, weight_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_s)
        through_input = _SleepGrad.apply(x if x.requires_grad else x * self.anchor, self.input_s)
        return through_input + _SleepGrad.apply(self.bias, self.weight_s)
