"""How long a stage's actions take, true on a GPU: host time on CPU, CUDA events on the stage's stream.

On a GPU an action's Python call returns once its kernels are queued, long before they ran, so host
time (``perf_counter``) around it measures the queueing, not the work. ``StageClock`` records a CUDA
event before and after each action instead and reads them only when someone asks for the figures
(``settle``: statistics, a timeline, a checkpoint), so timing adds no host synchronization per action.
A timeline's CUDA times are placed on the wall clock through one event recorded, synchronized, at the
first timed action.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StageClock"]

_SETTLE_EVERY = 512  # actions whose events are kept before the finished ones are read without waiting


class StageClock:
    """Busy seconds per action kind and, with ``trace``, ``(kind, m, start, end)`` per action in wall-clock seconds.

    Args:
        trace: keep the timeline.
        event: makes timing events (``torch.cuda.Event(enable_timing=True)`` on CUDA); given, it is used on every
            device (tests).
    """

    def __init__(self, trace: bool = False, event: Callable[[], Any] | None = None) -> None:
        self.trace = trace
        self._event = event
        self.pending: list[tuple[str, int, Any, Any, Any, list]] = []
        self._origin: tuple[Any, float] | None = None  # an event and the wall-clock second it completed at

    def _make(self, device: torch.device) -> Any:
        if self._event is not None:
            return self._event()
        if device.type == "cuda":
            return torch.cuda.Event(enable_timing=True)
        return None

    def start(self, device: torch.device) -> Any:
        """Mark the start of an action on ``device``; hand the mark to ``stop``."""
        event = self._make(device)
        if event is None:
            return time.perf_counter()
        if self.trace and self._origin is None:
            origin = self._make(device)
            origin.record()
            origin.synchronize()
            self._origin = (origin, time.time())
        event.record()
        return event

    def stop(self, kind: str, m: int, mark: Any, stats: Any, timeline: list) -> None:
        """The action ``kind`` of micro-batch ``m`` that began at ``mark`` ended: count it in ``stats`` (a
        ``StageStats``) and, with ``trace``, in ``timeline``; on CUDA its seconds are added by ``settle``."""
        stats.actions[kind] += 1
        if isinstance(mark, float):
            busy: float = time.perf_counter() - mark
            stats.busy_s[kind] += busy
            if self.trace:
                now = time.time()
                timeline.append((kind, m, now - busy, now))
            return
        end: Any = self._event() if self._event is not None else torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((kind, m, mark, end, stats, timeline))
        if len(self.pending) >= _SETTLE_EVERY:
            self.settle(wait=False)

    def settle(self, wait: bool = True) -> None:
        """Add the seconds of the actions timed by events to their statistics and timeline: those whose events
        completed, or (``wait``) all of them, waiting for the device."""
        done = 0
        for kind, m, start, end, stats, timeline in self.pending:
            if not wait and not end.query():
                break
            end.synchronize()
            busy = start.elapsed_time(end) / 1e3
            stats.busy_s[kind] += busy
            if self.trace and self._origin is not None:
                origin, wall = self._origin
                begin = wall + origin.elapsed_time(start) / 1e3
                timeline.append((kind, m, begin, begin + busy))
            done += 1
        del self.pending[:done]
