"""What every executor shares: the ``Executor`` interface, the global order of a schedule's actions, the
micro-batch feed and the per-stage statistics. ``LocalExecutor`` (``rayspec.exec.local``) is the reference.

Every executor gets the same ``Stage`` objects and the same schedule and must give the same
numbers: a stage's state depends only on its own ordered actions and their inputs, so any
interleaving across stages that respects the data dependencies computes the same thing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from rayspec.core.activations import Activation
from rayspec.core.schedule import Action, Schedule
from rayspec.core.stage import Stage

__all__ = ["Executor", "PlannedAction", "ordered_actions", "fused_backward", "check_stages", "MicrobatchFeed",
           "stage_stats", "finish_updates", "clips_globally"]


@dataclass(frozen=True)
class PlannedAction:
    """An action with its prediction distance ``s`` and whether the last stage may fuse it with the next."""

    action: Action
    s: int
    fused: bool = False  # last stage: this F is immediately followed by its own B


def ordered_actions(schedule: Schedule, s: dict | None) -> list[PlannedAction]:
    """The schedule's actions in a valid global order, each with SpecTrain's ``s`` (0 where ``s`` is ``None``).

    On the last stage an ``F(m)`` directly followed by ``B(m)`` in its list is marked ``fused``;
    its ``B`` is then left out (executors that can run both in one call do so).

    Args:
        s: ``schedule.differences(method, variant)``.
    """
    last = schedule.stages - 1
    fusable = set()
    acts = schedule.actions[last]
    for a, b in zip(acts, acts[1:]):
        if a.kind == "F" and b.kind == "B" and a.microbatch == b.microbatch:
            fusable.add(a.microbatch)
    out = []
    for a in schedule.order():
        if a.stage == last and a.microbatch in fusable and a.kind == "B":
            continue
        fused = a.stage == last and a.kind == "F" and a.microbatch in fusable
        out.append(PlannedAction(a, 0 if s is None else s[a.key], fused))
    return out


def fused_backward(schedule: Schedule, m: int, s: dict | None) -> tuple[int, bool]:
    """``s`` and the update flag of the last stage's ``B(m)`` (for a fused F+B)."""
    last = schedule.stages - 1
    b = next(a for a in schedule.actions[last] if a.kind == "B" and a.microbatch == m)
    return (0 if s is None else s[b.key]), b.update


class Executor(ABC):
    """Runs pipeline segments and reports per-micro-batch losses.

    Attributes:
        method, variant: the training method and SpecTrain's target (``rayspec.core.methods``).
    """

    method: str
    variant: str

    @property
    def transport(self) -> str:
        """How tensors move between the stages (``none``: in one process)."""
        return "none"

    @property
    def can_revive(self) -> bool:
        """Whether ``revive`` can replace dead stage processes in place."""
        return False

    @abstractmethod
    def run(
        self,
        schedule: Schedule,
        microbatches: Iterable[tuple[Activation, torch.Tensor]],
        on_loss: Callable[[int, float], None] | None = None,
    ) -> list[float]:
        """Run one segment over ``(input, labels)`` micro-batches, pulled lazily in order.

        Returns the losses per micro-batch, scaled as trained (``1/group``);
        ``on_loss(m, loss)`` is called as they become known, for progress reports.
        """

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The merged state_dict of all stages (original parameter names)."""

    @abstractmethod
    def stage_stats(self) -> list[dict]:
        """Per stage: actions, busy seconds per kind, version, peak stash and weight bytes."""

    def synchronize(self) -> None:
        """Return once every stage's device has run what was queued (GPU work runs after the call that queued it)."""
        for stage in getattr(self, "stages", ()):
            if stage.device.type == "cuda":
                torch.cuda.synchronize(stage.device)

    def timeline(self) -> list[list[tuple[str, int, float, float]]]:
        """Per stage, ``(kind, micro-batch, start, end)`` of every action (stages built with ``trace=True``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no timeline")

    @abstractmethod
    def checkpoint_states(self) -> list[dict]:
        """Per stage, ``Stage.checkpoint_state()`` (between segments, when the pipeline is drained)."""

    def revive(self, stages: Sequence[Stage]) -> list[int]:
        """Replace the stage processes that died and load ``stages`` into all of them; the stages replaced."""
        raise RuntimeError(f"{type(self).__name__} runs no stage processes that could be revived")

    def node_ids(self) -> list[str] | None:
        """The cluster node of each stage, stage 0 first; None when the stages run in this process."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release resources (actors, process groups)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def clips_globally(stages: Sequence[Stage]) -> bool:
    """Whether the stages' updates wait for the gradient norm over all of them (``rayspec.core.stage``, the note on
    global clipping)."""
    return any(st.clip_grad_norm is not None and st.clip_scope == "global" for st in stages)


def finish_updates(stages: Sequence[Stage]) -> bool:
    """Once every stage's update waits for the global gradient norm, gather their norms (stage 0's first) and let
    each apply its update; whether they did."""
    if not all(st.waiting for st in stages):
        return False
    norms = [st.grad_norms() for st in stages]
    for st in stages:
        st.finish_update(norms)
    return True


def check_stages(schedule: Schedule, n: int) -> None:
    if schedule.stages != n:
        raise ValueError(f"schedule has {schedule.stages} stages but the executor has {n}")


class MicrobatchFeed:
    """Pulls ``(input, labels)`` micro-batches in order as stage 0 needs them; labels wait for the last stage."""

    def __init__(self, microbatches: Iterable[tuple[Activation, torch.Tensor]], count: int) -> None:
        self._it: Iterator = iter(microbatches)
        self._count = count
        self._next = 0
        self._labels: dict[int, torch.Tensor] = {}

    def input(self, m: int) -> Activation:
        if m != self._next:
            raise RuntimeError(f"micro-batch {m} requested out of order (expected {self._next})")
        try:
            x, y = next(self._it)
        except StopIteration:
            raise ValueError(f"the data ran out after {m} of {self._count} micro-batches") from None
        self._next += 1
        self._labels[m] = y
        return x

    def labels(self, m: int) -> torch.Tensor:
        return self._labels.pop(m)


def stage_stats(stage: Stage) -> dict:
    """One stage's statistics as executors report them (``Executor.stage_stats``); busy times settled first."""
    stage.clock.settle()
    return {
        "stage": stage.index,
        "device": str(stage.device),
        "version": stage.version,
        "actions": dict(stage.stats.actions),
        "busy_s": dict(stage.stats.busy_s),
        "peak_stash": stage.stats.peak_stash,
        "peak_weight_bytes": stage.stats.peak_weight_bytes,
        "weight_bytes": stage.weight_bytes(),
        "sent_bytes": dict(stage.stats.sent_bytes),
        **({"cuda_peak_bytes": torch.cuda.max_memory_allocated(stage.device)} if stage.device.type == "cuda" else {}),
        **({"prediction": stage.probe.summary()} if stage.probe is not None else {}),
    }
