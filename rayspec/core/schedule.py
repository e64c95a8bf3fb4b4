"""Pipeline schedules as data: per-stage action lists, a validator, a grid printer and SpecTrain's version differences.

Nothing here imports torch or Ray. A schedule is, for each stage, the ordered list of
actions ``F(m)`` (forward of micro-batch ``m``) and ``B(m)`` (its backward); a ``B`` whose
``update`` flag is set is followed by one optimizer step on that stage.

1F1B on 4 stages, 6 micro-batches (one time slot per action)::

    stage 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 .  B3 .  B4 .  B5
    stage 1 |    F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5
    stage 2 |       F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 .  B5
    stage 3 |          F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5

Version differences ``s`` for SpecTrain come from simulating each stage's version counter
over the schedule (docs/design.md §2), never from closed forms, so they stay right while the
pipeline fills and drains and for any schedule added later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from rayspec.core.methods import VARIANTS, method
from rayspec.errors import RayspecError

__all__ = ["ActionKind", "Action", "Schedule", "ScheduleError", "build_schedule", "SCHEDULES"]

SCHEDULES = ("vanilla", "gpipe", "1f1b")


class ScheduleError(RayspecError):
    """A schedule that cannot run: missing or repeated actions, a deadlock, a bad argument."""


class ActionKind(str, Enum):
    """What an action runs: a forward ``F``, a backward ``B``, or the last stage's fused ``FB`` (its forward
    directly followed by its own backward, one call fewer on the critical path).

    Members compare and hash equal to their letters, so ``(stage, "F", m)`` keys find ``ActionKind.F``.
    """

    F = "F"
    B = "B"
    FB = "FB"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True)
class Action:
    """One step of one stage: ``F`` or ``B`` of a micro-batch; ``update`` marks an optimizer step after a ``B``."""

    stage: int
    kind: ActionKind
    microbatch: int
    update: bool = False

    @property
    def key(self) -> tuple[int, str, int]:
        return (self.stage, self.kind, self.microbatch)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered actions of one pipeline segment (filled and drained once).

    Attributes:
        name: one of ``SCHEDULES``.
        stages: number of pipeline stages ``N``.
        microbatches: micro-batches in the segment.
        group: micro-batches accumulated per optimizer update.
        actions: ``actions[k]`` is stage ``k``'s ordered list.
    """

    name: str
    stages: int
    microbatches: int
    group: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def updates(self) -> int:
        return self.microbatches // self.group

    def validate(self) -> None:
        """Raise ``ScheduleError`` unless every stage runs each F and B once, F before B, and nothing deadlocks."""
        if len(self.actions) != self.stages:
            raise ScheduleError(f"schedule has {len(self.actions)} stage lists for stages={self.stages}")
        expected = {(kind, m) for kind in "FB" for m in range(self.microbatches)}
        for k, acts in enumerate(self.actions):
            seen = [(a.kind, a.microbatch) for a in acts]
            if len(seen) != len(set(seen)) or set(seen) != expected:
                raise ScheduleError(f"stage {k} must run F and B of micro-batches 0..{self.microbatches - 1} exactly once")
            if any(a.stage != k for a in acts):
                raise ScheduleError(f"stage {k}'s list holds actions of another stage")
            done_f: set[int] = set()
            pending = 0
            for a in acts:
                if a.kind == "F":
                    done_f.add(a.microbatch)
                    if a.update:
                        raise ScheduleError(f"stage {k}: update flag on forward {a}")
                else:
                    if a.microbatch not in done_f:
                        raise ScheduleError(f"stage {k}: {a} runs before F{a.microbatch}")
                    pending += 1
                    if a.update:
                        if pending != self.group:
                            raise ScheduleError(
                                f"stage {k}: update after {pending} backwards, expected group={self.group}"
                            )
                        pending = 0
            if pending:
                raise ScheduleError(f"stage {k}: {pending} backwards accumulated but never applied")
        self.timeline()  # raises on deadlock

    def timeline(self, durations: Mapping[str, float] | None = None) -> dict[tuple[int, str, int], tuple[float, float]]:
        """Start and end of every action when each starts as soon as its stage is free and its input has arrived.

        Args:
            durations: time of an ``F`` and a ``B`` (default one slot each); either a mapping
                ``kind -> t`` or ``(stage, kind) -> t``.

        Raises:
            ScheduleError: if the per-stage orders deadlock.
        """
        durations = durations or {"F": 1.0, "B": 1.0}

        def duration(a: Action) -> float:
            return durations.get((a.stage, a.kind), durations.get(a.kind, 1.0))  # type: ignore[call-overload]

        times: dict[tuple[int, str, int], tuple[float, float]] = {}
        free = [0.0] * self.stages
        pos = [0] * self.stages
        last = self.stages - 1
        remaining = sum(len(acts) for acts in self.actions)
        while remaining:
            progressed = False
            for k in range(self.stages):
                while pos[k] < len(self.actions[k]):
                    a = self.actions[k][pos[k]]
                    dep = _dependency(a, last)
                    if dep is not None and dep not in times:
                        break
                    ready = times[dep][1] if dep is not None else 0.0
                    start = max(free[k], ready)
                    times[a.key] = (start, start + duration(a))
                    free[k] = start + duration(a)
                    pos[k] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                stuck = [str(self.actions[k][pos[k]]) for k in range(self.stages) if pos[k] < len(self.actions[k])]
                raise ScheduleError(f"schedule deadlocks; next actions per stage: {stuck}")
        return times

    def order(self) -> list[Action]:
        """All actions in a valid global order: by start time on the unit timeline, then by stage."""
        times = self.timeline()
        flat = [a for acts in self.actions for a in acts]
        return sorted(flat, key=lambda a: (times[a.key][0], a.stage))

    def makespan(self, durations: Mapping[str, float] | None = None) -> float:
        """Ideal time of the whole segment under the given action durations."""
        return max(end for _, end in self.timeline(durations).values())

    def versions(self, start: int = 0) -> dict[tuple[int, str, int], int]:
        """Version (updates applied so far) each stage holds when it runs each action."""
        held: dict[tuple[int, str, int], int] = {}
        for acts in self.actions:
            v = start
            for a in acts:
                held[a.key] = v
                if a.update:
                    v += 1
        return held

    def max_in_flight(self, stage: int = 0) -> int:
        """Largest number of micro-batches between their F and B on ``stage``."""
        live = peak = 0
        for a in self.actions[stage]:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        return peak

    def is_synchronous(self) -> bool:
        """True when every stage holds the same version at ``F(m)`` and ``B(m)``: no staleness at all."""
        v = self.versions()
        return all(v[(k, "F", m)] == v[(k, "B", m)] for k in range(self.stages) for m in range(self.microbatches))

    def differences(self, method_name: str, variant: str) -> dict[tuple[int, str, int], int] | None:
        """``version_differences(variant)`` for a method that predicts (SpecTrain); ``None`` for the others."""
        return self.version_differences(variant) if method(method_name).predicts else None

    def version_differences(self, variant: str) -> dict[tuple[int, str, int], int]:
        """SpecTrain's ``s`` for every action: how many versions ahead its weights are predicted.

        ``consistent``: the version the stage will hold at its own ``B(m)``.
        ``paper``: the number of updates the stage has completed when ``B(m)`` starts on stage 1
        (stage 0 when there is one stage), on the unit timeline (docs/design.md §2).
        A synchronous schedule (``vanilla``, ``gpipe``) has no staleness, so ``s = 0`` for both.
        """
        if variant not in VARIANTS:
            raise ScheduleError(f"variant={variant!r} is unknown; choose one of {', '.join(VARIANTS)}")
        held = self.versions()
        if self.is_synchronous():
            return {key: 0 for key in held}
        if variant == "consistent":
            return {
                (k, kind, m): held[(k, "B", m)] - v if kind == "F" else 0 for (k, kind, m), v in held.items()
            }
        times = self.timeline()
        ref = 1 if self.stages > 1 else 0
        # Update end times per stage, ascending; the target counts those finished by the reference start.
        update_ends = [
            sorted(times[a.key][1] for a in acts if a.update) for acts in self.actions
        ]
        s: dict[tuple[int, str, int], int] = {}
        for (k, kind, m), v in held.items():
            t_ref = times[(ref, "B", m)][0]
            target = _count_le(update_ends[k], t_ref)
            s[(k, kind, m)] = max(0, target - v)
        return s

    def grid(self, s: Mapping[tuple[int, str, int], int] | None = None) -> str:
        """A stage × time-slot grid of the unit timeline; with ``s``, each cell reads ``F5+3`` (predicted 3 ahead)."""
        times = self.timeline()
        span = int(max(end for _, end in times.values()))
        cells = [["." for _ in range(span)] for _ in range(self.stages)]
        for acts in self.actions:
            for a in acts:
                text = str(a) + ("*" if a.update and self.group > 1 else "")
                if s is not None:
                    text += f"+{s[a.key]}"
                cells[a.stage][int(times[a.key][0])] = text
        width = max(len(c) for row in cells for c in row)
        header = f"{self.name}: {self.stages} stages, {self.microbatches} micro-batches, update every {self.group}"
        lines = [header]
        for k, row in enumerate(cells):
            lines.append(f"stage {k} | " + " ".join(c.ljust(width) for c in row).rstrip())
        return "\n".join(lines)


def _dependency(a: Action, last: int) -> tuple[int, str, int] | None:
    if a.kind == "F":
        return (a.stage - 1, "F", a.microbatch) if a.stage > 0 else None
    if a.stage < last:
        return (a.stage + 1, "B", a.microbatch)
    return (a.stage, "F", a.microbatch)


def _count_le(sorted_values: list[float], t: float) -> int:
    n = 0
    for x in sorted_values:
        if x <= t:
            n += 1
        else:
            break
    return n


def build_schedule(name: str, stages: int, microbatches: int, *, group: int | None = None) -> Schedule:
    """Build and validate a schedule.

    Args:
        name: ``vanilla`` (one micro-batch through all stages at a time), ``gpipe`` (fill-drain,
            flush after each group) or ``1f1b`` (PipeDream's asynchronous one-forward-one-backward).
        stages: pipeline stages ``N >= 1``.
        microbatches: micro-batches in the segment.
        group: micro-batches per optimizer update; default ``microbatches`` for ``gpipe``
            (one flush), 1 otherwise. Must divide ``microbatches``.

    Raises:
        ScheduleError: on an unknown name or impossible sizes.
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule={name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    if not isinstance(stages, int) or stages < 1:
        raise ScheduleError(f"stages={stages!r} must be an integer >= 1")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"microbatches={microbatches!r} must be an integer >= 1")
    if group is None:
        group = microbatches if name == "gpipe" else 1
    if not isinstance(group, int) or group < 1 or microbatches % group:
        raise ScheduleError(f"group={group!r} must be >= 1 and divide microbatches={microbatches}")

    F = ActionKind.F

    def b(k: int, m: int) -> Action:
        return Action(k, ActionKind.B, m, update=(m + 1) % group == 0)

    actions: list[tuple[Action, ...]] = []
    for k in range(stages):
        acts: list[Action] = []
        if name == "vanilla":
            for m in range(microbatches):
                acts += [Action(k, F, m), b(k, m)]
        elif name == "gpipe":
            for g0 in range(0, microbatches, group):
                acts += [Action(k, F, m) for m in range(g0, g0 + group)]
                acts += [b(k, m) for m in range(g0, g0 + group)]
        else:  # 1f1b: N-k-1 warm-up forwards, then one forward and one backward, then drain
            warm = min(stages - k - 1, microbatches)
            acts += [Action(k, F, m) for m in range(warm)]
            for m in range(microbatches):
                if m + warm < microbatches:
                    acts.append(Action(k, F, m + warm))
                acts.append(b(k, m))
        actions.append(tuple(acts))
    schedule = Schedule(name, stages, microbatches, group, tuple(actions))
    schedule.validate()
    return schedule

