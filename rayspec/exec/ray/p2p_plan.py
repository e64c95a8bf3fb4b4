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

[Note: virtual stages] With ``v`` model chunks per stage actor (interleaved 1F1B) rank ``r`` runs stages
``r, r + N, ...`` in the schedule's rank order (``Schedule.rank_actions``), each op naming its stage. Stage ``s``
still takes its activation from stage ``s - 1`` and its gradient from ``s + 1``; those live on ranks ``(s ∓ 1) % N``,
so the last rank sends on to rank 0 (the ring closes) and, at ``N = 2``, one pair of ranks carries activations
and gradients both ways. A message is known by its direction, micro-batch and boundary ``b`` (the lower stage of
the two): its tag is ``2 (m v + b // N) + direction``, unique per sender and receiver; with ``v = 1`` that is
``2 m + direction``. Between two chunks of one actor (``N = 1``) nothing is sent: the value stays in the actor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rayspec.core.schedule import ActionKind, Schedule, ScheduleError
from rayspec.exec.base import ordered_actions

__all__ = ["P2POp", "Message", "plan_p2p", "source", "target", "tag"]

_FORWARD, _BACKWARD = 0, 1  # tag = 2 * (micro-batch * lanes + lane) + direction
_RUNS = {"F": ("F",), "B": ("B",), "FB": ("F", "B"), "I": ("B",), "W": ()}
"""The directions whose message an op makes: a split backward's I sends the input gradient, its W nothing."""


def tag(kind: str, m: int, lane: int = 0, lanes: int = 1) -> int:
    """The message tag of micro-batch ``m``'s activation (``F``) or gradient (``B``) across boundary ``b`` of a
    schedule with ``lanes = v`` chunks per rank: ``lane = b // N`` ([Note: virtual stages])."""
    return 2 * (m * lanes + lane) + (_FORWARD if kind == "F" else _BACKWARD)


@dataclass(frozen=True)
class P2POp:
    """One action of a rank's chunk: ``F``, ``B``, the last stage's fused ``FB``, or a split backward's ``I`` (sends
    the input gradient as ``B`` does) and ``W`` (no message) of micro-batch ``m`` on stage ``stage`` (the model chunk;
    the rank's own stage without virtual stages)."""

    kind: ActionKind
    m: int
    s: int = 0  # F and FB: versions ahead of the forward; B: of the backward
    s_b: int = 0  # FB: versions ahead of its backward
    update: bool = False  # B and FB: the backward ends an update
    retire: tuple[int, ...] = ()  # tags of this rank's sends to the op's source that its input proves received
    stage: int = 0


@dataclass(frozen=True)
class Message:
    """A message between two ranks: from rank ``src`` to ``dst``, direction ``kind`` (``F`` or ``B``), micro-batch
    ``m`` across boundary ``b`` (between stages ``b`` and ``b + 1``), under ``tag``."""

    src: int
    dst: int
    kind: str
    m: int
    b: int
    tag: int

    @property
    def local(self) -> bool:
        """Between two chunks of one actor: nothing is sent."""
        return self.src == self.dst


def _message(kind: str, m: int, b: int, src_stage: int, ranks: int, lanes: int) -> Message:
    dst_stage = b + 1 if kind == "F" else b
    return Message(src_stage % ranks, dst_stage % ranks, kind, m, b, tag(kind, m, b // ranks, lanes))


def _retire(ops: list[list[P2POp]], stages: int) -> list[list[P2POp]]:
    """``ops`` with each op's ``retire``: the sends to its source that the source consumed before it sent this
    op's input, so waiting on them returns at once ([Note: finished sends])."""
    n = len(ops)
    index = [{(kind, op.stage, op.m): i for i, op in enumerate(rank) for kind in _RUNS[op.kind]}
             for rank in ops]  # rank -> (F|B, stage, m) -> position of the op that runs it (I: the B direction)
    out = []
    for k in range(n):
        pending: dict[int, list[tuple[int, int]]] = {}  # peer -> (its consuming op, tag)
        retired = []
        for op in ops[k]:
            done: tuple[int, ...] = ()
            got = source(op, n, stages)
            if got is not None and not got.local:
                peer = got.src
                made = index[peer][(got.kind, op.stage - 1 if got.kind == "F" else op.stage + 1, op.m)]
                waiting = pending.get(peer, [])
                done = tuple(t for at, t in waiting if at <= made)
                pending[peer] = [(at, t) for at, t in waiting if at > made]
            retired.append(dataclasses.replace(op, retire=done))
            sent = target(op, n, stages)
            if sent is not None and not sent.local:
                consumer = index[sent.dst][(sent.kind, op.stage + 1 if sent.kind == "F" else op.stage - 1, op.m)]
                pending.setdefault(sent.dst, []).append((consumer, sent.tag))
        out.append(retired)
    return out


def _check_order(ops: list[list[P2POp]], stages: int, name: str) -> None:
    """Raise ``ScheduleError`` unless every rank takes each neighbour's messages of a direction in the order they
    were sent: NCCL matches a link's messages in posting order, whatever their tags ([Note: messages] of
    ``p2p_wire``)."""
    n = len(ops)
    virtual = stages > n
    taken: dict[tuple[int, int, str], list] = {}
    sent: dict[tuple[int, int, str], list] = {}
    for k in range(n):
        for op in ops[k]:
            for book, msg in ((taken, source(op, n, stages)), (sent, target(op, n, stages))):
                if msg is not None and not msg.local:  # virtual stages: (boundary, m), else m
                    book.setdefault((msg.src, msg.dst, msg.kind), []).append((msg.b, msg.m) if virtual else msg.m)
    who = "rank" if virtual else "stage"
    for (src, dst, kind), order in sorted(taken.items()):
        if order != sent.get((src, dst, kind)):
            raise ScheduleError(f"the {name} schedule has {who} {dst} take {who} {src}'s {kind} messages in the order "
                                f"{order[:8]}, not the order {sent.get((src, dst, kind), [])[:8]} they are sent in; "
                                "p2p needs both in one order")


def plan_p2p(schedule: Schedule, s: dict | None, width: int) -> list[list[list[P2POp]]]:
    """Each chunk's ops per stage: ``chunks[c][k]`` is stage ``k``'s ops of chunk ``c``, in its schedule order.

    Args:
        s: SpecTrain's version differences per action (``Schedule.differences``), or ``None``.
        width: ``W``, micro-batches per chunk (rounded up to whole updates when the schedule flushes).

    Raises:
        ScheduleError: if some stage would wait on a neighbour's later chunk (see [Note: chunk cuts]).
    """
    n, count, last = schedule.ranks, schedule.microbatches, schedule.stages - 1
    last_b = {a.microbatch: a for a in schedule.actions[last] if a.kind == "B"}
    planned = {p.action.key: p for p in ordered_actions(schedule, s)}  # the fused last stage's B left out
    ops: list[list[P2POp]] = [[] for _ in range(n)]
    for r, acts in enumerate(schedule.rank_actions):  # each rank's order across its stages
        for a in acts:
            p = planned.get(a.key)
            if p is None:
                continue
            if p.fused:
                b = last_b[a.microbatch]
                ops[r].append(P2POp(ActionKind.FB, a.microbatch, p.s, 0 if s is None else s[b.key], b.update,
                                    stage=a.stage))
            else:
                ops[r].append(P2POp(a.kind, a.microbatch, p.s, 0, a.update, stage=a.stage))
    ops = _retire(ops, schedule.stages)
    _check_order(ops, schedule.stages, schedule.name)
    width = max(1, width)
    if schedule.group > 1 and width % schedule.group:
        width += schedule.group - width % schedule.group
    chunks = -(-count // width)
    where: list[dict[tuple[str, int, int], int]] = []  # rank -> (F|B, stage, m) -> chunk
    for k in range(n):
        cuts = [0] * chunks  # cuts[c]: one past rank k's last backward of a micro-batch below (c+1)·W
        for i, op in enumerate(ops[k]):
            if op.kind != "F":
                cuts[op.m // width] = max(cuts[op.m // width], i + 1)
        for c in range(1, chunks):
            cuts[c] = max(cuts[c], cuts[c - 1])
        cuts[-1] = len(ops[k])
        at: dict[tuple[str, int, int], int] = {}
        c = 0
        for i, op in enumerate(ops[k]):
            while i >= cuts[c]:
                c += 1
            for kind in ("F", "B") if op.kind == "FB" else ("B",) if op.kind == "I" else (op.kind,):
                at[(kind, op.stage, op.m)] = c  # I: where the B direction's message of m is made and taken
        where.append(at)
    for k in range(n):
        for (kind, stage, m), c in where[k].items():
            src = stage - 1 if kind == "F" else stage + 1
            if kind != "W" and 0 <= src <= last and where[src % n][(kind, src, m)] > c:
                raise ScheduleError(f"stage {stage}'s {kind}({m}) in chunk {c} needs stage {src}'s output of chunk "
                                    f"{where[src % n][(kind, src, m)]}: the {schedule.name} schedule cannot run in "
                                    f"chunks of {width}")
    out: list[list[list[P2POp]]] = [[[] for _ in range(n)] for _ in range(chunks)]
    for k in range(n):
        for op in ops[k]:
            out[where[k][("F" if op.kind == "F" else "W" if op.kind == "W" else "B", op.stage, op.m)]][k].append(op)
    return out


def source(op: P2POp, ranks: int, stages: int) -> Message | None:
    """The message op ``op`` receives its input in, if any (``ranks`` stage actors, ``stages`` stages)."""
    lanes = stages // ranks
    if op.kind == "W":
        return None
    if op.kind in ("B", "I"):
        return _message("B", op.m, op.stage, op.stage + 1, ranks, lanes) if op.stage < stages - 1 else None
    return _message("F", op.m, op.stage - 1, op.stage - 1, ranks, lanes) if op.stage > 0 else None


def target(op: P2POp, ranks: int, stages: int) -> Message | None:
    """The message op ``op`` sends its output in, if any: ``F`` on, ``B``, ``FB`` and ``I`` back, ``W`` none."""
    lanes = stages // ranks
    if op.kind == "F":
        return _message("F", op.m, op.stage, op.stage, ranks, lanes) if op.stage < stages - 1 else None
    if op.kind == "W" or op.stage == 0:
        return None
    return _message("B", op.m, op.stage - 1, op.stage, ranks, lanes)
