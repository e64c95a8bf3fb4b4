"""The ``p2p`` transport's plan: each stage's actions cut into chunks, one actor call each
(docs/design.md §4; the transport is ``rayspec.exec.ray.p2p``).

[Note: chunk cuts] Stage ``k``'s chunk ``c`` ends right after its last ``B(m)`` with
``m < (c+1)·W``. Then every input a stage needs in chunk ``c`` is made by its neighbour in a
chunk ``<= c`` (``plan_p2p`` checks it), and the driver keeps two chunks submitted ahead, so
every producer's call is queued before any consumer waits on it: no deadlock. 1F1B streams on
across chunks; a send may be received in the next chunk. Two stages, 1F1B, ``W = 2``::

    chunk 0: stage 0 | F0 F1 B0 F2 B1 |   stage 1 | FB0 FB1      (F2 is received in chunk 1)
    chunk 1: stage 0 | F3 B2 F4 B3    |   stage 1 | FB2 FB3

[Note: finished sends] Gloo reports a send finished only once it is waited on, and a wait
blocks until the receiver has posted its receive, which may be chunks later: waiting right
after sending could deadlock, never waiting would hold every message of a segment (and its
buffer) until the segment ends. A stage therefore waits on a send to a neighbour when it has
received an input that the neighbour sent after consuming that send (``P2POp.retire``, worked
out by ``plan_p2p`` from both stages' orders): its data is then through, and the wait returns at
once. What is left is waited on at the end of the segment. In 1F1B, stage ``k``'s ``F(m)``
retires when ``B(m)`` comes back; in GPipe, the gradients a stage sent back retire with the next
batch's first forward input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rayspec.core.schedule import ActionKind, Schedule, ScheduleError
from rayspec.exec.base import ordered_actions

__all__ = ["P2POp", "plan_p2p", "source", "tag"]

_FORWARD, _BACKWARD = 0, 1  # tag = 2 * micro-batch + direction
_RUNS = {"F": ("F",), "B": ("B",), "FB": ("F", "B"), "I": ("B",), "W": ()}
"""The directions whose message an op makes: a split backward's I sends the input gradient, its W nothing."""


def tag(kind: str, m: int) -> int:
    """The message tag of micro-batch ``m``'s activation (``F``) or gradient (``B``)."""
    return 2 * m + (_FORWARD if kind == "F" else _BACKWARD)


@dataclass(frozen=True)
class P2POp:
    """One action of a stage's chunk: ``F``, ``B``, the last stage's fused ``FB``, or a split backward's ``I`` (sends
    the input gradient as ``B`` does) and ``W`` (no message) of micro-batch ``m``."""

    kind: ActionKind
    m: int
    s: int = 0  # F and FB: versions ahead of the forward; B: of the backward
    s_b: int = 0  # FB: versions ahead of its backward
    update: bool = False  # B and FB: the backward ends an update
    retire: tuple[int, ...] = ()  # tags of this stage's sends to the op's source that its input proves received


def _retire(ops: list[list[P2POp]]) -> list[list[P2POp]]:
    """``ops`` with each op's ``retire``: the sends to its source that the source consumed before it sent this
    op's input, so waiting on them returns at once ([Note: finished sends])."""
    n = len(ops)
    index = [{(kind, op.m): i for i, op in enumerate(stage) for kind in _RUNS[op.kind]}
             for stage in ops]  # stage -> (F|B, m) -> position of the op that runs it (I: the B direction)
    out = []
    for k in range(n):
        pending: dict[int, list[tuple[int, int]]] = {k - 1: [], k + 1: []}  # peer -> (its consuming op, tag)
        retired = []
        for op in ops[k]:
            done: tuple[int, ...] = ()
            src = source(op, k, n)
            if src is not None:
                peer = src[0]
                made = index[peer][("F" if peer < k else "B", op.m)]  # the source's op that sent this input
                done = tuple(tag for at, tag in pending[peer] if at <= made)
                pending[peer] = [(at, tag) for at, tag in pending[peer] if at > made]
            retired.append(dataclasses.replace(op, retire=done))
            kind, to = ("F", k + 1) if op.kind == "F" else ("B", k - 1)
            if 0 <= to < n and op.kind != "W":  # W sends nothing
                pending[to].append((index[to][(kind, op.m)], tag(kind, op.m)))
        out.append(retired)
    return out


def _check_order(ops: list[list[P2POp]], name: str) -> None:
    """Raise ``ScheduleError`` unless every stage takes each neighbour's messages in the order they were sent:
    NCCL matches a pair's messages in posting order, whatever their tags ([Note: messages] of ``p2p_wire``)."""
    n = len(ops)
    for k in range(n):
        for peer, kind in ((k - 1, "F"), (k + 1, "B")):
            if not 0 <= peer < n:
                continue
            taken = [op.m for op in ops[k] if source(op, k, n) == (peer, tag(kind, op.m))]
            sent = [op.m for op in ops[peer] if op.kind != "W" and (op.kind == "F") == (kind == "F")]  # F on, B back
            if taken != sent:
                raise ScheduleError(f"the {name} schedule has stage {k} take stage {peer}'s {kind} messages in the order "
                                    f"{taken[:8]}, not the order {sent[:8]} they are sent in; p2p needs both in one order")


def plan_p2p(schedule: Schedule, s: dict | None, width: int) -> list[list[list[P2POp]]]:
    """Each chunk's ops per stage: ``chunks[c][k]`` is stage ``k``'s ops of chunk ``c``, in its schedule order.

    Args:
        s: SpecTrain's version differences per action (``Schedule.differences``), or ``None``.
        width: ``W``, micro-batches per chunk (rounded up to whole updates when the schedule flushes).

    Raises:
        ScheduleError: if some stage would wait on a neighbour's later chunk (see [Note: chunk cuts]).
    """
    n, count, last = schedule.stages, schedule.microbatches, schedule.stages - 1
    last_b = {a.microbatch: a for a in schedule.actions[last] if a.kind == "B"}
    ops: list[list[P2POp]] = [[] for _ in range(n)]
    for p in ordered_actions(schedule, s):
        a = p.action
        if p.fused:
            b = last_b[a.microbatch]
            ops[a.stage].append(P2POp(ActionKind.FB, a.microbatch, p.s, 0 if s is None else s[b.key], b.update))
        else:
            ops[a.stage].append(P2POp(a.kind, a.microbatch, p.s, 0, a.update))
    ops = _retire(ops)
    _check_order(ops, schedule.name)
    width = max(1, width)
    if schedule.group > 1 and width % schedule.group:
        width += schedule.group - width % schedule.group
    chunks = -(-count // width)
    where: list[dict[tuple[str, int], int]] = []  # stage -> (F|B, m) -> chunk
    for k in range(n):
        cuts = [0] * chunks  # cuts[c]: one past stage k's last backward of a micro-batch below (c+1)·W
        for i, op in enumerate(ops[k]):
            if op.kind != "F":
                cuts[op.m // width] = max(cuts[op.m // width], i + 1)
        for c in range(1, chunks):
            cuts[c] = max(cuts[c], cuts[c - 1])
        cuts[-1] = len(ops[k])
        at: dict[tuple[str, int], int] = {}
        c = 0
        for i, op in enumerate(ops[k]):
            while i >= cuts[c]:
                c += 1
            for kind in ("F", "B") if op.kind == "FB" else ("B",) if op.kind == "I" else (op.kind,):
                at[(kind, op.m)] = c  # I: where the B direction's message of m is made and taken
        where.append(at)
    for k in range(n):
        for (kind, m), c in where[k].items():
            src = k - 1 if kind == "F" else k + 1
            if kind != "W" and 0 <= src < n and where[src][(kind, m)] > c:
                raise ScheduleError(f"stage {k}'s {kind}({m}) in chunk {c} needs stage {src}'s output of chunk "
                                    f"{where[src][(kind, m)]}: the {schedule.name} schedule cannot run in chunks of {width}")
    out: list[list[list[P2POp]]] = [[[] for _ in range(n)] for _ in range(chunks)]
    for k in range(n):
        for op in ops[k]:
            out[where[k][("F" if op.kind == "F" else "W" if op.kind == "W" else "B", op.m)]][k].append(op)
    return out


def source(op: P2POp, k: int, n: int) -> tuple[int, int] | None:
    """The neighbour and tag that op ``op`` of stage ``k`` (of ``n``) receives its input from, if any."""
    if op.kind == "W":
        return None
    if op.kind in ("B", "I"):
        return (k + 1, tag("B", op.m)) if k < n - 1 else None
    return (k - 1, tag("F", op.m)) if k > 0 else None
