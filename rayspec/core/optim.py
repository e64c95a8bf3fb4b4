"""SGD with momentum that updates parameter storage in place, and learning-rate schedules.

[Note: why not torch.optim.SGD] Asynchronous pipelines update a stage's weights between a
micro-batch's forward and its backward. ``torch.optim.SGD`` writes through the parameter
(``p.add_``), which bumps its autograd version and makes the pending backward fail with
"modified by an inplace operation". This optimizer writes through ``p.data`` instead and
otherwise follows ``torch.optim.SGD``'s arithmetic exactly (tested against it):

    d = g + wd * w
    v = mu * v + (1 - dampening) * d      (v = d on the first step)
    w = w - lr * (d + mu * v if nesterov else v)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["SGD", "LRSchedule", "LR_SCHEDULES", "non_finite_grad"]

LR_SCHEDULES = ("constant", "poly", "cosine")


class SGD:
    """Momentum SGD over a list of parameters, writing ``p.data`` in place.

    ``velocity(i)`` is SpecTrain's smoothed gradient ``v`` of parameter ``i``: the momentum
    buffer (weight decay included, as it enters the buffer); with ``momentum=0`` it is the last
    applied direction ``d``. Nesterov's look-ahead is not part of ``v``.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        keep_velocity: bool = False,
    ) -> None:
        self.params = list(params)
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.dampening = dampening
        self.nesterov = nesterov
        # With momentum, v is the buffer; without, keep the last direction only if asked (SpecTrain).
        self.keep_velocity = keep_velocity
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            d = p.grad
            if self.weight_decay:
                d = d.add(p.data, alpha=self.weight_decay)
            if self.momentum:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = d.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(d, alpha=1 - self.dampening)
                d = d.add(buf, alpha=self.momentum) if self.nesterov else buf
            elif self.keep_velocity:
                last = self.buffers[i]
                if last is None:
                    self.buffers[i] = d.detach().clone()
                else:
                    last.copy_(d)
            p.data.add_(d, alpha=-lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def velocity(self, i: int) -> torch.Tensor | None:
        return self.buffers[i]

    def state_dict(self) -> dict:
        return {"buffers": [None if b is None else b.detach().clone() for b in self.buffers]}

    def load_state_dict(self, state: dict) -> None:
        self.buffers = [None if b is None else b.detach().clone().to(p.device) for b, p in zip(state["buffers"], self.params)]

    def state_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers if b is not None)


def non_finite_grad(module: torch.nn.Module) -> str | None:
    """The name of the first parameter whose gradient holds a NaN or an infinity, if any.

    A finite sum proves every element finite, and summing is one vectorized pass (``isfinite``
    or an infinity norm costs 20-30x more on CPU); only a non-finite sum, which finite but huge
    gradients can also give, is checked element by element.
    """
    named = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None]
    if not named or torch.isfinite(torch.stack([g.sum() for _, g in named])).all():
        return None
    return next((name for name, g in named if not torch.isfinite(g).all()), None)


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a function of the update count, the same for every method and stage.

    Attributes:
        lr: base learning rate.
        schedule: ``constant``, ``poly`` (``(1 - t/T)^power``, the paper's, power 2) or ``cosine``.
        total: ``T``, the planned number of updates (needed by ``poly`` and ``cosine``).
        warmup: linear warm-up over this many updates from ``lr / warmup``.
        power: exponent of ``poly``.
        min_lr: floor of ``poly`` and ``cosine``.
    """

    lr: float
    schedule: str = "constant"
    total: int = 1
    warmup: int = 0
    power: float = 2.0
    min_lr: float = 0.0

    def __call__(self, t: int) -> float:
        if self.warmup and t < self.warmup:
            return self.lr * (t + 1) / self.warmup
        if self.schedule == "constant":
            return self.lr
        span = max(1, self.total - self.warmup)
        frac = min(1.0, max(0.0, (t - self.warmup) / span))
        if self.schedule == "poly":
            factor = (1.0 - frac) ** self.power
        else:  # cosine
            factor = 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.min_lr + (self.lr - self.min_lr) * factor
