"""The ``compiled`` transport's plan: a segment cut into chunks of one shape, one compiled graph for them all.

An actor call per action costs Ray a task submission, an object-store round and a result store
(about 2 ms a hop on a 2-core CPU box, ``benchmarks.hops``); a compiled graph moves the same
tensors over pre-allocated channels (shared memory on a node) with no task per action. The
graph is static, so a segment is cut into *chunks* that all have the same shape and one graph
runs every chunk, with ``m = base + offset``; actions whose ``m`` falls outside the segment
are masked (the op is skipped), which is how the pipeline fills and drains.

[Note: chunks of 1F1B] Asynchronous 1F1B never flushes, so a value crosses from one chunk to the
next. Each stage's chunk pairs ``B(base+j-1), F(base+j+warm)`` (the last stage: fused
``FB(base+j)``), so what crosses is always the producer's *last* op of the chunk: the stage keeps
it (the carry) and hands it on in the next chunk's first op (``begin``), right after it was made.
Two stages, chunk P = 3, stage 0 warms up with 1 forward (chunk base -3 masks the rest)::

    chunk -3: stage 0 | .  .  .  .  .  F0 |   stage 1 | .   .   .
    chunk  0: stage 0 | .  F1 B0 F2 B1 F3 |   stage 1 | FB0 FB1 FB2     (F3 -> carry -> chunk 3)
    chunk  3: stage 0 | B2 F4 B3 F5 B4 .  |   stage 1 | FB3 FB4 FB5     (FB2's gradient: carry)

Flushed schedules (``gpipe``, ``vanilla``, any schedule that drains at every update) repeat one
block of ``group`` micro-batches; a chunk is several blocks and nothing crosses.

Per stage, the ops run in exactly the segment schedule's order (``plan_chunks`` checks it), so
the transport (``rayspec.exec.ray.compiled``) computes what ``LocalExecutor`` computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rayspec.core.schedule import ActionKind, Schedule, ScheduleError

__all__ = ["TemplateOp", "ChunkPlan", "plan_chunks"]

# One op of the chunk template: kind ("F", "B", "FB"), the micro-batch offset from the chunk's base,
# its data source ("op", stage, index) | ("begin", stage) | None, and whether it becomes the carry.
Source = tuple | None


@dataclass(frozen=True)
class TemplateOp:
    kind: ActionKind
    offset: int
    source: Source
    carry: bool = False


@dataclass(frozen=True)
class ChunkPlan:
    """A segment as chunks of one shape.

    Attributes:
        template: per stage, the ops of every chunk (the compiled graph's shape).
        bases: the base micro-batch of each chunk, in order.
        params: ``params[c][k][i]`` is ``(m, s, s_b, update)`` of op ``i`` of stage ``k`` in chunk ``c``,
            or ``None`` where the op is masked.
    """

    template: tuple[tuple[TemplateOp, ...], ...]
    bases: tuple[int, ...]
    params: tuple[tuple[tuple[tuple[int, int, int, bool] | None, ...], ...], ...]


def _flushed_block(schedule: Schedule) -> bool:
    """Whether every stage's list is its first ``group`` micro-batches' list repeated, shifted by ``group``."""
    g = schedule.group
    for acts in schedule.actions:
        per = 2 * g
        if len(acts) % per:
            return False
        first = [(a.kind, a.microbatch, a.update) for a in acts[:per]]
        if any(m >= g for _, m, _ in first):
            return False
        for b in range(len(acts) // per):
            block = [(a.kind, a.microbatch - b * g, a.update) for a in acts[b * per:(b + 1) * per]]
            if block != first:
                return False
    return True


def _fuse_last(kinds: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """The last stage's ``F(m) B(m)`` pairs as one ``FB(m)``."""
    out: list[tuple[str, int]] = []
    for kind, off in kinds:
        if kind == "B" and out and out[-1] == ("F", off):
            out[-1] = ("FB", off)
        else:
            out.append((kind, off))
    return out


def _shape(schedule: Schedule, chunk: int) -> tuple[list[list[tuple[str, int]]], int, int]:
    """Per stage ``(kind, offset)`` ops of a chunk, the chunk's width in micro-batches and the first base."""
    n, last = schedule.stages, schedule.stages - 1
    if _flushed_block(schedule):
        g = schedule.group
        width = g * max(1, chunk // g)
        ops = []
        for k in range(n):
            one: list[tuple[str, int]] = [(a.kind, a.microbatch) for a in schedule.actions[k][: 2 * g]]
            kinds = [(kind, off + b * g) for b in range(width // g) for kind, off in one]
            ops.append(_fuse_last(kinds) if k == last else kinds)
        return ops, width, 0
    if schedule.name == "1f1b":
        width = max(1, chunk)
        ops = []
        for k in range(n):
            warm = n - k - 1
            if k == last:
                ops.append([("FB", j) for j in range(width)])
            else:
                ops.append([op for j in range(width) for op in (("B", j - 1), ("F", j + warm))])
        return ops, width, -width * -(-(n - 1) // width)  # enough masked chunks first to warm up
    raise ScheduleError(
        f"the compiled data path runs 1f1b and schedules that flush at every update; {schedule.name} "
        f"(group {schedule.group}) is neither: use pipeline.transport=object_store"
    )


def plan_chunks(schedule: Schedule, s: dict | None, chunk: int = 16) -> ChunkPlan:
    """Cut ``schedule`` into chunks of one shape (about ``chunk`` micro-batches each).

    Args:
        s: SpecTrain's version differences per action (``Schedule.version_differences``), or ``None``.

    Raises:
        ScheduleError: if the schedule has no such shape, or the chunks would not replay it exactly.
    """
    n, last, count = schedule.stages, schedule.stages - 1, schedule.microbatches
    ops, width, first = _shape(schedule, chunk)
    where = {(k, kind, off): i for k in range(n) for i, (kind, off) in enumerate(ops[k])}

    def producer(k: int, kind: str, off: int) -> Source:
        """The op that feeds ``kind(off)`` on stage ``k``: in this chunk, or the carry of the last chunk."""
        if kind != "B" and k == 0 or kind == "B" and k == last:
            return None
        src_k = k - 1 if kind in ("F", "FB") else k + 1
        src_kinds = ("F",) if kind in ("F", "FB") else ("B", "FB")
        for sk in src_kinds:
            if (src_k, sk, off) in where:
                return ("op", src_k, where[(src_k, sk, off)])
        for sk in src_kinds:
            i = where.get((src_k, sk, off + width))
            if i is not None and i == len(ops[src_k]) - 1:
                return ("begin", src_k)
        raise ScheduleError(f"stage {k}'s {kind}(base+{off}) has no producer one chunk apart at most")

    sources = [[producer(k, kind, off) for kind, off in ops[k]] for k in range(n)]
    carried = {src[1] for row in sources for src in row if src is not None and src[0] == "begin"}
    template = [tuple(TemplateOp(ActionKind(kind), off, sources[k][i], carry=k in carried and i == len(ops[k]) - 1)
                      for i, (kind, off) in enumerate(ops[k])) for k in range(n)]
    updates = {a.key: a.update for acts in schedule.actions for a in acts}
    bases, params = [], []
    replay: list[list[tuple[str, int, bool]]] = [[] for _ in range(n)]
    base = first
    while base < count + width:
        chunk_params = []
        for k in range(n):
            row: list[tuple[int, int, int, bool] | None] = []
            for op in template[k]:
                m = base + op.offset
                if not 0 <= m < count:
                    row.append(None)
                    continue
                b_key = (k, "B", m)
                s_f = 0 if s is None or op.kind == "B" else s[(k, "F", m)]
                s_b = 0 if s is None or op.kind == "F" else s[b_key]
                row.append((m, s_f if op.kind != "B" else s_b, s_b, updates[b_key] if op.kind != "F" else False))
                replay[k] += ([("F", m, False)] if op.kind != "B" else []) + (
                    [("B", m, updates[b_key])] if op.kind != "F" else [])
            chunk_params.append(tuple(row))
        if any(p is not None for row in chunk_params for p in row):
            bases.append(base)
            params.append(tuple(chunk_params))
        base += width
    for k in range(n):
        if replay[k] != [(a.kind, a.microbatch, a.update) for a in schedule.actions[k]]:
            raise ScheduleError(f"chunks of {width} would not replay stage {k}'s order of the {schedule.name} schedule")
    return ChunkPlan(tuple(template), tuple(bases), tuple(params))
