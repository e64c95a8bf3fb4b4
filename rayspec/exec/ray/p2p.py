"""``pipeline.transport=p2p`` and ``p2p_nccl``: stage actors run their own action lists and send tensors to their
neighbours.

Each actor call on the object store costs Ray a task submission, an object-store round and a
result store on the critical path of every action (``benchmarks.hops``). Here the driver sends
each stage one call per *chunk* of about ``chunk`` micro-batches, holding that stage's actions
of the chunk in schedule order (and stage 0's inputs, the last stage's labels); inside the call
the stage receives what each action needs from its neighbour, runs it and sends the result on
with ``torch.distributed`` point-to-point messages: headers over a gloo group of the stage actors,
payloads over a data group per direction, gloo (``p2p``: CPU stages, or GPU stages through pinned
host memory) or NCCL (``p2p_nccl``: a GPU per stage, device to device). No Ray task runs per action
and no process spins while it waits. The chunks and when a send is waited on:
``rayspec.exec.ray.p2p_plan``; the messages and the order both ends keep: ``rayspec.exec.ray.p2p_wire``.

With global clipping a stage, right after sending the gradient of an update-carrying backward, all-gathers
every stage's gradient norms over a second gloo group of the stage actors and applies its update: one
collective of ``(tensors of the largest stage + 1)`` floats per stage and update (a few hundred bytes), and
each stage's update waits for the slowest stage's backward, as it must.

Per stage, the actions run in the schedule's order, so this path computes what
``LocalExecutor`` computes. An error inside a stage leaves its neighbours waiting in ``recv``:
the actors are then replaced, all of them (``replaces = "all"``), never reused.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import ray
import torch
import torch.distributed as dist

from rayspec.core.device import to_device
from rayspec.core.schedule import Schedule
from rayspec.core.transports import TransportSpec
from rayspec.exec.base import MicrobatchFeed
from rayspec.exec.ray.cluster import actor_died
from rayspec.exec.ray.p2p_plan import P2POp, plan_p2p, source, tag
from rayspec.exec.ray.p2p_wire import (
    CAPACITY,
    HEADER_BYTES,
    Buffers,
    Link,
    encode,
    pack,
    payload_bytes,
    read_header,
    split_sizes,
    views,
)
from rayspec.exec.ray.transport import ZERO_COPY, LossSink, StageOps, Transport, TransportOptions
from rayspec.exec.ray.wire import to_wire

__all__ = ["P2PEndpoint", "P2PTransport"]

_DATA_TAG = 0  # every payload: gloo then matches in posting order, as NCCL does (p2p_wire, Note: messages)


def _direction(t: int) -> str:
    return "F" if t % 2 == 0 else "B"


class P2PEndpoint:
    """The actor side: the groups over the stage actors and the chunk runner of one stage.

    Args:
        ops: the stage actor whose stage runs the actions (``None``: sends and receives only).
    """

    def __init__(self, ops: StageOps | None) -> None:
        self.ops = ops
        self.store: Any = None
        self.groups: dict[tuple[int, str], Any] = {}  # (lower stage, direction) -> data group
        self.backend: str | None = None
        self.norms_group: Any = None  # the gloo group the gradient norms are gathered over
        self.width: tuple[Any, int] | None = None  # (stage, most gradient tensors of any stage)

    def rendezvous(self, world: int, timeout_s: float) -> tuple[str, int]:
        """Host the groups' rendezvous store (stage 0) on a port the system picks; its address and port."""
        address = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(address, 0, world, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        return address, self.store.port

    def join(self, address: str, port: int, rank: int, world: int, timeout_s: float, capacity: int = CAPACITY,
             backend: str = "gloo", device: str | None = None) -> None:
        """Join the stage actors' groups as ``rank`` (the stage index): the gloo group of the headers and, per pair of
        neighbours and direction, a data group of the two on ``backend`` (``gloo`` or ``nccl``: a communicator of
        the two ranks only, created when they first exchange a message); ``device``: where received tensors go
        (the stage's device by default); ``capacity``: bytes of a pooled buffer at the least."""
        self.rank = rank
        self.device = torch.device(device if device is not None else self.ops.stage.device if self.ops else "cpu")
        self.wire = self.device if backend == "nccl" else torch.device("cpu")
        self.buffers = Buffers(capacity, self.wire, pin=self.wire.type == "cpu" and self.device.type == "cuda")
        self.headers = Buffers(HEADER_BYTES)
        self.sends: dict[tuple[int, int], list] = {}  # (peer, tag) -> [(work, tensor)] of sends not waited on
        self.posted: dict[tuple[int, int], tuple] = {}  # receives started ahead
        self.links: dict[tuple[int, str], Link] = {}  # (peer, direction) -> what both ends expect
        if self.backend is not None and self.backend != backend:
            raise RuntimeError(f"stage {rank} joined a {self.backend} group before; a new backend needs a new actor")
        if self.groups:
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            store = self.store if rank == 0 else dist.TCPStore(address, port, world, is_master=False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        if backend == "nccl":
            torch.cuda.set_device(self.device.index or 0)
        self.backend = backend
        # every rank creates every group, in one order; ranks outside a group get a placeholder
        self.groups = {(lo, d): dist.new_group(ranks=[lo, lo + 1], backend=backend, timeout=timeout)
                       for lo in range(world - 1) for d in ("F", "B")}
        self.norms_group = dist.new_group(backend="gloo", timeout=timeout)  # global clipping's norms

    def run(self, ops: Sequence[P2POp], data: dict, last: bool) -> dict[int, float]:
        """Run this stage's ops of one chunk; ``data``: stage 0's inputs by ``m``, the last stage's labels by
        ``("y", m)``; ``last``: the segment's final chunk, so wait until every send is received.

        Returns:
            The losses the last stage computed in this chunk (empty elsewhere).
        """
        assert self.ops is not None
        k, n = self.ops.stage.index, self.ops.stage.num_stages
        sources = [source(op, k, n) for op in ops]
        inputs = [src for src in sources if src is not None]
        if inputs:  # the chunk's first input may arrive while the ops before it run
            self._post(*inputs[0])
        got = 0
        for op, src in zip(ops, sources):
            received = None
            if src is not None:
                received = self.recv(*src)
                got += 1
                if got < len(inputs):  # receive the next input ahead, while this op runs
                    self._post(*inputs[got])
                self.wait_sends([(src[0], t) for t in op.retire])
            if op.kind == "B":
                out = self.ops.backward(op.m, received, op.s, op.update)
            elif op.kind == "I":
                out = self.ops.backward_input(op.m, received)
            elif op.kind == "W":
                self.ops.backward_weight(op.m, op.update)
                out = None
            else:
                x = data.pop(op.m) if k == 0 else received
                labels = data.pop(("y", op.m), None)  # numpy from the driver: forward() makes them tensors
                if op.kind == "FB":
                    out = self.ops.forward_backward(op.m, x, labels, op.s, op.s_b, op.update)
                else:
                    out = self.ops.forward(op.m, x, labels, op.s)
            kind, to = ("F", k + 1) if op.kind == "F" else ("B", k - 1)
            if 0 <= to < n and op.kind != "W":
                self.send(out, to, tag(kind, op.m))
            if self.ops.stage.waiting:  # global clipping: its gradient is sent, now the norms
                self.finish_update()
        if last:
            self.wait_sends()
        return self.ops.pop_losses()

    def _link(self, peer: int, t: int) -> Link:
        return self.links.setdefault((peer, _direction(t)), Link())

    def _group(self, peer: int, t: int) -> Any:
        """The data group of this stage and its neighbour ``peer`` for message ``t``'s direction."""
        return self.groups[(min(self.rank, peer), _direction(t))]

    def finish_update(self) -> None:
        """Gather every stage's gradient norms (``[count, norms..., padding]`` each) and apply the waiting update."""
        assert self.ops is not None, "only a stage's endpoint applies updates"
        stage = self.ops.stage
        world = dist.get_world_size()
        if self.width is None or self.width[0] is not stage:  # once per stage object: the largest stage's count
            counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(counts, torch.tensor([len(stage.params)]), group=self.norms_group)
            self.width = (stage, max(int(c) for c in counts))
        own = stage.grad_norms()
        mine = torch.zeros(self.width[1] + 1, dtype=own.dtype)
        mine[0], mine[1 : 1 + len(own)] = len(own), own
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=self.norms_group)
        self.ops.finish_update(*(p[1 : 1 + int(p[0])] for p in parts))

    def send(self, value: Any, peer: int, t: int) -> None:
        """Send ``value`` to stage ``peer`` as message ``t``: its header, then its payload (waited on later:
        ``wait_sends``)."""
        header, parts = pack(value)
        size = payload_bytes(parts)
        link = self._link(peer, t)
        first, rest = split_sizes(size, link.expect)
        if len(parts) == 1 and parts[0].numel() == size == first and parts[0].device.type == self.wire.type:
            payload = parts[0]  # one tensor of the agreed size, where it travels from: its own bytes, no copy
        else:
            payload = self.buffers.take(max(size, first))
            encode(parts, payload)
            if self.wire.type == "cpu" and any(p.is_cuda for p in parts):
                torch.cuda.current_stream().synchronize()  # gloo reads the host copy as soon as it sends
        group = self._group(peer, t)
        works = [(dist.isend(header, peer, tag=t), header),
                 (dist.isend(payload[:first], peer, group=group, tag=_DATA_TAG), payload)]
        if rest:
            works.append((dist.isend(payload[first:size], peer, group=group, tag=_DATA_TAG), payload))
        link.expect = size
        self.sends.setdefault((peer, t), []).extend(works)

    def wait_sends(self, keys: Sequence[tuple[int, int]] | None = None) -> None:
        """Wait on the sends ``keys`` (``(peer, tag)``; all if ``None``) and let go of their buffers."""
        for key in list(self.sends) if keys is None else keys:
            for work, _ in self.sends.pop(key, ()):
                work.wait()

    def _post(self, peer: int, t: int) -> None:
        """Start receiving message ``t`` from ``peer`` (once): its header, and its payload at the size the link
        expects when known, so that both can arrive while this stage computes. Call it only once the link's
        earlier messages are received whole (their second parts too: NCCL matches in posting order)."""
        if (peer, t) in self.posted:
            return
        header = self.headers.take(HEADER_BYTES)[:HEADER_BYTES]
        payload = None
        expect = self._link(peer, t).expect
        if expect is not None:
            buffer = self.buffers.take(expect)
            payload = (dist.irecv(buffer[:expect], peer, group=self._group(peer, t), tag=_DATA_TAG), buffer)
        self.posted[(peer, t)] = (dist.irecv(header, peer, tag=t), header, payload)

    def recv(self, peer: int, t: int) -> Any:
        """The value of message ``t`` from stage ``peer``, once it arrived (views into a pooled buffer, on the
        stage's device)."""
        self._post(peer, t)
        work, header, posted = self.posted.pop((peer, t))
        work.wait()
        is_tuple, specs, size = read_header(header)
        link = self._link(peer, t)
        group = self._group(peer, t)
        first, rest = split_sizes(size, link.expect)
        if posted is None:  # the link's first message: its size is known only now
            buffer = self.buffers.take(size)
            posted = (dist.irecv(buffer[:size], peer, group=group, tag=_DATA_TAG), buffer)
        work, buffer = posted
        work.wait()
        if rest:  # larger than expected: the rest follows
            if buffer.numel() < size:
                larger = self.buffers.take(size)
                larger[:first].copy_(buffer[:first])
                buffer = larger
            dist.recv(buffer[first:size], peer, group=group, tag=_DATA_TAG)
        link.expect = size
        value = views(buffer[:size], is_tuple, specs)
        if self.wire != self.device:  # through host memory: to the stage's GPU, the buffer free once copied
            value = to_device(value, self.device)
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
                self.buffers.fence(buffer, event)
        return value


class P2PTransport(Transport):
    """Starts the groups over live stage actors and runs segments through them, chunk by chunk.

    Args:
        chunk: micro-batches per chunk (about; flushed schedules round to whole updates).
        timeout_s: how long a stage waits for a neighbour's message before the group gives up.
        capacity: bytes of a pooled buffer at the least.
        backend: the data groups' ``gloo`` (``p2p``) or ``nccl`` (``p2p_nccl``).
    """

    replaces = "all"  # a failed segment leaves the live stages waiting on their neighbours

    def __init__(self, chunk: int = 16, timeout_s: float = 1800.0, capacity: int = CAPACITY,
                 backend: str = "gloo") -> None:
        self.chunk = chunk
        self.timeout_s = timeout_s
        self.capacity = capacity
        self.backend = backend
        self.name = "p2p_nccl" if backend == "nccl" else "p2p"
        self.nccl = "torch" if backend == "nccl" else None
        self.env = dict(ZERO_COPY)

    @classmethod
    def create(cls, spec: TransportSpec, options: TransportOptions) -> P2PTransport:
        """``p2p`` (gloo data groups) or ``p2p_nccl`` (the line that uses NCCL: NCCL data groups)."""
        return cls(options.chunk, backend="nccl" if spec.nccl else "gloo")

    def start(self, actors: Sequence[Any]) -> None:
        super().start(actors)
        self.open_endpoints(P2PEndpoint)
        n = len(self.actors)
        address, port = ray.get(self.actors[0].endpoint_call.remote("rendezvous", n, self.timeout_s))
        ray.get([a.endpoint_call.remote("join", address, port, k, n, self.timeout_s, self.capacity, self.backend)
                 for k, a in enumerate(self.actors)])

    def run(self, schedule: Schedule, s: dict | None, feed: MicrobatchFeed, on_losses: LossSink) -> None:
        if self.broken:
            raise RuntimeError(f"pipeline.transport={self.name}: an earlier segment failed and left stages waiting on "
                               "their neighbours; load new stages (new actors) before running again")
        chunks = plan_p2p(schedule, s, self.chunk)
        n, last = schedule.stages, schedule.stages - 1
        pending: deque = deque()
        try:
            for c, per_stage in enumerate(chunks):
                data: list[dict] = [{} for _ in range(n)]
                # numpy arrays: Ray ships them without a copy; tensors would be pickled (ms each)
                for op in per_stage[0]:
                    if op.kind in ("F", "FB"):
                        data[0][op.m] = to_wire(feed.input(op.m))
                for op in per_stage[last]:
                    if op.kind in ("F", "FB"):
                        data[last][("y", op.m)] = to_wire(feed.labels(op.m))
                final = c == len(chunks) - 1
                pending.append([a.endpoint_call.remote("run", per_stage[k], data[k], final)
                                for k, a in enumerate(self.actors)])
                if len(pending) > 2:  # two chunks queued ahead: every producer's call is submitted (Note: chunk cuts)
                    on_losses(_finish(pending.popleft()))
            while pending:
                on_losses(_finish(pending.popleft()))
        except BaseException:
            self.broken = True
            raise


def _finish(refs: list) -> dict[int, float]:
    """The last stage's losses of one chunk, once every stage ended it; on a failure, the error that explains it."""
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
