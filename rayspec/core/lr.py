"""Learning-rate schedules over the update count, the same for every method, stage and optimizer."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LRSchedule", "LR_SCHEDULES"]

LR_SCHEDULES = ("constant", "poly", "cosine")


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
