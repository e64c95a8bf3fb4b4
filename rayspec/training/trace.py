"""Timelines of pipeline runs: a Chrome trace (Perfetto), a Gantt chart, and the bubble fraction.

A timeline holds, per stage, ``(kind, microbatch, start, end)`` for every action, with ``start``
and ``end`` in wall-clock seconds (``time.time()``) so that stages in different processes line
up; on one machine they share a clock, across machines they are as close as the hosts' clocks.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Sequence

__all__ = ["Timeline", "bubble_fraction", "chrome_trace", "write_chrome_trace", "write_gantt"]

Timeline = Sequence[Sequence[tuple[str, int, float, float]]]

_COLOURS = {"F": "#4c72b0", "B": "#dd8452"}


def _spans(timeline: Timeline, segments: Sequence[tuple[float, float]] | None) -> list[float]:
    """Seconds from the first action's start to the last action's end, per segment (one without segments)."""
    actions = [a for stage in timeline for a in stage]
    if not actions:
        return []
    if not segments:
        return [max(a[3] for a in actions) - min(a[2] for a in actions)]
    # Segments are successive runs in time order: each action belongs to the last one starting before it.
    starts = [lo for lo, _ in segments]
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for _, _, start, end in actions:
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and end <= segments[i][1]:
            first[i] = min(first.get(i, start), start)
            last[i] = max(last.get(i, end), end)
    return [last[i] - first[i] for i in sorted(first)]


def bubble_fraction(timeline: Timeline, segments: Sequence[tuple[float, float]] | None = None) -> float:
    """The share of stage time spent idle: ``1 - busy / (stages * span)``.

    Args:
        timeline: per stage, ``(kind, microbatch, start, end)`` of every action.
        segments: wall-clock ``(start, end)`` of separate pipeline runs (between evaluations);
            each is measured from its first action to its last, so time spent outside the pipeline
            (evaluation, checkpoints) is not counted as bubble. None: one run.
    """
    busy = sum(end - start for stage in timeline for _, _, start, end in stage)
    capacity = len(timeline) * sum(_spans(timeline, segments))
    return 0.0 if capacity <= 0 else max(0.0, 1.0 - busy / capacity)


def chrome_trace(timeline: Timeline, name: str = "rayspec") -> dict:
    """A Chrome trace-event document: one thread per stage, one complete event per action (microseconds)."""
    starts = [a[2] for stage in timeline for a in stage]
    t0 = min(starts) if starts else 0.0
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}]
    for k, stage in enumerate(timeline):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": k, "args": {"name": f"stage {k}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": k, "args": {"sort_index": k}})
        for kind, m, start, end in stage:
            events.append({
                "name": f"{kind}{m}", "cat": kind, "ph": "X", "pid": 0, "tid": k,
                "ts": (start - t0) * 1e6, "dur": (end - start) * 1e6, "args": {"microbatch": m, "stage": k},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(timeline: Timeline, path: str | os.PathLike, name: str = "rayspec") -> None:
    """Write ``chrome_trace`` as JSON (open it in https://ui.perfetto.dev or chrome://tracing)."""
    with open(path, "w") as f:
        json.dump(chrome_trace(timeline, name), f)


def write_gantt(timeline: Timeline, path: str | os.PathLike, title: str = "", max_actions: int = 400) -> None:
    """A Gantt chart of the schedule as run: one row per stage, forwards and backwards in two colours.

    Only the first ``max_actions`` actions per stage are drawn (a readable picture of the steady state);
    micro-batch numbers are written into the bars when they fit.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    starts = [a[2] for stage in timeline for a in stage[:max_actions]]
    t0 = min(starts) if starts else 0.0
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(timeline) + 1.4))
    shown = 0
    for k, stage in enumerate(timeline):
        for kind, m, start, end in stage[:max_actions]:
            x, w = (start - t0) * 1e3, (end - start) * 1e3
            ax.broken_barh([(x, w)], (k - 0.4, 0.8), facecolors=_COLOURS.get(kind, "grey"), edgecolor="white",
                           linewidth=0.3)
            if len(stage[:max_actions]) <= 64:
                ax.text(x + w / 2, k, str(m), ha="center", va="center", fontsize=6, color="white")
        shown = max(shown, min(len(stage), max_actions))
    ax.set_yticks(range(len(timeline)), [f"stage {k}" for k in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title + (f" (first {shown} actions per stage)" if any(len(s) > max_actions for s in timeline) else ""))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    ax.legend(handles, ["forward", "backward"], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
