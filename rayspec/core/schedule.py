"""Pipeline schedules as data: per-stage action lists, a validator, a grid printer and SpecTrain's version differences.

Nothing here imports torch or Ray. A schedule is, for each stage, the ordered list of
actions ``F(m)`` (forward of micro-batch ``m``) and ``B(m)`` (its backward), or with the backward
split (zero bubble) ``I(m)`` (input gradient) and ``W(m)`` (weight gradient); a ``B`` or ``W`` whose
``update`` flag is set is followed by one optimizer step on that stage. With ``virtual`` chunks per
rank, stage ``s`` runs on rank ``s % ranks`` and ``rank_actions`` gives each rank's order across
its stages. The orders themselves come from ``rayspec.core.orders``.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from rayspec.core.methods import VARIANTS, method
from rayspec.core.orders import Step, order
from rayspec.core.simulate import simulate
from rayspec.errors import RayspecError, unknown

__all__ = ["ActionKind", "Action", "Schedule", "ScheduleError", "build_schedule", "SCHEDULES", "FLUSHED",
           "EQUAL_FIW"]

SCHEDULES = ("vanilla", "gpipe", "1f1b", "1f1b-flushed", "zb1p", "interleaved")
FLUSHED = ("gpipe", "1f1b-flushed", "zb1p", "interleaved")
"""Schedules that fill and drain once per update: one group is the whole batch by default."""
EQUAL_FIW = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
"""Action durations with F, I and W equal (B = I + W): the durations the bubble formulas assume."""


class ScheduleError(RayspecError):
    """A schedule that cannot run: missing or repeated actions, a deadlock, a bad argument."""


class ActionKind(str, Enum):
    """What an action runs: a forward ``F``, a backward ``B``, the backward's input-gradient part ``I`` and its
    weight-gradient part ``W`` (zero bubble; ``I`` + ``W`` = ``B``), or the last stage's fused ``FB`` (its
    forward directly followed by its own backward, one call fewer on the critical path).

    Members compare and hash equal to their letters, so ``(stage, "F", m)`` keys find ``ActionKind.F``.
    """

    F = "F"
    B = "B"
    FB = "FB"
    I = "I"  # noqa: E741 - torch's letter for the input gradient
    W = "W"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def runs_backward(self) -> bool:
        """Whether it computes the input gradient (``B``, ``FB``, ``I``): what the previous stage waits for."""
        return self in (ActionKind.B, ActionKind.FB, ActionKind.I)

    @property
    def completes_gradient(self) -> bool:
        """Whether the micro-batch's weight gradient is complete after it (``B``, ``FB``, ``W``): updates follow it."""
        return self in (ActionKind.B, ActionKind.FB, ActionKind.W)


@dataclass(frozen=True)
class Action:
    """One step of one stage: ``F``, ``B``, ``I`` or ``W`` of a micro-batch; ``update`` marks an optimizer step
    after a ``B`` or ``W``."""

    stage: int
    kind: ActionKind
    microbatch: int
    update: bool = False

    @property
    def key(self) -> tuple[int, str, int]:
        return (self.stage, self.kind, self.microbatch)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    @property
    def text(self) -> str:
        """torch's text form ``{stage}{kind}{micro-batch}``: ``2F0``, ``1I3``, ``0W5``."""
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered actions of one pipeline segment (filled and drained once).

    Attributes:
        name: one of ``SCHEDULES``, or where it came from (a CSV file).
        stages: number of pipeline stages (model chunks), ``ranks * virtual``.
        microbatches: micro-batches in the segment.
        group: micro-batches accumulated per optimizer update.
        actions: ``actions[k]`` is stage ``k``'s ordered list.
        virtual: stages per rank; stage ``s`` runs on rank ``s % ranks``.
        rank_order: each rank's ordered actions across its stages; None: one stage per rank (``actions``).
    """

    name: str
    stages: int
    microbatches: int
    group: int
    actions: tuple[tuple[Action, ...], ...]
    virtual: int = 1
    rank_order: tuple[tuple[Action, ...], ...] | None = None

    @property
    def updates(self) -> int:
        return self.microbatches // self.group

    @property
    def ranks(self) -> int:
        """Ranks (stage actors) the stages run on: ``stages / virtual``."""
        return self.stages // self.virtual

    @property
    def rank_actions(self) -> tuple[tuple[Action, ...], ...]:
        """Each rank's ordered actions (its stages' lists merged in the order the rank runs them)."""
        return self.actions if self.rank_order is None else self.rank_order

    @property
    def splits_backward(self) -> bool:  # the backward runs as I and W (zero bubble) somewhere
        return any(a.kind == "I" for acts in self.actions for a in acts)

    @classmethod
    def from_steps(cls, name: str, steps: Sequence[Sequence[Step | Action]], microbatches: int, group: int,
                   virtual: int = 1) -> Schedule:
        """The schedule whose rank ``r`` runs ``steps[r]`` (``(stage, kind, m)`` or ``Action``) in order, with an
        update after each stage's ``group``-th completed gradient; validated."""
        ranks = len(steps)
        count = [0] * (ranks * virtual)
        rows: list[tuple[Action, ...]] = []
        for row in steps:
            out = []
            for step in row:
                k, kind, m = (step.stage, step.kind, step.microbatch) if isinstance(step, Action) else step
                if not 0 <= k < ranks * virtual:
                    raise ScheduleError(f"action {k}{kind}{m} names stage {k}; stages are 0..{ranks * virtual - 1}")
                kind = ActionKind(kind)
                update = False
                if kind.completes_gradient:
                    count[k] += 1
                    update = count[k] % group == 0
                out.append(Action(k, kind, m, update))
            rows.append(tuple(out))
        per_stage = tuple(tuple(a for row in rows for a in row if a.stage == k) for k in range(ranks * virtual))
        schedule = cls(name, ranks * virtual, microbatches, group, per_stage, virtual,
                       None if virtual == 1 else tuple(rows))
        schedule.validate()
        return schedule

    def validate(self) -> None:
        """Raise ``ScheduleError`` unless every stage runs each F once and B once (or I and then W once), F before
        B or I, every rank only its own stages, and nothing deadlocks."""
        if len(self.actions) != self.stages or self.stages % self.virtual:
            raise ScheduleError(f"schedule has {len(self.actions)} stage lists for stages={self.stages}, "
                                f"virtual={self.virtual}")
        for r, acts in enumerate(self.rank_actions):
            if any(a.stage % self.ranks != r for a in acts):
                raise ScheduleError(f"rank {r}'s list holds stages of another rank (stage s runs on rank s % "
                                    f"{self.ranks})")
        for k, acts in enumerate(self.actions):
            seen = [(a.kind, a.microbatch) for a in acts]
            split = {m for kind, m in seen if kind == "I"}
            expected = {(kind, m) for m in range(self.microbatches)
                        for kind in (("F", "I", "W") if m in split else ("F", "B"))}
            if len(seen) != len(set(seen)) or set(seen) != expected:
                raise ScheduleError(f"stage {k} must run F and B (or I and W) of micro-batches "
                                    f"0..{self.microbatches - 1} exactly once")
            if any(a.stage != k for a in acts):
                raise ScheduleError(f"stage {k}'s list holds actions of another stage")
            done: set[tuple[str, int]] = set()
            pending = 0
            for a in acts:
                before = {"F": None, "B": "F", "I": "F", "W": "I"}[a.kind]
                if before is not None and (before, a.microbatch) not in done:
                    raise ScheduleError(f"stage {k}: {a} runs before {before}{a.microbatch}")
                done.add((a.kind, a.microbatch))
                if a.update and not ActionKind(a.kind).completes_gradient:
                    raise ScheduleError(f"stage {k}: update flag on {a}")
                if ActionKind(a.kind).completes_gradient:
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

    def timeline(self, durations: Mapping | None = None, link: float | Mapping[int, float] = 0.0
                 ) -> dict[tuple[int, str, int], tuple[float, float]]:
        """Start and end of every action when each starts as soon as its rank is free and its input has arrived
        (``rayspec.core.simulate``).

        Args:
            durations: time of each kind (default one slot each); a mapping ``kind -> t`` or
                ``(stage, kind) -> t`` (``EQUAL_FIW``: F, I and W one unit each, B two); ``step`` (or
                ``(stage, "step")``), default 0, is added to each action followed by an update.
            link: time an input takes between ranks (an activation forward, a gradient back; on the same rank
                none): one figure, or per boundary ``b`` between stages ``b`` and ``b + 1``. Default 0.

        Raises:
            ScheduleError: if the per-rank orders deadlock.
        """
        times, stuck = simulate(self.rank_actions, self.stages, durations or {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0},
                                link)
        if stuck:
            raise ScheduleError(f"schedule deadlocks; next actions per rank: {stuck}")
        return times

    def order(self) -> list[Action]:
        """All actions in a valid global order: by start time on the unit timeline, then by stage."""
        times = self.timeline()
        flat = [a for acts in self.actions for a in acts]
        return sorted(flat, key=lambda a: (times[a.key][0], a.stage))

    def makespan(self, durations: Mapping | None = None, link: float | Mapping[int, float] = 0.0) -> float:
        """Ideal time of the whole segment under the given action durations (and link cost, see ``timeline``)."""
        return max(end for _, end in self.timeline(durations, link).values())

    def bubble(self, durations: Mapping | None = None) -> float:
        """Idle over busy time of the ranks on the simulated timeline (default ``EQUAL_FIW``): what
        ``rayspec.core.orders.bubble_formula`` predicts."""
        times = self.timeline(durations or EQUAL_FIW)
        busy = sum(end - start for start, end in times.values())
        return (self.makespan(durations or EQUAL_FIW) * self.ranks - busy) / busy

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
        """Largest number of micro-batches between their F and their completed gradient (B or W) on ``stage``."""
        live = peak = 0
        for a in self.actions[stage]:
            live += 1 if a.kind == "F" else -1 if ActionKind(a.kind).completes_gradient else 0
            peak = max(peak, live)
        return peak

    def is_synchronous(self) -> bool:
        """True when every stage holds the same version at ``F(m)`` and at its backward actions: no staleness."""
        v = self.versions()
        return all(held == v[(k, "F", m)] for (k, _, m), held in v.items())

    def differences(self, method_name: str, variant: str) -> dict[tuple[int, str, int], int] | None:
        """``version_differences(variant)`` for a method that predicts (SpecTrain; 2BW's always ``consistent``)."""
        m = method(method_name)
        return self.version_differences("consistent" if m.policy == "predict-2bw" else variant) if m.predicts else None

    def version_differences(self, variant: str) -> dict[tuple[int, str, int], int]:
        """SpecTrain's ``s`` for every action: how many versions ahead its weights are predicted.

        ``consistent``: the version the stage will hold at its own ``B(m)``.
        ``paper``: the number of updates the stage has completed when ``B(m)`` starts on stage 1
        (stage 0 when there is one stage), on the unit timeline (docs/design.md §2).
        A synchronous schedule (``vanilla``, ``gpipe``) has no staleness, so ``s = 0`` for both.
        """
        if variant not in VARIANTS:
            raise unknown("variant", variant, VARIANTS)
        held = self.versions()
        if self.is_synchronous():
            return {key: 0 for key in held}
        if self.virtual > 1 or self.splits_backward:
            raise ScheduleError(f"the {self.name} schedule has staleness but SpecTrain's version differences are "
                                "defined for F and B on one stage per rank only")
        if variant == "consistent":
            return {(k, kind, m): held[(k, "B", m)] - v if kind == "F" else 0 for (k, kind, m), v in held.items()}
        times = self.timeline()
        ref = 1 if self.stages > 1 else 0
        # Update end times per stage, ascending; the target counts those finished by the reference start.
        update_ends = [sorted(times[a.key][1] for a in acts if a.update) for acts in self.actions]
        s: dict[tuple[int, str, int], int] = {}
        for (k, kind, m), v in held.items():
            t_ref = times[(ref, "B", m)][0]
            target = _count_le(update_ends[k], t_ref)
            s[(k, kind, m)] = max(0, target - v)
        return s

    def grid(self, s: Mapping[tuple[int, str, int], int] | None = None) -> str:
        """A rank × time-slot grid of the unit timeline; with ``s``, each cell reads ``F5+3`` (predicted 3 ahead).
        With virtual stages each cell names its stage (torch's ``4F0``)."""
        times = self.timeline()
        span = int(max(end for _, end in times.values()))
        rows = self.rank_actions
        cells = [["." for _ in range(span)] for _ in rows]
        for r, acts in enumerate(rows):
            for a in acts:
                text = (a.text if self.virtual > 1 else str(a)) + ("*" if a.update and self.group > 1 else "")
                if s is not None:
                    text += f"+{s[a.key]}"
                cells[r][int(times[a.key][0])] = text
        width = max(len(c) for row in cells for c in row)
        header = f"{self.name}: {self.stages} stages, {self.microbatches} micro-batches, update every {self.group}"
        if self.virtual > 1:
            header += f", {self.virtual} stages per rank"
        lines = [header]
        for k, row in enumerate(cells):
            lines.append(f"{'rank' if self.virtual > 1 else 'stage'} {k} | " + " ".join(c.ljust(width) for c in row).rstrip())
        return "\n".join(lines)


def _count_le(sorted_values: list[float], t: float) -> int:
    return next((i for i, x in enumerate(sorted_values) if x > t), len(sorted_values))


def build_schedule(name: str, stages: int, microbatches: int, *, group: int | None = None,
                   virtual: int = 1) -> Schedule:
    """Build and validate a schedule (the orders are ``rayspec.core.orders``'s).

    Args:
        name: ``vanilla`` (one micro-batch through all stages at a time), ``gpipe`` (fill-drain,
            flush after each group), ``1f1b`` (PipeDream's asynchronous one-forward-one-backward),
            ``1f1b-flushed`` (synchronous 1F1B, a flush per group), ``zb1p`` (ZB-H1: B split into I and W,
            W deferred into the bubble) or ``interleaved`` (interleaved 1F1B over ``virtual`` chunks per rank).
        stages: pipeline ranks ``N >= 1`` (stage actors); the schedule has ``N * virtual`` stages.
        microbatches: micro-batches in the segment.
        group: micro-batches per optimizer update; default ``microbatches`` for the flushed schedules
            (``FLUSHED``: one flush), 1 otherwise. Must divide ``microbatches``.
        virtual: model chunks per rank (``interleaved`` only).

    Raises:
        ConfigError: on an unknown name.
        ScheduleError: on impossible sizes.
    """
    if name not in SCHEDULES:
        raise unknown("schedule", name, SCHEDULES)
    if not isinstance(stages, int) or stages < 1:
        raise ScheduleError(f"stages={stages!r} must be an integer >= 1")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"microbatches={microbatches!r} must be an integer >= 1")
    if group is None:
        group = microbatches if name in FLUSHED else 1
    if not isinstance(group, int) or group < 1 or microbatches % group:
        raise ScheduleError(f"group={group!r} must be >= 1 and divide microbatches={microbatches}")
    if not isinstance(virtual, int) or virtual < 1 or (virtual > 1 and name != "interleaved"):
        raise ScheduleError(f"virtual={virtual!r} chunks per rank: only the interleaved schedule takes more than 1")
    if name == "interleaved" and group % stages:
        raise ScheduleError(f"interleaved 1F1B runs micro-batches in rounds of stages={stages}, but a batch has "
                            f"{group}; make pipeline.microbatches a multiple of {stages}")
    steps = [order(name, stages, r, microbatches, group, virtual) for r in range(stages)]
    return Schedule.from_steps(name, steps, microbatches, group, virtual)
