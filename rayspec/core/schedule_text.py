"""Schedules as torch's text: actions ``2F0``/``1I3``/``0W5``, one CSV row per rank, checked as torch checks them.

A CSV that torch's ``_dump_csv`` writes for a compute-only schedule (empty cells where a rank idles) reads here,
and one written here reads in torch's ``_load_csv``. Stage ``s`` runs on rank ``s % ranks`` (torch's loop
placement); a file holds one batch, and ``load_schedule`` repeats it once per update. Errors show the
step × rank grid with the bad cell marked, as torch's ``_validate_schedule`` does.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence
from pathlib import Path

from rayspec.core.schedule import Action, ActionKind, Schedule, ScheduleError

__all__ = ["parse_action", "rows_of", "to_csv", "read_rows", "check_rows", "from_rows", "load_schedule",
           "repeat", "format_rows"]

_TEXT = re.compile(r"^(\d+)(F|I|B|W)(\d+)$")
Rows = list[list[Action | None]]


def parse_action(text: str) -> Action | None:
    """torch's text form of a compute action (``_Action.from_str``): ``2F0``, ``1B2``, ``1I3``, ``0W5``; an empty
    cell is None (the rank idles)."""
    if not text.strip():
        return None
    match = _TEXT.match(text.strip())
    if match is None:
        raise ScheduleError(f"action {text!r} is not {{stage}}{{F|I|B|W}}{{micro-batch}}, e.g. 2F0 or 1I3 "
                            "(rayspec reads compute-only schedules)")
    return Action(int(match[1]), ActionKind(match[2]), int(match[3]))


def rows_of(schedule: Schedule) -> Rows:
    """Each rank's actions on the unit timeline, None where it idles (torch's ``pipeline_order``)."""
    times = schedule.timeline()
    span = int(max(end for _, end in times.values()))
    rows: Rows = [[None] * span for _ in range(schedule.ranks)]
    for r, acts in enumerate(schedule.rank_actions):
        for a in acts:
            rows[r][int(times[a.key][0])] = a
    return rows


def to_csv(schedule: Schedule) -> str:
    """The schedule as torch's compute-only CSV: one row per rank, one cell per unit time slot."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows_of(schedule):
        writer.writerow(["" if a is None else a.text for a in row])
    return out.getvalue()


def read_rows(text: str) -> Rows:
    """The rows of a compute-only CSV (torch's ``_load_csv``)."""
    return [[parse_action(cell) for cell in row] for row in csv.reader(io.StringIO(text))]


def format_rows(rows: Sequence[Sequence[Action | None]], bad: tuple[int, int] | None = None) -> str:
    """torch's ``_format_pipeline_order``: a step × rank grid; ``bad = (rank, step)`` is marked ``>1I3<``."""
    steps = max((len(row) for row in rows), default=0)
    cells = [[("" if step >= len(row) or row[step] is None else row[step].text)  # type: ignore[union-attr]
              for step in range(steps)] for row in rows]
    if bad is not None and bad[1] < steps:
        cells[bad[0]][bad[1]] = f">{cells[bad[0]][bad[1]]}<"
    label = len(str(max(steps - 1, 0)))
    widths = [max([len(f"Rank {r}")] + [len(c) for c in row]) for r, row in enumerate(cells)]
    lines = [" " * (label + 7) + " ".join(f"Rank {r}".ljust(w) for r, w in enumerate(widths))]
    for step in range(steps):
        line = f"Step {str(step).zfill(label)}: " + " ".join(row[step].ljust(w) for row, w in zip(cells, widths))
        lines.append(line.rstrip() + (" <-- error here" if bad is not None and bad[1] == step else ""))
    return "\n".join(lines)


def check_rows(rows: Rows) -> tuple[int, int]:
    """Check the rows as torch's ``_validate_schedule`` does: every stage runs F once per micro-batch, B or I
    after its F, W after its I, the counts match, and stage ``s`` is on rank ``s % ranks``.

    Returns:
        ``(stages, microbatches)``.

    Raises:
        ScheduleError: naming the rank and step, with the grid and the bad cell marked.
    """
    ranks = len(rows)
    acts = [(r, step, a) for r, row in enumerate(rows) for step, a in enumerate(row) if a is not None]
    if not ranks or not acts:
        raise ScheduleError("the schedule is empty: give one CSV row of actions per rank")
    stages = max(a.stage for _, _, a in acts) + 1
    microbatches = max(a.microbatch for _, _, a in acts) + 1
    done: dict[tuple[int, str], set[int]] = {}

    def fail(r: int, step: int, why: str) -> ScheduleError:
        return ScheduleError(f"rank {r}, step {step}: {why}\n\n{format_rows(rows, (r, step))}")

    if stages % ranks:
        raise fail(*acts[-1][:2], f"{stages} stages do not split evenly over {ranks} ranks")
    for r, step, a in acts:
        if a.stage % ranks != r:
            raise fail(r, step, f"stage {a.stage} belongs on rank {a.stage % ranks} (stage s on rank s % {ranks})")
        seen = done.setdefault((a.stage, a.kind), set())
        if a.microbatch in seen:
            raise fail(r, step, f"{a.text} runs twice")
        need = {"F": None, "B": "F", "I": "F", "W": "I"}[a.kind]
        if need is not None and a.microbatch not in done.get((a.stage, need), set()):
            raise fail(r, step, f"{a.text} runs before {a.stage}{need}{a.microbatch}")
        seen.add(a.microbatch)
    for k in range(stages):
        count = {kind: len(done.get((k, kind), ())) for kind in "FBIW"}
        if count["F"] != microbatches or count["B"] + count["I"] != microbatches or count["W"] != count["I"]:
            r, step = max(((r, step) for r, step, a in acts if a.stage == k), key=lambda x: x[1], default=(k % ranks, 0))
            raise fail(r, step, f"stage {k} runs {count['F']} F, {count['B']} B, {count['I']} I and {count['W']} W; "
                                f"each of {microbatches} micro-batches needs one F and one B (or one I and one W)")
    return stages, microbatches


def from_rows(rows: Rows, name: str = "file") -> Schedule:
    """The schedule of one batch the rows describe (one update at its end), checked as torch checks it."""
    stages, microbatches = check_rows(rows)
    steps = [[a for a in row if a is not None] for row in rows]
    return Schedule.from_steps(name, steps, microbatches, microbatches, stages // len(rows))


def repeat(schedule: Schedule, batches: int) -> Schedule:
    """``batches`` copies of a one-batch schedule, one after the other, an update after each."""
    m = schedule.microbatches
    steps = [[(a.stage, a.kind, a.microbatch + b * m) for b in range(batches) for a in row]
             for row in schedule.rank_actions]
    return Schedule.from_steps(schedule.name, steps, m * batches, schedule.group, schedule.virtual)


def load_schedule(path: str | Path, batches: int = 1) -> Schedule:
    """The schedule in torch's compute-only CSV at ``path``, repeated for ``batches`` updates."""
    one = from_rows(read_rows(Path(path).read_text()), name=Path(path).name)
    return repeat(one, batches) if batches > 1 else one
