"""SpecTrain's weight predictors, and the probe that measures how well a prediction lands.

A stage ``s`` versions behind its target extrapolates its optimizer's next step (``rayspec.core.optim``, the
note on the next step: ``W <- (1 - lr * wd) * W - lr * D``, ``D`` the direction, ``wd`` the decoupled weight
decay). Every predictor gives ``W(t+s) ≈ A * W(t) + B * D(t)``; they differ in ``A`` and ``B``:

* ``linear`` (the paper's): the next step ``s`` times, ``A = 1 - s * lr(t) * wd``, ``B = -s * lr(t) * k``, with
  ``k`` the optimizer's factor for the step at the target version (1 for SGD, the bias-correction ratio for
  Adam). For SGD it is the paper's ``W - s * lr * v``. Exact when the optimizer's state stays what it is for the
  next ``s`` updates (and, with a decoupled decay, to first order in ``lr * wd``).
* ``momentum``: the next ``s`` steps with the gradients still to come taken as zero, so only what the state
  already holds moves the weights as it decays (``mu^i`` for SGD, ``beta1^i / sqrt(beta2^i)`` for Adam),
  following the learning-rate schedule, the decay compounded. With ``mu = 0`` it predicts nothing.
* ``adaptive``: the linear step damped by ``c`` in ``[0, 1]``, the least-squares scale that the stage's own
  past predictions would have needed to land on the weights it really reached (``best_scale`` below,
  averaged with exponential decay). It starts at 1.

[Note: prediction quality] For every predicted action the probe keeps a fixed, seeded sample of the
stage's weight coordinates, stale (the stored ``W(t)``) and predicted; when the stage reaches the
target version ``t + s`` it reads the same coordinates of the weights it really holds, ``W*``, and adds

    |W_pred - W*|^2,   |W_stale - W*|^2,   <W* - W_stale, P>,   |P|^2

with ``P`` the paper's step: ``s`` times the optimizer's next step (the ``linear`` predictor's, for SGD
``-s * lr(t) * v``). ``quality = sqrt(sum |W_pred - W*|^2 / sum |W_stale - W*|^2)``: 0 is a perfect
prediction, 1 no better than not predicting, above 1 worse than the stale weights. ``best_scale = sum
<W* - W_stale, P> / sum |P|^2`` is the multiple of the paper's step that would have minimised the distance:
1 when its length is right, below 1 when it overshoots, at or below 0 when it points the wrong way
(measured against the paper's step whatever the predictor, so the figures compare across predictors). A
target the run never reaches (training ends first) is not counted.

The same sums over the *flipped* coordinates, those where the paper's step goes against the direction ``D`` at
the target version (``P * D* > 0``; for SGD: the velocity changed sign; they oscillate, and a linear
extrapolation of them points the wrong way), give
``quality_flipped``, ``quality_kept`` (the other coordinates) and ``flipped_share`` (their fraction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from rayspec.core.lr import LRSchedule
from rayspec.core.optim import Optimizer
from rayspec.errors import unknown

__all__ = ["PREDICTORS", "PredictionProbe", "coefficients", "ratios", "window"]

PREDICTORS = ("linear", "momentum", "adaptive")
SUMS = ("pred_sq", "stale_sq", "cross", "step_sq", "pred_sq_flipped", "stale_sq_flipped", "flipped", "coords")
DECAY = 0.95
"""Per measurement, of the ``adaptive`` predictor's running sums (about the last 20 predictions)."""


def coefficients(predictor: str, s: int, version: int, lr: LRSchedule, optimizer: Optimizer,
                 damping: float = 1.0) -> tuple[float, float]:
    """``(A, B)`` of the prediction ``A * W + B * D`` ``s`` versions ahead of ``version`` (see the module's doc).

    Args:
        predictor: one of ``PREDICTORS``.
        lr: the learning rate per update count.
        optimizer: whose next step is extrapolated (its factors and decoupled decay).
        damping: ``adaptive``'s factor ``c`` (the probe's).
    """
    wd = optimizer.decay
    if s == 0 and predictor in PREDICTORS:
        return 1.0, 0.0
    if predictor in ("linear", "adaptive"):
        c = 1.0 if predictor == "linear" else damping
        rate = lr(version)
        return 1.0 - c * s * rate * wd, -c * s * rate * optimizer.factor(version, s, decaying=False)
    if predictor == "momentum":
        a, b = 1.0, 0.0
        for i in range(1, s + 1):  # W <- (1 - lr_i wd) W - lr_i k_i D, the decay compounded
            rate = lr(version + i - 1)
            kept = 1.0 - rate * wd
            a, b = kept * a, kept * b - rate * optimizer.factor(version, i, decaying=True)
        return a, b
    raise unknown("predictor", predictor, PREDICTORS)


class PredictionProbe:
    """Measures one stage's predictions on ``size`` seeded weight coordinates (see the module's note).

    Args:
        params: the stage's parameters, in order.
        size: coordinates sampled (all of them if the stage has fewer).
        seed: fixes the sample.
    """

    def __init__(self, params: list[torch.nn.Parameter], size: int, seed: int) -> None:
        numels = [p.numel() for p in params]
        total = sum(numels)
        gen = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(total, generator=gen)[: min(size, total)].sort().values
        self.index: list[torch.Tensor] = []
        start = 0
        for p, n in zip(params, numels):
            local = chosen[(chosen >= start) & (chosen < start + n)] - start
            self.index.append(local.to(p.device))
            start += n
        self.size = int(chosen.numel())
        self._used = [k for k, i in enumerate(self.index) if i.numel()]  # parameters with sampled coordinates
        self._held: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (version, weights, direction) samples
        self._zeros = {k: torch.zeros(len(i), dtype=params[k].dtype, device=params[k].device)
                       for k, i in enumerate(self.index) if i.numel()}
        self.pending: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.totals = {"actions": 0, **{k: 0 if k in ("flipped", "coords") else 0.0 for k in SUMS}}
        self.recent = {"cross": 0.0, "step_sq": 0.0}  # exponentially decayed, for the adaptive predictor

    def sample(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The sampled coordinates of parameter-shaped ``tensors`` (weights, direction; None reads as zeros),
        in float64 on the CPU."""
        parts = [self._zeros[k] if (t := tensors[k]) is None else t.detach().reshape(-1).index_select(0, self.index[k])
                 for k in self._used]
        if not parts:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(parts).to("cpu", torch.float64)

    def sample_direction(self, direction: Sequence[torch.Tensor | None] | Optimizer) -> torch.Tensor:
        """The sampled coordinates of the direction: given per parameter, or asked of the optimizer for those
        coordinates only (Adam's is not computed in full for them)."""
        if not isinstance(direction, Optimizer):
            return self.sample(direction)
        picked = direction.direction_at(self.index)
        parts = [self._zeros[k] if (t := picked[k]) is None else t for k in self._used]
        return torch.cat(parts).to("cpu", torch.float64) if parts else torch.zeros(0, dtype=torch.float64)

    def held(self, version: int, params: list[torch.nn.Parameter],
             direction: Sequence[torch.Tensor | None] | Optimizer) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples of the stored weights and the optimizer's direction at ``version`` (per parameter, or the
        optimizer's), taken once per version (both change only when the version does); call it only while the
        storage holds the stored weights."""
        if self._held is None or self._held[0] != version:
            self._held = (version, self.sample(params), self.sample_direction(direction))
        return self._held[1], self._held[2]

    def forget(self) -> None:
        """Drop the samples of the held version (the stage's weights were replaced)."""
        self._held = None

    def to(self, device: torch.device) -> None:
        """Sample tensors on ``device`` (the stage moved there)."""
        self.index = [i.to(device) for i in self.index]
        self._zeros = {k: z.to(device) for k, z in self._zeros.items()}

    def predicted(self, target: int, stale: torch.Tensor, predicted: torch.Tensor, paper_step: torch.Tensor) -> None:
        """An action ran at ``predicted`` weights for version ``target``; ``stale`` was stored, and the paper's
        step (``s`` times the optimizer's next step) is ``paper_step``."""
        self.pending.setdefault(target, []).append((stale, predicted, paper_step))

    def reached(self, version: int, params: list[torch.nn.Parameter],
                direction: Sequence[torch.Tensor | None] | Optimizer) -> None:
        """The stage now holds ``version`` (weights ``params``, the optimizer's direction ``direction``, or the
        optimizer whose it is): score the predictions that aimed at it."""
        waiting = self.pending.pop(version, None)
        if not waiting:
            return
        true, d_now = self.held(version, params, direction)
        for stale, pred, step in waiting:
            flipped = (step * d_now > 0).double()  # the step goes along -D: the same sign as D now: D changed sign
            terms = torch.stack([(pred - true).square(), (stale - true).square(), (true - stale) * step, step.square()])
            values = torch.cat([terms.sum(1), (terms[:2] * flipped).sum(1), flipped.sum().reshape(1)]).tolist()
            sums = dict(zip(SUMS[:6], values[:6]), flipped=int(values[6]), coords=int(true.numel()))
            self.totals["actions"] += 1
            for k, v in sums.items():
                self.totals[k] += v
            for k in self.recent:
                self.recent[k] = DECAY * self.recent[k] + sums[k]

    def damping(self) -> float:
        """The ``adaptive`` predictor's factor: the recent best scale, clipped to ``[0, 1]``; 1 before any measurement."""
        if self.recent["step_sq"] <= 0.0:
            return 1.0
        return min(1.0, max(0.0, self.recent["cross"] / self.recent["step_sq"]))

    def summary(self) -> dict[str, Any]:
        """Counts, sums, and the ``quality`` and ``best_scale`` over every scored prediction so far."""
        return {"coordinates": self.size, **self.totals, **ratios(self.totals), "damping": self.damping()}

    def state(self) -> dict[str, Any]:
        return {"coordinates": self.size,
                "pending": {k: [tuple(t.clone() for t in entry) for entry in v] for k, v in self.pending.items()},
                "totals": dict(self.totals), "recent": dict(self.recent)}

    def load(self, state: dict[str, Any]) -> None:
        """Continue from ``state()``; a state of another sample size (``pipeline.probe`` changed) starts afresh."""
        self.forget()
        if state.get("coordinates") != self.size:
            return
        self.pending = {int(k): [tuple(t.clone() for t in entry) for entry in v] for k, v in state["pending"].items()}
        self.totals = {**self.totals, **state["totals"]}  # sums added since the state was written start at 0
        self.recent = dict(state["recent"])


def ratios(sums: dict[str, float]) -> dict[str, float | None]:
    """``quality``, ``best_scale``, ``quality_flipped``, ``quality_kept`` and ``flipped_share`` of summed
    measurements (None where nothing was scored)."""
    def root(num: float, den: float) -> float | None:
        return math.sqrt(max(num, 0.0) / den) if den > 0.0 else None

    kept = (sums["pred_sq"] - sums["pred_sq_flipped"], sums["stale_sq"] - sums["stale_sq_flipped"])
    return {"quality": root(sums["pred_sq"], sums["stale_sq"]),
            "best_scale": sums["cross"] / sums["step_sq"] if sums["step_sq"] > 0.0 else None,
            "quality_flipped": root(sums["pred_sq_flipped"], sums["stale_sq_flipped"]),
            "quality_kept": root(*kept) if kept[1] > 1e-12 * sums["stale_sq"] else None,
            "flipped_share": sums["flipped"] / sums["coords"] if sums["coords"] else None}


def window(stats: list[dict[str, Any]], before: list[dict[str, Any]] | None) -> dict[str, float]:
    """Per stage, ``quality`` and ``best_scale`` of the predictions scored since ``before`` (earlier
    ``stage_stats()``), and the ``adaptive`` damping now, as flat metric keys (``prediction_quality/s0``, ...)."""
    out: dict[str, float] = {}
    for i, st in enumerate(stats):
        now = st.get("prediction")
        if now is None:
            continue
        prev = before[i].get("prediction") if before else None
        sums = {k: now[k] - (prev[k] if prev else 0.0) for k in SUMS}
        for key, value in ratios(sums).items():
            if value is not None and key in ("quality", "best_scale", "quality_flipped"):
                out[f"prediction_{key}/s{st['stage']}"] = value
        out[f"prediction_damping/s{st['stage']}"] = now["damping"]
    return out
