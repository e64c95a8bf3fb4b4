"""PipeDream-2BW's two weight versions per stage, and the same with SpecTrain's prediction (docs/design.md §2).

``2bw``: forwards run at the stored weights; at an update, if some forward at the version being left still has
its backward to come, one copy of that version is kept, and those backwards run at it (released after the
last). With 1F1B and ``pipeline.accumulate >= N - 1`` no micro-batch is in flight across two updates, so a
stage holds at most its weights and one old copy (two versions), and every gradient is the one at its forward's
weights, applied one update late. ``predict-2bw``: a forward whose backward will come after the next update
runs instead at SpecTrain's prediction of that version (one copy per version, shared by those forwards), and its
backward at the same copy: the gradient is exact for the weights it was taken at, as in 2BW, and those weights
are the predicted next ones rather than the old ones. ``spectrain`` with ``pipeline.accumulate`` predicts the
same forwards but runs their backwards at the stored weights (a mixed backward, or a recompute).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rayspec.core.predict import coefficients

__all__ = ["TwoVersions"]


class TwoVersions:
    """The ``2bw`` and ``predict-2bw`` policies of one stage's ``ActionWeights`` (``owner``), whose ``stash`` holds
    the copies (version -> (weights, backwards still to use them)) so that the memory accounting sees them."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.users: dict[int, int] = {}  # 2bw: version -> forwards at it whose backward is still to come
        self.kept: dict[int, int] = {}  # predict-2bw: micro-batch -> version whose prediction its forward ran at
        self.ahead: dict[int, int] = {}  # predict-2bw: version -> how many versions its prediction looks ahead

    def forward(self, m: int, s: int, version: int) -> contextlib.AbstractContextManager[None]:
        w = self.owner
        if w.policy == "2bw":
            self.users[version] = self.users.get(version, 0) + 1
            return w._swapped("F", m, 0, version, None)
        if s == 0:  # its backward comes before the next update: the stored weights serve both
            return w._swapped("F", m, 0, version, None)
        weights = self._prediction(version, s)
        self.kept[m] = version
        scored = w.probe is not None and any(d is not None for d in w.optimizer.direction())
        return w._swapped("F", m, s, version, list(weights), target=version + s if scored else None)

    def backward(self, m: int, version: int, forward_version: int) -> contextlib.AbstractContextManager[None]:
        w = self.owner
        if w.policy == "2bw":
            self.users[forward_version] -= 1
            if not self.users[forward_version]:
                del self.users[forward_version]
            kept = forward_version if forward_version != version else None
        else:
            kept = self.kept.pop(m, None)
        if kept is None:
            return w._swapped("B", m, 0, version, None)
        return self._from_copy(m, version, kept)

    @contextlib.contextmanager
    def _from_copy(self, m: int, version: int, kept: int) -> Iterator[None]:
        with self.owner._swapped("B", m, 0, version, list(self.owner.stash[kept][0])):
            yield
        self.owner._release(kept)

    def updating(self, version: int) -> None:
        """``2bw``: before the stage leaves ``version``, keep a copy for the backwards of its forwards still to come."""
        w = self.owner
        if w.policy != "2bw" or not self.users.get(version):
            return
        if w.stash:
            old = next(iter(w.stash))
            raise RuntimeError(
                f"pipedream-2bw keeps two weight versions, but a stage still has backwards of version {old} to run "
                f"when it leaves version {version}; raise pipeline.accumulate to at least pipeline.stages - 1"
            )
        w.stash[version] = ([p.data.clone() for p in w.params], self.users[version])
        w.on_memory()

    def _prediction(self, version: int, s: int) -> list[torch.Tensor]:
        """The weights predicted ``s`` versions ahead of ``version``, computed once per version and shared."""
        w = self.owner
        if version in w.stash:
            if self.ahead[version] != s:
                raise RuntimeError(
                    f"spectrain-2bw keeps one prediction per version, but forwards at version {version} look "
                    f"{self.ahead[version]} and {s} updates ahead; raise pipeline.accumulate to at least "
                    "pipeline.stages - 1"
                )
            weights, users = w.stash[version]
            w.stash[version] = (weights, users + 1)
            return weights
        damping = w.probe.damping() if w.probe is not None else 1.0
        a, b = coefficients(w.predictor, s, version, w.lr, w.optimizer, damping)
        with torch.no_grad():
            weights = [p.data.clone() if d is None else
                       torch.add(p.data, d, alpha=b) if a == 1.0 else torch.mul(p.data, a).add_(d, alpha=b)
                       for p, d in zip(w.params, w.optimizer.direction())]
        w.stash[version] = (weights, 1)
        self.ahead[version] = s
        w.on_memory()
        return weights

    def clear(self) -> None:
        self.users.clear()
        self.kept.clear()
        self.ahead.clear()
