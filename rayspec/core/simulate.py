"""The event simulation behind ``Schedule.timeline``: each action starts once its rank is free and its input is there.

An input made on another rank arrives a link's seconds after the action that made it ended (a forward's activation
to the next stage, a backward's input gradient to the previous one); one made on the same rank (a stage's own F
before its B, I before W, or a neighbouring chunk of an interleaved rank) is there at once. With no link cost and no
step cost this is the unit-slot simulation the schedules are validated with. Nothing here imports torch or Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__: list[str] = []

Key = tuple[int, str, int]


def simulate(rows: Sequence[Sequence[Any]], stages: int, durations: Mapping, link: float | Mapping[int, float] = 0.0
             ) -> tuple[dict[Key, tuple[float, float]], list[str]]:
    """Start and end of every action of ``rows`` (each rank's ordered ``Action``s), and the next action of every rank
    that could not start (empty unless the orders deadlock).

    Args:
        stages: the schedule's stages; stage ``s`` runs on rank ``s % len(rows)``.
        durations: seconds per ``kind`` or ``(stage, kind)``; ``step`` (or ``(stage, "step")``, default 0) is added
            to an action whose ``update`` flag is set: the optimizer step that follows it on its rank.
        link: seconds an input takes from one rank to another: one figure, or one per boundary ``b`` (between
            stages ``b`` and ``b + 1``; a boundary not named costs nothing).
    """
    ranks = len(rows)
    keys = {a.key for acts in rows for a in acts}

    def duration(a: Any) -> float:
        own = durations.get((a.stage, a.kind), durations.get(a.kind, 1.0))
        return own + (durations.get((a.stage, "step"), durations.get("step", 0.0)) if a.update else 0.0)

    def hop(a: Any, dep: Key) -> float:
        if dep[0] % ranks == a.stage % ranks:
            return 0.0
        return float(link) if isinstance(link, (int, float)) else link.get(min(a.stage, dep[0]), 0.0)

    times: dict[Key, tuple[float, float]] = {}
    free = [0.0] * ranks
    pos = [0] * ranks
    remaining = sum(len(acts) for acts in rows)
    while remaining:
        progressed = False
        for r, acts in enumerate(rows):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                dep = dependency(a, stages - 1, keys)
                if dep is not None and dep not in times:
                    break
                ready = times[dep][1] + hop(a, dep) if dep is not None else 0.0
                start = max(free[r], ready)
                times[a.key] = (start, start + duration(a))
                free[r] = times[a.key][1]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            return times, [acts[pos[r]].text for r, acts in enumerate(rows) if pos[r] < len(acts)]
    return times, []


def dependency(a: Any, last: int, keys: set) -> Key | None:
    """The action whose output ``a`` needs: the previous stage's F, the next stage's B or I, or its own F or I."""
    if a.kind == "F":
        return (a.stage - 1, "F", a.microbatch) if a.stage > 0 else None
    if a.kind == "W":
        return (a.stage, "I", a.microbatch)
    if a.stage < last:
        after = (a.stage + 1, "B", a.microbatch)
        return after if after in keys else (a.stage + 1, "I", a.microbatch)
    return (a.stage, "F", a.microbatch)
