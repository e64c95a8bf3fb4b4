"""The weights each action of one stage runs at, by its staleness policy (docs/design.md §2).

``none`` runs every action at the stored weights; ``stash`` (PipeDream) puts the version ``F(m)`` used into the
parameter storage for ``B(m)``, one copy per version in flight; ``predict`` (SpecTrain) puts a prediction
``s`` versions ahead into the storage (``rayspec.core.predict``), computed into one scratch copy whose memory
the storage borrows for the action (``rayspec.core.swap``); its ``PredictionProbe`` scores every prediction
against the weights the stage then reaches. Outside an action the storage always holds the stored weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rayspec.core.lr import LRSchedule
from rayspec.core.methods import TWO_VERSIONS
from rayspec.core.optim import Optimizer
from rayspec.core.predict import PredictionProbe, coefficients
from rayspec.core.swap import Swap, WeightSwap
from rayspec.core.two_versions import TwoVersions

__all__ = ["ActionWeights"]


class ActionWeights:
    """The weights in one stage's parameter storage during each of its actions.

    Args:
        params: the stage's trainable parameters.
        policy: ``none``, ``stash`` or ``predict``.
        optimizer: the stage's optimizer (its direction is what ``predict`` extrapolates).
        lr: the learning rate per update count.
        predictor: ``linear``, ``momentum`` or ``adaptive`` (``predict`` policy).
        probe: scores the predictions (``predict`` policy), or None.
        record: keep, per action, the weights it used and what was stored before and after.
        on_memory: called whenever the weight copies held may have grown (the stage's peak).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], policy: str, optimizer: Optimizer, lr: LRSchedule,
                 predictor: str, probe: PredictionProbe | None, record: bool,
                 on_memory: Callable[[], None]) -> None:
        self.params = list(params)
        self.policy, self.optimizer, self.lr, self.predictor, self.probe = policy, optimizer, lr, predictor, probe
        self.record = record
        self.records: list[dict[str, Any]] = []
        self.stash: dict[int, tuple[list[torch.Tensor], int]] = {}  # version -> (weights, users)
        self.scratch: list[torch.Tensor] | None = None  # one copy, allocated on first use
        # ((version, a, b), per parameter the scratch tensor or None): the prediction the scratch copy holds
        self.ready: tuple[tuple[int, float, float], list[torch.Tensor | None]] | None = None
        self.ahead_s: int | None = None  # s of the first prediction since the last update
        self.on_memory = on_memory
        self.two = TwoVersions(self)

    # ------------------------------------------------------------------ per action
    def forward(self, m: int, s: int, version: int) -> contextlib.AbstractContextManager[None]:
        """The weights of ``F(m)`` at ``version``, ``s`` versions ahead (``predict``); stashes them (``stash``)."""
        if self.policy == "stash":
            self._stash(version)
        if self.policy in TWO_VERSIONS:
            return self.two.forward(m, s, version)
        return self._predicted("F", m, s, version)

    def backward(self, m: int, s: int, version: int, forward_version: int) -> contextlib.AbstractContextManager[None]:
        """The weights of ``B(m)`` at ``version``: ``F(m)``'s (``stash``, released on exit; ``2bw`` and
        ``predict-2bw``: the kept copy), or a prediction ``s`` versions ahead (``predict``)."""
        if self.policy in TWO_VERSIONS:
            return self.two.backward(m, version, forward_version)
        if self.policy != "stash":
            return self._predicted("B", m, s, version)
        return self._stashed(m, version, forward_version)

    def updating(self, version: int) -> None:
        """The stage is about to leave ``version`` (``2bw``: keep a copy for the backwards still to come)."""
        if self.policy in TWO_VERSIONS:
            self.two.updating(version)

    @contextlib.contextmanager
    def _stashed(self, m: int, version: int, forward_version: int) -> Iterator[None]:
        swaps = None if forward_version == version else list(self.stash[forward_version][0])
        with self._swapped("B", m, 0, version, swaps):
            yield
        self._release(forward_version)

    def _predicted(self, kind: str, m: int, s: int, version: int) -> contextlib.AbstractContextManager[None]:
        if self.policy != "predict" or s == 0:
            return self._swapped(kind, m, s, version, None)
        if self.ahead_s is None:  # the first prediction since the update: the next update prepares its like
            self.ahead_s = s
        damping = self.probe.damping() if self.probe is not None else 1.0
        a, b = coefficients(self.predictor, s, version, self.lr, self.optimizer, damping)
        key = (version, a, b)
        if self.ready is not None and self.ready[0] == key:  # the scratch copy holds this prediction already
            predicted: list[Swap] = list(self.ready[1])
        else:
            # Before the first update there is no direction yet: nothing to predict.
            predicted = [None if d is None else (d, a, b) for d in self.optimizer.direction()]
        scored = self.probe is not None and any(d is not None for d in predicted)
        return self._swapped(kind, m, s, version, predicted, target=version + s if scored else None, key=key)

    @contextlib.contextmanager
    def _swapped(self, kind: str, m: int, s: int, version: int, swaps: Sequence[Swap] | None,
                 target: int | None = None, key: tuple[int, float, float] | None = None) -> Iterator[None]:
        """Put ``swaps`` into the parameter storage (``WeightSwap``) for the action, restored afterwards; with
        ``target``, the probe scores this prediction once the stage holds that version; with ``key``, the
        scratch copy holds that prediction afterwards; with ``record``, the weights before, during and after the
        action are kept."""
        before = [p.data.clone() for p in self.params] if self.record else None
        probe = self.probe if target is not None else None
        direction = self.optimizer.direction() if self.record else []
        stale, held = probe.held(version, self.params, self.optimizer) if probe else (None, None)
        used: list[torch.Tensor] | None = None
        kept: list[torch.Tensor | None] | None = None
        try:
            with WeightSwap(self.optimizer.aliases, swaps, self._scratch):
                if key is not None and swaps is not None:
                    self._prepared(key, swaps)
                if probe is not None and stale is not None and held is not None and target is not None:
                    a, b = coefficients("linear", s, version, self.lr, self.optimizer)
                    paper = held * b if a == 1.0 else stale * (a - 1.0) + held * b
                    probe.predicted(target, stale, probe.sample(self.params), paper)
                if self.record:
                    used = [p.data.clone() for p in self.params]
                    kept = [None if d is None else d.clone() for d in direction]
                yield
        finally:
            if self.record:
                self.records.append(
                    {"kind": kind, "microbatch": m, "version": version, "s": s, "lr": self.lr(version),
                     "direction": kept, "before": before, "used": used,
                     "after": [p.data.clone() for p in self.params]}
                )

    # ------------------------------------------------------------------ copies
    def _stash(self, version: int) -> None:
        weights, users = self.stash.get(version, (None, 0))
        copied = weights is None
        self.stash[version] = ([p.data.clone() for p in self.params] if weights is None else weights, users + 1)
        if copied:  # only a new copy can raise the peak
            self.on_memory()

    def _release(self, version: int) -> None:
        weights, users = self.stash.pop(version)
        if users > 1:
            self.stash[version] = (weights, users - 1)

    def _scratch(self) -> list[torch.Tensor]:
        if self.scratch is None:
            self.scratch = [torch.empty_like(p.data) for p in self.params]
            self.on_memory()
        return self.scratch

    def _prepared(self, key: tuple[int, float, float], swaps: Sequence[Swap]) -> None:
        """The scratch copy holds the prediction ``key`` (version, a, b) for the parameters that ``swaps`` predict."""
        scratch: Sequence[torch.Tensor | None] = self.scratch or [None] * len(swaps)  # none: nothing predicted
        self.ready = (key, [None if x is None else t for x, t in zip(swaps, scratch)])

    def ahead(self, version: int) -> tuple[float, float, list[torch.Tensor]] | None:
        """``(a, b, scratch)`` of the prediction the first action at ``version`` will ask for, like the last
        version's first one, for the update to compute in its pass (``Optimizer.step``); None where no
        prediction follows, the optimizer does not compile its update, or ``adaptive``'s damping is only known
        after the update."""
        s, self.ahead_s = self.ahead_s, None
        if self.policy != "predict" or not s or not self.optimizer.spec.compile or self.predictor == "adaptive":
            return None
        a, b = coefficients(self.predictor, s, version, self.lr, self.optimizer)
        return a, b, self._scratch()

    def reached(self, version: int, ahead: tuple[float, float, list[torch.Tensor]] | None = None) -> None:
        """The stage now holds ``version`` (with ``ahead``: the update wrote that prediction into the scratch
        copy): the probe scores the predictions that aimed at it."""
        if ahead is not None:
            self.ready = ((version, ahead[0], ahead[1]), list(ahead[2]))
        if self.probe is not None and version in self.probe.pending:  # the direction only where it is needed
            self.probe.reached(version, self.params, self.optimizer)

    def bytes(self, weights: int) -> dict[str, int]:
        """Bytes of the scratch copy and the stash, for weights of ``weights`` bytes."""
        return {"scratch": weights if self.scratch is not None else 0, "stash": weights * len(self.stash)}

    def clear(self) -> None:
        """Forget the copies (a drained stage moved or reloaded): no stash, a new scratch on next use."""
        self.stash.clear()
        self.scratch = None
        self.ready = None
        self.two.clear()
