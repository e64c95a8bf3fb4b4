"""``pipeline.transport=p2p``: stage actors run their own action lists and send tensors to their neighbours.

Each actor call on the object store costs Ray a task submission, an object-store round and a
result store on the critical path of every action (``benchmarks.hops``). Here the driver sends
each stage one call per *chunk* of about ``chunk`` micro-batches, holding that stage's actions
of the chunk in schedule order (and stage 0's inputs, the last stage's labels); inside the call
the stage receives what each action needs from its neighbour, runs it and sends the result on
with ``torch.distributed`` point-to-point messages over a gloo group of the stage actors (TCP,
on a node or across nodes). No Ray task runs per action and no process spins while it waits.
The chunks and when a send is waited on: ``rayspec.exec.ray.p2p_plan``; the messages:
``rayspec.exec.ray.p2p_wire``. The tag names the micro-batch and the direction, so a stage may
receive in another order than its neighbour sent.

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

from rayspec.core.schedule import Schedule
from rayspec.exec.base import MicrobatchFeed
from rayspec.exec.ray.cluster import actor_died
from rayspec.exec.ray.p2p_plan import P2POp, plan_p2p, source, tag
from rayspec.exec.ray.p2p_wire import CAPACITY, HEADER_BYTES, Buffers, encode, message_bytes, pack, read_header, views
from rayspec.exec.ray.transport import ZERO_COPY, LossSink, StageOps, Transport
from rayspec.exec.ray.wire import to_wire

__all__ = ["P2PEndpoint", "P2PTransport"]


class P2PEndpoint:
    """The actor side: a gloo group over the stage actors and the chunk runner of one stage.

    Args:
        ops: the stage actor whose stage runs the actions.
    """

    def __init__(self, ops: StageOps) -> None:
        self.ops = ops
        self.store: Any = None
        self.norms_group: Any = None  # the gloo group the gradient norms are gathered over
        self.width: tuple[Any, int] | None = None  # (stage, most gradient tensors of any stage)

    def rendezvous(self, world: int, timeout_s: float) -> tuple[str, int]:
        """Host the group's rendezvous store (stage 0) on a port the system picks; its address and port."""
        address = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(address, 0, world, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        return address, self.store.port

    def join(self, address: str, port: int, rank: int, world: int, timeout_s: float, capacity: int = CAPACITY) -> None:
        """Join the stage actors' gloo group as ``rank`` (the stage index); ``capacity``: bytes of a receive."""
        self.capacity = capacity
        self.buffers = Buffers(capacity)
        self.sends: dict[tuple[int, int], list] = {}  # (peer, tag) -> [(work, tensor)] of sends not waited on
        self.posted: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}  # receives started ahead
        if dist.is_initialized():
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        store = self.store if rank == 0 else dist.TCPStore(address, port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        self.norms_group = dist.new_group(backend="gloo", timeout=timeout)

    def run(self, ops: Sequence[P2POp], data: dict, last: bool) -> dict[int, float]:
        """Run this stage's ops of one chunk; ``data``: stage 0's inputs by ``m``, the last stage's labels by
        ``("y", m)``; ``last``: the segment's final chunk, so wait until every send is received.

        Returns:
            The losses the last stage computed in this chunk (empty elsewhere).
        """
        k, n = self.ops.stage.index, self.ops.stage.num_stages
        sources = [source(op, k, n) for op in ops]
        ahead = iter([src for src in sources if src is not None][1:])
        for op, src in zip(ops, sources):
            received = None
            if src is not None:
                following = next(ahead, None)
                if following is not None:  # receive the next input ahead, while this op runs
                    self._post(*following)
                received = self.recv(*src)
                self.wait_sends([(src[0], t) for t in op.retire])
            if op.kind == "B":
                out = self.ops.backward(op.m, received, op.s, op.update)
            else:
                x = data.pop(op.m) if k == 0 else received
                labels = data.pop(("y", op.m), None)  # numpy from the driver: forward() makes them tensors
                if op.kind == "FB":
                    out = self.ops.forward_backward(op.m, x, labels, op.s, op.s_b, op.update)
                else:
                    out = self.ops.forward(op.m, x, labels, op.s)
            kind, to = ("F", k + 1) if op.kind == "F" else ("B", k - 1)
            if 0 <= to < n:
                self.send(out, to, tag(kind, op.m))
            if self.ops.stage.waiting:  # global clipping: its gradient is sent, now the norms
                self.finish_update()
        if last:
            self.wait_sends()
        return self.ops.pop_losses()

    def finish_update(self) -> None:
        """Gather every stage's gradient norms (``[count, norms..., padding]`` each) and apply the waiting update."""
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
        """Send ``value`` to stage ``peer`` as message ``t`` (waited on later: ``wait_sends``)."""
        header, payload = pack(value)
        if message_bytes(payload) <= self.capacity:
            parts = [encode(header, payload, self.buffers.take())]
        else:  # the header, then each tensor's bytes straight from the tensor
            parts = [header, *(b for b in payload if b.numel())]
        for part in parts:
            self.sends.setdefault((peer, t), []).append((dist.isend(part, peer, tag=t), part))

    def wait_sends(self, keys: Sequence[tuple[int, int]] | None = None) -> None:
        """Wait on the sends ``keys`` (``(peer, tag)``; all if ``None``) and let go of their buffers."""
        for key in list(self.sends) if keys is None else keys:
            for work, _ in self.sends.pop(key, ()):
                work.wait()

    def _post(self, peer: int, t: int) -> None:
        """Start receiving the message ``t`` from ``peer`` (once), so that it can arrive while this stage computes.

        A receive may be larger than its message, never smaller (gloo aborts the process): a message that
        fits the capacity comes whole, a larger one as its header and then each tensor's bytes.
        """
        if (peer, t) not in self.posted:
            message = self.buffers.take()
            self.posted[(peer, t)] = (dist.irecv(message, peer, tag=t), message)

    def recv(self, peer: int, t: int) -> Any:
        """The value of message ``t`` from stage ``peer``, once it arrived (views into a pooled buffer)."""
        self._post(peer, t)
        work, message = self.posted.pop((peer, t))
        work.wait()
        is_tuple, specs, size = read_header(message)
        if HEADER_BYTES + size <= self.capacity:
            return views(message, is_tuple, specs)
        out: list[torch.Tensor | None] = []
        for spec in specs:
            x = None if spec is None else torch.empty(spec[1], dtype=spec[0])
            if x is not None and x.numel():
                dist.recv(x.reshape(-1).view(torch.uint8), peer, tag=t)
            out.append(x)
        return tuple(out) if is_tuple else out[0]


class P2PTransport(Transport):
    """Starts the gloo group over live stage actors and runs segments through them, chunk by chunk.

    Args:
        chunk: micro-batches per chunk (about; flushed schedules round to whole updates).
        timeout_s: how long a stage waits for a neighbour's message before gloo gives up.
        capacity: bytes of every receive buffer (at least the header's); larger messages go in parts.
    """

    name = "p2p"
    replaces = "all"  # a failed segment leaves the live stages waiting on their neighbours

    def __init__(self, chunk: int = 16, timeout_s: float = 1800.0, capacity: int = CAPACITY) -> None:
        self.chunk = chunk
        self.timeout_s = timeout_s
        self.capacity = max(capacity, HEADER_BYTES)
        self.env = dict(ZERO_COPY)

    def start(self, actors: Sequence[Any]) -> None:
        super().start(actors)
        n = len(self.actors)
        address, port = ray.get(self.actors[0].p2p_rendezvous.remote(n, self.timeout_s))
        ray.get([a.p2p_join.remote(address, port, k, n, self.timeout_s, self.capacity)
                 for k, a in enumerate(self.actors)])

    def run(self, schedule: Schedule, s: dict | None, feed: MicrobatchFeed, on_losses: LossSink) -> None:
        if self.broken:
            raise RuntimeError("pipeline.transport=p2p: an earlier segment failed and left stages waiting on their "
                               "neighbours; load new stages (new actors) before running again")
        chunks = plan_p2p(schedule, s, self.chunk)
        n, last = schedule.stages, schedule.stages - 1
        pending: deque = deque()
        try:
            for c, per_stage in enumerate(chunks):
                data: list[dict] = [{} for _ in range(n)]
                # numpy arrays: Ray ships them without a copy; tensors would be pickled (ms each)
                for op in per_stage[0]:
                    if op.kind != "B":
                        data[0][op.m] = to_wire(feed.input(op.m))
                for op in per_stage[last]:
                    if op.kind != "B":
                        data[last][("y", op.m)] = to_wire(feed.labels(op.m))
                final = c == len(chunks) - 1
                pending.append([a.p2p_run.remote(per_stage[k], data[k], final) for k, a in enumerate(self.actors)])
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
