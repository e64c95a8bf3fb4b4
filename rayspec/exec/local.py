"""``LocalExecutor``: every stage in this process, actions in the schedule's global order; the reference.

It runs every schedule: split backwards (``I``, ``W``) and virtual stages (a stage per model chunk) included."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from rayspec.core.activations import Activation
from rayspec.core.schedule import Schedule
from rayspec.core.stage import Stage
from rayspec.exec.base import (
    Executor,
    MicrobatchFeed,
    check_stages,
    finish_updates,
    fused_backward,
    ordered_actions,
    stage_stats,
)

__all__ = ["LocalExecutor"]


class LocalExecutor(Executor):
    """All stages in this process, actions in the schedule's global order: the reference executor. With global
    clipping, the updates waiting for the norm over all stages are applied as soon as every stage waits (a flushed
    schedule reaches that before any stage's next action)."""

    def __init__(self, stages: Sequence[Stage], method: str, variant: str = "paper") -> None:
        self.stages = list(stages)
        self.method, self.variant = method, variant

    def run(
        self,
        schedule: Schedule,
        microbatches: Iterable[tuple[Activation, torch.Tensor]],
        on_loss: Callable[[int, float], None] | None = None,
    ) -> list[float]:
        n = len(self.stages)
        check_stages(schedule, n)
        s = schedule.differences(self.method, self.variant)
        feed = MicrobatchFeed(microbatches, schedule.microbatches)
        acts: dict[tuple[int, int], Activation] = {}
        grads: dict[tuple[int, int], Activation] = {}
        losses: dict[int, float] = {}
        for p in ordered_actions(schedule, s):
            a, k, m = p.action, p.action.stage, p.action.microbatch
            stage = self.stages[k]
            if a.kind == "F":
                x = feed.input(m) if k == 0 else acts.pop((k - 1, m))
                out = stage.forward(m, x, feed.labels(m) if k == n - 1 else None, s=p.s)
                if k == n - 1:
                    losses[m] = float(out)
                    if on_loss is not None:
                        on_loss(m, losses[m])
                else:
                    acts[(k, m)] = out
                if p.fused:
                    sb, update = fused_backward(schedule, m, s)
                    gi = stage.backward(m, None, s=sb, update=update)
                    if k > 0:
                        grads[(k, m)] = gi
            elif a.kind == "W":
                stage.backward_weight(m, update=a.update)
            else:  # B, or I: the input gradient of a split backward
                g = None if k == n - 1 else grads.pop((k + 1, m))
                if a.kind == "I":
                    gi = stage.backward_input(m, g)
                else:
                    gi = stage.backward(m, g, s=p.s, update=a.update)
                if k > 0:
                    grads[(k, m)] = gi
            if stage.waiting:
                finish_updates(self.stages)
        for stage in self.stages:
            stage.checks.flush()  # on GPUs the finite checks were flags on the device
        return [losses[m] for m in range(schedule.microbatches)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            merged.update(stage.state_dict())
        return merged

    def stage_stats(self) -> list[dict]:
        return [stage_stats(st) for st in self.stages]

    def timeline(self) -> list[list[tuple[str, int, float, float]]]:
        for st in self.stages:
            st.clock.settle()
        return [list(st.timeline) for st in self.stages]

    def checkpoint_states(self) -> list[dict]:
        for st in self.stages:
            st.clock.settle()
        return [st.checkpoint_state() for st in self.stages]
