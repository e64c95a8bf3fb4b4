"""``pipeline.transport=p2p``: stage actors run their own action lists and send tensors to their neighbours.

Each actor call on the object store costs Ray a task submission, an object-store round and a
result store on the critical path of every action (``benchmarks.hops``). Here the driver sends
each stage one call per *chunk* of about ``chunk`` micro-batches, holding that stage's actions
of the chunk in schedule order (and stage 0's inputs, the last stage's labels); inside the call
the stage receives what each action needs from its neighbour, runs it and sends the result on
with ``torch.distributed`` point-to-point messages over a gloo group of the stage actors (TCP,
on a node or across nodes). No Ray task runs per action and no process spins while it waits.

[Note: chunk cuts] Stage ``k``'s chunk ``c`` ends right after its last ``B(m)`` with
``m < (c+1)·W``. Then every input a stage needs in chunk ``c`` is made by its neighbour in a
chunk ``<= c`` (``plan_p2p`` checks it), and the driver keeps two chunks submitted ahead, so
every producer's call is queued before any consumer waits on it: no deadlock. 1F1B streams on
across chunks; a send may be received in the next chunk. Two stages, 1F1B, ``W = 2``::

    chunk 0: stage 0 | F0 F1 B0 F2 B1 |   stage 1 | FB0 FB1      (F2 is received in chunk 1)
    chunk 1: stage 0 | F3 B2 F4 B3    |   stage 1 | FB2 FB3

[Note: messages] A message is a fixed-size header (tuple or not, each tensor's dtype and shape,
``None`` for an input without a gradient, the payload's size) followed by the tensors' bytes,
in one buffer, sent with ``isend`` (see [Note: finished sends]). The receiver does not know the
size in advance: it receives into a buffer of ``_CAPACITY`` bytes (gloo accepts a shorter
message) and hands out views into it, no copy. Send and receive buffers come from a pool
(``_Buffers``) and are reused once no tensor refers to them. A larger message travels as its
header and then each tensor's bytes, received straight into the tensors. Header and payload
apart cost a 128 KiB hop 0.59 ms here, one message 0.43 ms. The tag names the micro-batch and
the direction, so a stage may receive in another order than its neighbour sent.

[Note: finished sends] Gloo reports a send finished only once it is waited on, and a wait
blocks until the receiver has posted its receive, which may be chunks later: waiting right
after sending could deadlock, never waiting would hold every message of a segment (and its
buffer) until the segment ends. A stage therefore waits on a send to a neighbour when it has
received an input that the neighbour sent after consuming that send (``P2POp.retire``, worked
out by ``plan_p2p`` from both stages' orders): its data is then through, and the wait returns at
once. What is left is waited on at the end of the segment. In 1F1B, stage ``k``'s ``F(m)``
retires when ``B(m)`` comes back; in GPipe, the gradients a stage sent back retire with the next
batch's first forward input.

Per stage, the actions run in the schedule's order, so this path computes what
``LocalExecutor`` computes. An error inside a stage leaves its neighbours waiting in ``recv``:
the executor is then closed (``ray.kill``) or recreated, never reused.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rayspec.compiled import _wire
from rayspec.executor import plan
from rayspec.schedule import Schedule, ScheduleError

__all__ = ["P2POp", "plan_p2p", "P2PRunner", "P2PPipeline"]

_FORWARD, _BACKWARD = 0, 1  # tag = 2 * micro-batch + direction
_HEADER_WORDS = 64  # int64: [is_tuple, count, payload bytes, then per tensor (dtype code or -1 for None, ndim, *shape)]
_HEADER_BYTES = 8 * _HEADER_WORDS
_ALIGN = 64  # each tensor's bytes start at a multiple of this in the payload
_CAPACITY = 1 << 20  # bytes of every receive buffer: a message up to this size travels as one
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)


@dataclass(frozen=True)
class P2POp:
    """One action of a stage's chunk: ``F``, ``B`` or the last stage's fused ``FB`` of micro-batch ``m``."""

    kind: str
    m: int
    s: int = 0  # F and FB: versions ahead of the forward; B: of the backward
    s_b: int = 0  # FB: versions ahead of its backward
    update: bool = False  # B and FB: the backward ends an update
    retire: tuple[int, ...] = ()  # tags of this stage's sends to the op's source that its input proves received


def _retire(ops: list[list[P2POp]]) -> list[list[P2POp]]:
    """``ops`` with each op's ``retire``: the sends to its source that the source consumed before it sent this
    op's input, so waiting on them returns at once ([Note: finished sends])."""
    n = len(ops)
    index = [{(kind, op.m): i for i, op in enumerate(stage) for kind in ("F", "B") if kind in op.kind}
             for stage in ops]  # stage -> (F|B, m) -> position of the op that runs it
    out = []
    for k in range(n):
        pending: dict[int, list[tuple[int, int]]] = {k - 1: [], k + 1: []}  # peer -> (its consuming op, tag)
        retired = []
        for op in ops[k]:
            done: tuple[int, ...] = ()
            src = _source(op, k, n)
            if src is not None:
                peer = src[0]
                made = index[peer][("F" if peer < k else "B", op.m)]  # the source's op that sent this input
                done = tuple(tag for at, tag in pending[peer] if at <= made)
                pending[peer] = [(at, tag) for at, tag in pending[peer] if at > made]
            retired.append(dataclasses.replace(op, retire=done))
            kind, to = ("F", k + 1) if op.kind == "F" else ("B", k - 1)
            if 0 <= to < n:
                pending[to].append((index[to][(kind, op.m)], 2 * op.m + (_FORWARD if kind == "F" else _BACKWARD)))
        out.append(retired)
    return out


def plan_p2p(schedule: Schedule, method: str, variant: str, width: int) -> list[list[list[P2POp]]]:
    """Each chunk's ops per stage: ``chunks[c][k]`` is stage ``k``'s ops of chunk ``c``, in its schedule order.

    Args:
        width: ``W``, micro-batches per chunk (rounded up to whole updates when the schedule flushes).

    Raises:
        ScheduleError: if some stage would wait on a neighbour's later chunk (see [Note: chunk cuts]).
    """
    n, count, last = schedule.stages, schedule.microbatches, schedule.stages - 1
    s = schedule.differences(method, variant)
    last_b = {a.microbatch: a for a in schedule.actions[last] if a.kind == "B"}
    ops: list[list[P2POp]] = [[] for _ in range(n)]
    for p in plan(schedule, s):
        a = p.action
        if p.fused:
            b = last_b[a.microbatch]
            ops[a.stage].append(P2POp("FB", a.microbatch, p.s, 0 if s is None else s[b.key], b.update))
        else:
            ops[a.stage].append(P2POp(a.kind, a.microbatch, p.s, 0, a.update))
    ops = _retire(ops)
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
            for kind in ("F", "B") if op.kind == "FB" else (op.kind,):
                at[(kind, op.m)] = c
        where.append(at)
    for k in range(n):
        for (kind, m), c in where[k].items():
            src = k - 1 if kind == "F" else k + 1
            if 0 <= src < n and where[src][(kind, m)] > c:
                raise ScheduleError(f"stage {k}'s {kind}({m}) in chunk {c} needs stage {src}'s output of chunk "
                                    f"{where[src][(kind, m)]}: the {schedule.name} schedule cannot run in chunks of {width}")
    out: list[list[list[P2POp]]] = [[[] for _ in range(n)] for _ in range(chunks)]
    for k in range(n):
        for op in ops[k]:
            out[where[k][("F" if op.kind == "F" else "B", op.m)]][k].append(op)
    return out


def _header(value: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The header of ``value`` (a tensor or a tuple of tensors and ``None``) as bytes, and each tensor's bytes."""
    flat = tuple(value) if isinstance(value, tuple) else (value,)
    words = [int(isinstance(value, tuple)), len(flat), 0]  # word 2: the payload's bytes
    payload = []
    for t in flat:
        if t is None:
            words.append(-1)
            continue
        if t.dtype not in _DTYPES or t.device.type != "cpu":
            raise TypeError(f"pipeline.transport=p2p sends CPU tensors of {', '.join(map(str, _DTYPES))}; "
                            f"got {t.dtype} on {t.device}")
        words += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        payload.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
        words[2] += _aligned(payload[-1].numel())
    if len(words) > _HEADER_WORDS:
        raise ValueError(f"pipeline.transport=p2p: a message of {len(flat)} tensors needs a header of {len(words)} "
                         f"words, more than {_HEADER_WORDS}; use pipeline.transport=object_store")
    header = torch.full((_HEADER_WORDS,), -2, dtype=torch.int64)
    header[: len(words)] = torch.tensor(words, dtype=torch.int64)
    return header.view(torch.uint8), payload


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _encode(value: Any) -> torch.Tensor:
    """``value`` as one byte message: the header, then each tensor's bytes at an offset aligned to ``_ALIGN``."""
    return _join(*_header(value))


def _join(header: torch.Tensor, payload: list[torch.Tensor], buffer: torch.Tensor | None = None) -> torch.Tensor:
    """A header and the tensors' bytes (``_header``) in one buffer (the front of ``buffer`` if given, else a new
    one), as ``_decode`` reads it."""
    size = _HEADER_BYTES + sum(_aligned(b.numel()) for b in payload)
    message = torch.empty(size, dtype=torch.uint8) if buffer is None else buffer[:size]
    message[:_HEADER_BYTES].copy_(header)
    start = _HEADER_BYTES
    for b in payload:
        message[start : start + b.numel()].copy_(b)
        start += _aligned(b.numel())
    return message


def _decode(message: torch.Tensor) -> Any:
    """The value of a message from ``_encode`` (``message`` may run on past its end): views into ``message``,
    no copy (each tensor starts at a multiple of ``_ALIGN``)."""
    is_tuple, specs, _ = _decode_header(message)
    return _views(message, is_tuple, specs)


def _views(message: torch.Tensor, is_tuple: bool, specs: list[tuple[torch.dtype, tuple[int, ...]] | None]) -> Any:
    """The tensors that ``message``'s decoded header (``_decode_header``) describes, as views into it."""
    out: list[torch.Tensor | None] = []
    start = _HEADER_BYTES
    for spec in specs:
        if spec is None:
            out.append(None)
            continue
        dtype, shape = spec
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(message[start : start + nbytes].view(dtype).view(shape))
        start += _aligned(nbytes)
    return tuple(out) if is_tuple else out[0]


def _decode_header(message: torch.Tensor) -> tuple[bool, list[tuple[torch.dtype, tuple[int, ...]] | None], int]:
    """Whether the message is a tuple, each tensor's dtype and shape (``None`` where it sent none), payload bytes."""
    words = message[:_HEADER_BYTES].view(torch.int64).tolist()
    specs: list[tuple[torch.dtype, tuple[int, ...]] | None] = []
    i = 3
    for _ in range(words[1]):
        if words[i] == -1:
            specs.append(None)
            i += 1
            continue
        ndim = words[i + 1]
        specs.append((_DTYPES[words[i]], tuple(words[i + 2 : i + 2 + ndim])))
        i += 2 + ndim
    return bool(words[0]), specs, words[2]


def _source(op: P2POp, k: int, n: int) -> tuple[int, int] | None:
    """The neighbour and tag that op ``op`` of stage ``k`` (of ``n``) receives its input from, if any."""
    if op.kind == "B":
        return (k + 1, 2 * op.m + _BACKWARD) if k < n - 1 else None
    return (k - 1, 2 * op.m + _FORWARD) if k > 0 else None


# references to a storage; private in torch: without it every message gets a new buffer
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


class _Buffers:
    """Byte buffers of one size, each reused once nothing refers to it any more.

    A fresh buffer per message doubles the cost of a 512 KiB hop over gloo here (0.31 against 0.15 ms,
    the new pages fault in during gloo's copy). ``take`` hands out a view of a buffer; the view, the
    views ``_decode`` cuts from it and anything autograd saved from those hold the buffer's storage, so a
    buffer whose storage only this pool holds is free. The pool grows to the most buffers in use at once.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.buffers: list[torch.Tensor] = []
        self._next = 0

    def take(self) -> torch.Tensor:
        if _USE_COUNT is None:
            return torch.empty(self.nbytes, dtype=torch.uint8)
        for i in range(len(self.buffers)):
            j = (self._next + i) % len(self.buffers)
            buffer = self.buffers[j]
            # the pool's tensor and the probe's storage object: nothing else refers to this buffer
            if _USE_COUNT(buffer.untyped_storage()._cdata) == 2:
                self._next = j + 1
                return buffer[:]
        self.buffers.append(torch.empty(self.nbytes, dtype=torch.uint8))
        return self.buffers[-1][:]


class P2PRunner:
    """The actor side, mixed into ``StageActor``: a gloo group over the stage actors and the chunk runner."""

    def p2p_rendezvous(self, world: int, timeout_s: float) -> tuple[str, int]:
        """Host the group's rendezvous store (stage 0) on a port the system picks; its address and port."""
        import ray
        import torch.distributed as dist

        address = ray.util.get_node_ip_address()
        self._p2p_store = dist.TCPStore(address, 0, world, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=timeout_s))
        return address, self._p2p_store.port

    def p2p_init(self, address: str, port: int, rank: int, world: int, timeout_s: float,
                 capacity: int = _CAPACITY) -> None:
        """Join the stage actors' gloo group as ``rank`` (the stage index); ``capacity``: bytes of a receive."""
        import torch.distributed as dist

        self._p2p_capacity = capacity
        self._p2p_buffers = _Buffers(capacity)
        self._p2p_sends: dict[tuple[int, int], list] = {}  # (peer, tag) -> [(work, tensor)] of sends not waited on
        self._p2p_posted: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}  # receives started ahead
        if dist.is_initialized():
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        store = self._p2p_store if rank == 0 else dist.TCPStore(address, port, world, is_master=False,
                                                                  timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)

    def p2p_run(self, ops: Sequence[P2POp], data: dict, last: bool) -> dict[int, float]:
        """Run this stage's ops of one chunk; ``data``: stage 0's inputs by ``m``, the last stage's labels by
        ``("y", m)``; ``last``: the segment's final chunk, so wait until every send is received.

        Returns:
            The losses the last stage computed in this chunk (empty elsewhere).
        """
        k, n = self.stage.index, self.stage.num_stages  # type: ignore[attr-defined]
        sources = [_source(op, k, n) for op in ops]
        ahead = iter([src for src in sources if src is not None][1:])
        for op, src in zip(ops, sources):
            received = None
            if src is not None:
                following = next(ahead, None)
                if following is not None:  # receive the next input ahead, while this op runs
                    self._p2p_post(*following)
                received = self._p2p_recv(*src)
                self.p2p_wait_sends([(src[0], tag) for tag in op.retire])
            if op.kind == "B":
                out = self.backward(op.m, received, op.s, op.update)  # type: ignore[attr-defined]
            else:
                x = data.pop(op.m) if k == 0 else received
                labels = data.pop(("y", op.m), None)  # numpy from the driver: forward() makes them tensors
                if op.kind == "FB":
                    out = self.forward_backward(op.m, x, labels, op.s, op.s_b, op.update)  # type: ignore[attr-defined]
                else:
                    out = self.forward(op.m, x, labels, op.s)  # type: ignore[attr-defined]
            to = k + 1 if op.kind == "F" else k - 1
            if 0 <= to < n:
                self._p2p_send(out, to, 2 * op.m + (_FORWARD if op.kind == "F" else _BACKWARD))
        if last:
            self.p2p_wait_sends()
        return self.pop_losses()  # type: ignore[attr-defined]

    def _p2p_send(self, value: Any, peer: int, tag: int) -> None:
        import torch.distributed as dist

        header, payload = _header(value)
        if _HEADER_BYTES + sum(_aligned(b.numel()) for b in payload) <= self._p2p_capacity:
            parts = [_join(header, payload, self._p2p_buffers.take())]
        else:  # the header, then each tensor's bytes straight from the tensor
            parts = [header, *(b for b in payload if b.numel())]
        for part in parts:
            self._p2p_sends.setdefault((peer, tag), []).append((dist.isend(part, peer, tag=tag), part))

    def p2p_wait_sends(self, keys: Sequence[tuple[int, int]] | None = None) -> None:
        """Wait on the sends ``keys`` (``(peer, tag)``; all if ``None``) and let go of their buffers."""
        for key in list(self._p2p_sends) if keys is None else keys:
            for work, _ in self._p2p_sends.pop(key, ()):
                work.wait()

    def _p2p_post(self, peer: int, tag: int) -> None:
        """Start receiving the message ``tag`` from ``peer`` (once), so that it can arrive while this stage computes.

        A receive may be larger than its message, never smaller (gloo aborts the process): a message that
        fits the capacity comes whole, a larger one as its header and then each tensor's bytes.
        """
        import torch.distributed as dist

        if (peer, tag) not in self._p2p_posted:
            message = self._p2p_buffers.take()
            self._p2p_posted[(peer, tag)] = (dist.irecv(message, peer, tag=tag), message)

    def _p2p_recv(self, peer: int, tag: int) -> Any:
        import torch.distributed as dist

        self._p2p_post(peer, tag)
        work, message = self._p2p_posted.pop((peer, tag))
        work.wait()
        is_tuple, specs, size = _decode_header(message)
        if _HEADER_BYTES + size <= self._p2p_capacity:
            return _views(message, is_tuple, specs)
        out: list[torch.Tensor | None] = []
        for spec in specs:
            t = None if spec is None else torch.empty(spec[1], dtype=spec[0])
            if t is not None and t.numel():
                dist.recv(t.reshape(-1).view(torch.uint8), peer, tag=tag)
            out.append(t)
        return tuple(out) if is_tuple else out[0]


class P2PPipeline:
    """Starts the gloo group over live stage actors and runs segments through them, chunk by chunk.

    Args:
        actors: the stage actors (``StageActor``), stage 0 first, each on a CPU.
        chunk: micro-batches per chunk (about; flushed schedules round to whole updates).
        timeout_s: how long a stage waits for a neighbour's message before gloo gives up.
        capacity: bytes of every receive buffer (at least the header's); larger messages go in parts.
    """

    def __init__(self, actors: Sequence[Any], chunk: int = 16, timeout_s: float = 1800.0,
                 capacity: int = _CAPACITY) -> None:
        import ray

        self.actors = list(actors)
        self.chunk = chunk
        self.broken = False
        n = len(self.actors)
        address, port = ray.get(self.actors[0].p2p_rendezvous.remote(n, timeout_s))
        ray.get([a.p2p_init.remote(address, port, k, n, timeout_s, max(capacity, _HEADER_BYTES))
                 for k, a in enumerate(self.actors)])

    def run(self, schedule: Schedule, method: str, variant: str, feed: Any,
            on_chunk: Callable[[dict[int, float]], None]) -> None:
        """Run one segment; ``feed`` is a ``MicrobatchFeed``, ``on_chunk`` gets each chunk's losses in order."""
        if self.broken:
            raise RuntimeError("pipeline.transport=p2p: an earlier segment failed and left stages waiting on their "
                               "neighbours; close this executor and create a new one")
        chunks = plan_p2p(schedule, method, variant, self.chunk)
        n, last = schedule.stages, schedule.stages - 1
        pending: deque = deque()
        try:
            for c, per_stage in enumerate(chunks):
                data: list[dict] = [{} for _ in range(n)]
                # numpy arrays: Ray ships them without a copy; tensors would be pickled (ms each)
                for op in per_stage[0]:
                    if op.kind != "B":
                        data[0][op.m] = _wire(feed.input(op.m))
                for op in per_stage[last]:
                    if op.kind != "B":
                        data[last][("y", op.m)] = _wire(feed.labels(op.m))
                final = c == len(chunks) - 1
                pending.append([a.p2p_run.remote(per_stage[k], data[k], final) for k, a in enumerate(self.actors)])
                if len(pending) > 2:  # two chunks queued ahead: every producer's call is submitted (Note: chunk cuts)
                    on_chunk(self._finish(pending.popleft()))
            while pending:
                on_chunk(self._finish(pending.popleft()))
        except BaseException:
            self.broken = True
            raise

    def _finish(self, refs: list) -> dict[int, float]:
        """The last stage's losses of one chunk, once every stage ended it; on a failure, the error that explains it."""
        import ray

        from rayspec.ray_executor import actor_died

        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            try:
                ray.get(ready[0])
            except Exception as err:
                # A dead stage makes its neighbours' receives fail too: report the death if there is one,
                # looking for up to 2 s (the live stages may stay blocked in a receive).
                deadline = time.monotonic() + 2.0
                while waiting and not actor_died(err) and (left := deadline - time.monotonic()) > 0:
                    ready, waiting = ray.wait(waiting, num_returns=1, timeout=left)
                    for ref in ready:
                        try:
                            ray.get(ref)
                        except Exception as other:
                            if actor_died(other):
                                err = other
                raise err from None
        return ray.get(refs[-1])
