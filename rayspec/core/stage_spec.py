"""``StageSpec``: how a stage trains (optimizer, learning rate, staleness, precision, ...), built once per run.

``rayspec.training.prepare.stage_spec`` builds it from the config; ``make_stages`` gives it the method's
staleness policy and clipping scope and hands the same spec to every ``Stage``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rayspec.core.lr import LRSchedule
from rayspec.core.methods import BACKWARDS, POLICIES
from rayspec.core.optim import OptimSpec
from rayspec.core.precision import PRECISIONS
from rayspec.core.predict import PREDICTORS
from rayspec.errors import unknown

__all__ = ["StageSpec", "CLIP_SCOPES"]

CLIP_SCOPES = ("stage", "global")
"""Whose gradient norm clips a stage's update: its own, or the whole model's (every stage's; flushed methods)."""


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """What every stage of a run shares; checked where it is made."""

    lr: LRSchedule | float = 0.1
    """Learning rate per update count (a float: constant)."""
    optim: OptimSpec = field(default_factory=OptimSpec)
    """The optimizer and its settings (``rayspec.core.optim``)."""
    policy: str = "none"
    """``none``, ``stash`` or ``predict`` (``rayspec.core.staleness``); ``make_stages`` sets the method's."""
    clip_grad_norm: float | None = None
    """Clip each update's gradient to this 2-norm (None: no clipping)."""
    clip_scope: str = "stage"
    """``stage`` (a stage's own norm) or ``global`` (every stage's; ``rayspec.core.stage``, Note: global clipping);
    ``make_stages`` sets the method's."""
    precision: str = "fp32"
    """``fp32`` or ``bf16`` (``rayspec.core.precision``)."""
    group: int = 1
    """Micro-batches accumulated per update; the last stage scales its loss by ``1/group``."""
    backward: str = "mixed"
    """``mixed`` or ``recompute`` (``rayspec.core.stage``, Note: mixed backward)."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """Loss of the last stage, ``loss_fn(output, labels)``; None: cross-entropy."""
    device: str | torch.device = "cpu"
    """Where the stages compute."""
    record: bool = False
    """Keep, per action, the weights it used and what was stored before and after (tests and debugging only: one
    weight copy per action)."""
    seed: int = 0
    """Seeds each stage's own random stream (dropout; ``rayspec.core.rng``)."""
    trace: bool = False
    """Keep the start and end (wall-clock seconds) of every action in ``Stage.timeline``."""
    predictor: str = "linear"
    """``linear`` (the paper's), ``momentum`` or ``adaptive`` (``predict`` policy; ``rayspec.core.predict``)."""
    probe: int = 4096
    """Weight coordinates the prediction probe samples (``predict`` policy); 0 turns it off."""

    def __post_init__(self) -> None:
        for name, value, known in (("policy", self.policy, POLICIES), ("backward", self.backward, BACKWARDS),
                                   ("predictor", self.predictor, PREDICTORS), ("precision", self.precision, PRECISIONS),
                                   ("clip_scope", self.clip_scope, CLIP_SCOPES)):
            if value not in known:
                raise unknown(name, value, known)

    @property
    def schedule(self) -> LRSchedule:
        """The learning rate per update count (``lr`` as a schedule)."""
        return self.lr if isinstance(self.lr, LRSchedule) else LRSchedule(float(self.lr))
