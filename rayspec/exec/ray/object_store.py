"""``pipeline.transport=object_store`` (and ``gloo``/``nccl``): one actor call per action, ObjectRefs passed
stage to stage.

The driver submits each stage's actions in the schedule's global order; Ray runs one caller's calls on an
actor in submission order, so the pipeline advances by data flow, with no driver round trip per action.
Activations and gradients go from actor to actor through the object store (zero-copy tensors) or, with
``gloo``/``nccl``, by Ray Direct Transport over a collective group of the stage actors; never through
the driver. The driver waits only to bound the micro-batches in flight.

With global clipping (``Transport.clip_globally``), once the driver has submitted every stage's update-carrying
backward of an update it submits, to every stage, ``grad_norms`` and then ``finish_update`` with all their
results as arguments: Ray hands a call its arguments once they exist, so each stage applies its update as soon
as the last stage's norms are known, and its next action (submitted later) runs after that. The driver itself
never waits; the cost is two actor calls per stage and update, and one small object per stage.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import ray

from rayspec.core.schedule import Schedule
from rayspec.core.transports import TransportSpec
from rayspec.exec.base import MicrobatchFeed, fused_backward, ordered_actions
from rayspec.exec.ray.transport import ZERO_COPY, LossSink, Transport, TransportOptions
from rayspec.exec.ray.wire import to_wire

__all__ = ["ObjectStoreTransport"]


class ObjectStoreTransport(Transport):
    """Args:
        rdt: ``gloo`` or ``nccl`` to move tensors by Ray Direct Transport; ``None`` for the object store.
        max_in_flight: micro-batches allowed between their stage-0 forward and backward; raised to what the
            schedule itself needs; default twice that.
        report_every: the last stage's losses are fetched every this many micro-batches.
    """

    def __init__(self, rdt: str | None = None, max_in_flight: int | None = None, report_every: int = 10) -> None:
        self.name = rdt or "object_store"
        self.rdt = rdt
        self.max_in_flight = max_in_flight
        self.report_every = report_every
        if rdt is None:
            self.env = dict(ZERO_COPY)
        else:
            self.replaces = "none"  # a collective group cannot be rebuilt around a dead member
            self.nccl = "ray" if rdt == "nccl" else None  # Ray's NCCL group imports cupy

    @classmethod
    def create(cls, spec: TransportSpec, options: TransportOptions) -> ObjectStoreTransport:
        """``object_store``, or the line's name as the Ray Direct Transport backend (``gloo``, ``nccl``)."""
        return cls(None if spec.name == "object_store" else spec.name, options.max_in_flight)

    def start(self, actors: Sequence[Any]) -> None:
        super().start(actors)
        if self.rdt is not None and len(self.actors) > 1:
            from ray.experimental.collective import create_collective_group

            create_collective_group(self.actors, backend=self.rdt)

    def _call(self, method: Any, sends_tensors: bool) -> Any:
        if self.rdt is not None and len(self.actors) > 1 and sends_tensors:
            return method.options(tensor_transport=self.rdt)
        return method

    def run(self, schedule: Schedule, s: dict | None, feed: MicrobatchFeed, on_losses: LossSink) -> None:
        n = len(self.actors)
        reports: deque = deque()  # pop_losses refs, oldest first
        last_forwards = 0
        # The bound is for memory; it must never stall the pipeline: the driver submits in one
        # global order, so waiting on a recent backward would hold back calls that other stages
        # could already run. Default: twice what the schedule itself keeps in flight.
        need = schedule.max_in_flight(0)
        window = max(self.max_in_flight or 2 * need, need)
        acts: dict[tuple[int, int], Any] = {}
        grads: dict[tuple[int, int], Any] = {}
        done0: deque = deque()  # stage-0 backward refs not yet waited on, oldest first
        started0 = finished0 = 0  # stage-0 forwards submitted, stage-0 backwards known done
        last = n - 1
        updates = [0] * n  # update-carrying backwards submitted, per stage
        rounds: list = []  # finish_update refs of the global-norm rounds
        for p in ordered_actions(schedule, s):
            a, k, m = p.action, p.action.stage, p.action.microbatch
            actor = self.actors[k]
            if a.kind == "F":
                if k == 0:
                    while started0 - finished0 >= window and done0:
                        ray.get(done0.popleft())  # raises here if any stage failed on that micro-batch
                        finished0 += 1
                    started0 += 1
                    _collect(reports, on_losses, block=False)
                # What the driver sends goes as numpy arrays, which Ray ships without a copy (tensors: pickled)
                x = to_wire(feed.input(m)) if k == 0 else acts.pop((k - 1, m))
                if p.fused:
                    sb, update = fused_backward(schedule, m, s)
                    ref = self._call(actor.forward_backward, k > 0).remote(m, x, to_wire(feed.labels(m)), p.s, sb,
                                                                          update)
                    _after_backward(k, m, ref, grads, done0)
                    self._count_update(k, update, updates, rounds)
                elif k == last:
                    actor.forward.remote(m, x, to_wire(feed.labels(m)), p.s)
                else:
                    acts[(k, m)] = self._call(actor.forward, True).remote(m, x, None, p.s)
            else:
                g = None if k == last else grads.pop((k + 1, m))
                ref = self._call(actor.backward, k > 0).remote(m, g, p.s, a.update)
                _after_backward(k, m, ref, grads, done0)
                self._count_update(k, a.update, updates, rounds)
            if k == last and a.kind == "F":
                last_forwards += 1
                if last_forwards % self.report_every == 0:
                    reports.append(self.actors[last].pop_losses.remote())
        ray.get(list(done0) + rounds)  # a failed round raises here, if no later action of its stage did
        reports.append(self.actors[last].pop_losses.remote())
        _collect(reports, on_losses, block=True)


    def _count_update(self, k: int, update: bool, updates: list[int], rounds: list) -> None:
        """Stage ``k``'s backward carried an update: with global clipping, once every stage's backward of this update
        is submitted, submit the round that applies them (see the module's doc)."""
        if not (update and self.global_norm):
            return
        updates[k] += 1
        if min(updates) == max(updates):
            norms = [a.grad_norms.remote() for a in self.actors]
            rounds.extend(a.finish_update.remote(*norms) for a in self.actors)


def _collect(reports: deque, on_losses: LossSink, block: bool) -> None:
    """Hand on the losses of the ``pop_losses`` calls that are done (all of them when ``block``), in order."""
    while reports:
        if not block and not ray.wait([reports[0]], timeout=0)[0]:
            return
        on_losses(dict(sorted(ray.get(reports.popleft()).items())))


def _after_backward(k: int, m: int, ref: Any, grads: dict, done0: deque) -> None:
    if k == 0:
        done0.append(ref)
    else:
        grads[(k, m)] = ref
