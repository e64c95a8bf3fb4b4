"""``pipeline.transport=p2p`` and ``p2p_nccl``: stage actors run their own action lists and send tensors to their
neighbours.

Each actor call on the object store costs Ray a task submission, an object-store round and a
result store on the critical path of every action (``benchmarks.hops``). Here the driver sends
each stage one call per *chunk* of about ``chunk`` micro-batches, holding that stage's actions
of the chunk in schedule order (and stage 0's inputs, the last stage's labels); inside the call
the stage receives what each action needs from its neighbour, runs it and sends the result on
with ``torch.distributed`` point-to-point messages over a data group per direction, gloo (``p2p``: CPU
stages, or GPU stages through pinned host memory; a header in front of its payload) or NCCL (``p2p_nccl``: a
GPU per stage, device to device; headers over a gloo group of the stage actors). No Ray task runs per action
and no process spins while it waits. The chunks and when a send is waited on:
``rayspec.exec.ray.p2p_plan``; sending and receiving: ``rayspec.exec.ray.p2p_messages``; the messages and the
order both ends keep: ``rayspec.exec.ray.p2p_wire``.

With global clipping a stage, right after sending the gradient of an update-carrying backward, all-gathers
every stage's gradient norms over a second gloo group of the stage actors and applies its update: one
collective of ``(tensors of the largest stage + 1)`` floats per stage and update (a few hundred bytes), and
each stage's update waits for the slowest stage's backward, as it must.

Per stage, the actions run in the schedule's order, so this path computes what
``LocalExecutor`` computes. With virtual stages (interleaved 1F1B) a stage actor hosts ``v`` model chunks and runs
its rank's actions across them in the schedule's rank order; a data group then also joins the last stage actor to
the first ([Note: virtual stages] in ``p2p_plan``). An error inside a stage leaves its neighbours waiting in ``recv``:
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
from rayspec.core.transports import TransportSpec
from rayspec.exec.base import MicrobatchFeed
from rayspec.exec.ray.cluster import actor_died
from rayspec.exec.ray.p2p_messages import DATA_TAG, Messages
from rayspec.exec.ray.p2p_plan import Message, P2POp, plan_p2p, source, target
from rayspec.exec.ray.p2p_wire import CAPACITY, HEADER_BYTES, Buffers
from rayspec.exec.ray.transport import ZERO_COPY, LossSink, StageOps, Transport, TransportOptions
from rayspec.exec.ray.wire import to_wire

__all__ = ["P2PEndpoint", "P2PTransport"]

def data_links(world: int, ring: bool = False) -> list[tuple[int, int, str]]:
    """The directed links ``(src, dst, direction)`` that get a data group each, in the order every rank creates
    them: activations from rank ``r`` to ``r + 1``, gradients back; with ``ring`` (virtual stages) also from the last
    rank to the first and back."""
    pairs = [(lo, lo + 1) for lo in range(world - 1)] + ([(world - 1, 0)] if ring and world > 1 else [])
    return [link for a, b in pairs for link in ((a, b, "F"), (b, a, "B"))]


class P2PEndpoint(Messages):
    """The actor side: the groups over the stage actors and the chunk runner of one stage.

    Args:
        ops: the stage actor whose stage runs the actions (``None``: sends and receives only).
    """

    def __init__(self, ops: StageOps | None) -> None:
        super().__init__()
        self.ops = ops
        self.store: Any = None
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
             backend: str = "gloo", device: str | None = None, ring: bool = False, nccl_rules: bool = False) -> None:
        """Join the stage actors' groups as ``rank`` (the stage actor's index: its stage, or the first of its model
        chunks): the gloo group of the headers and the data groups (``gloo``: one of every stage actor, a tag per
        directed link of neighbours and direction; ``nccl``: per directed link, a communicator of the two ranks only,
        created when they first exchange a message); ``device``: where received tensors go
        (the stage's device by default); ``capacity``: bytes of a pooled buffer at the least; ``ring``: the last
        rank is the first's neighbour too (virtual stages: ``data_links``); ``nccl_rules``: run NCCL's groups and
        messages on gloo too (headers apart, a group per link: what ``p2p_nccl`` does, testable on CPU)."""
        self.rank, self.world = rank, world
        self.device = torch.device(device if device is not None else self.ops.stage.device if self.ops else "cpu")
        self.wire = self.device if backend == "nccl" else torch.device("cpu")
        self.buffers = Buffers(capacity, self.wire, pin=self.wire.type == "cpu" and self.device.type == "cuda")
        self.headers = Buffers(HEADER_BYTES)
        self.forget()
        self.local: dict[tuple[int, int], Any] = {}  # (tag, receiving stage) -> a value between chunks of this actor
        if self.backend is not None and self.backend != backend:
            raise RuntimeError(f"stage {rank} joined a {self.backend} group before; a new backend needs a new actor")
        links = data_links(world, ring)
        rules = nccl_rules or backend == "nccl"
        known = self.groups if rules == self.nccl_rules else {}  # groups of the other rules: new ones
        self.nccl_rules = rules
        # gloo matches by sender and tag: a tag per directed link; NCCL matches in posting order, tags unused
        self.tags = {link: DATA_TAG if rules else i for i, link in enumerate(links)}
        if known and set(known) == set(links):
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            store = self.store if rank == 0 else dist.TCPStore(address, port, world, is_master=False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        if backend == "nccl":
            torch.cuda.set_device(self.device.index or 0)
        self.backend = backend
        # every rank creates every group, in one order; ranks outside a group get a placeholder
        if not rules:  # gloo: one group of every stage actor for every link (p2p_wire, Note: messages)
            shared = next(iter(known.values()), None) or dist.new_group(backend="gloo", timeout=timeout)
            self.groups = dict.fromkeys(links, shared)
        else:
            self.groups = {link: known.get(link) or dist.new_group(ranks=sorted(link[:2]), backend=backend,
                                                                    timeout=timeout) for link in links}
        if self.norms_group is None:
            self.norms_group = dist.new_group(backend="gloo", timeout=timeout)  # global clipping's norms

    def run(self, ops: Sequence[P2POp], data: dict, last: bool) -> dict[int, float]:
        """Run this rank's ops of one chunk; ``data``: stage 0's inputs by ``m``, the last stage's labels by
        ``("y", m)``; ``last``: the segment's final chunk, so wait until every send is received.

        Returns:
            The losses the last stage computed in this chunk (empty elsewhere).
        """
        assert self.ops is not None
        chunks = self.ops.chunks
        n, stages = self.world, next(iter(chunks.values())).num_stages
        sources = [source(op, n, stages) for op in ops]
        inputs = [src for src in sources if src is not None and not src.local]
        if inputs:  # the chunk's first input may arrive while the ops before it run
            self._post(inputs[0].src, inputs[0].tag)
        got = 0
        for op, src in zip(ops, sources):
            received = None
            if src is not None and src.local:  # from another chunk of this actor
                received = self.local.pop((src.tag, op.stage))
            elif src is not None:
                received = self.recv(src.src, src.tag)
                got += 1
                if got < len(inputs):  # receive the next input ahead, while this op runs
                    self._post(inputs[got].src, inputs[got].tag)
                self.wait_sends([(src.src, t) for t in op.retire])
            out = self._compute(op, received, data, stages)
            msg = target(op, n, stages)
            if msg is not None:
                self._hand_on(out, msg)
            if all(stage.waiting for stage in chunks.values()):  # global clipping: gradients sent, now the norms
                self.finish_update()
        if last:
            self.wait_sends()
        return self.ops.pop_losses()

    def _compute(self, op: P2POp, received: Any, data: dict, stages: int) -> Any:
        """Run ``op`` on its chunk with its input; its output (``None`` for ``W`` and the last stage's loss)."""
        assert self.ops is not None
        if op.kind == "B":
            return self.ops.backward(op.m, received, op.s, op.update, op.stage)
        if op.kind == "I":
            return self.ops.backward_input(op.m, received, op.stage)
        if op.kind == "W":
            self.ops.backward_weight(op.m, op.update, op.stage)
            return None
        x = data.pop(op.m) if op.stage == 0 else received
        labels = data.pop(("y", op.m), None) if op.stage == stages - 1 else None  # numpy: forward() makes tensors
        if op.kind == "FB":
            return self.ops.forward_backward(op.m, x, labels, op.s, op.s_b, op.update, op.stage)
        return self.ops.forward(op.m, x, labels, op.s, op.stage)

    def _hand_on(self, value: Any, msg: Message) -> None:
        """Send ``value`` as ``msg``, or keep it here for this actor's chunk that takes it."""
        if msg.local:
            self.local[(msg.tag, msg.b + 1 if msg.kind == "F" else msg.b)] = value
        else:
            self.send(value, msg.dst, msg.tag)

    def finish_update(self) -> None:
        """Gather every stage's gradient norms and apply the waiting updates: each rank sends ``[count per chunk...,
        norms of its chunks..., padding]``; rank ``r``'s chunk ``j`` is stage ``r + N j``."""
        assert self.ops is not None, "only a stage's endpoint applies updates"
        chunks = list(self.ops.chunks.values())
        world, v = dist.get_world_size(), len(chunks)
        if self.width is None or self.width[0] is not chunks[0]:  # once per stage object: the largest rank's count
            counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(counts, torch.tensor([sum(len(st.params) for st in chunks)]), group=self.norms_group)
            self.width = (chunks[0], max(int(c) for c in counts))
        own = [st.grad_norms() for st in chunks]
        mine = torch.zeros(v + self.width[1], dtype=own[0].dtype)
        mine[:v] = torch.tensor([len(x) for x in own], dtype=mine.dtype)
        if own:
            body = torch.cat(own)
            mine[v : v + len(body)] = body
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=self.norms_group)
        norms: list[torch.Tensor] = [torch.empty(0)] * (world * v)
        for r, part in enumerate(parts):
            at = v
            for j in range(v):
                count = int(part[j])
                norms[r + world * j] = part[at : at + count]
                at += count
        self.ops.finish_update(*norms)

class P2PTransport(Transport):
    """Starts the groups over live stage actors and runs segments through them, chunk by chunk.

    Args:
        chunk: micro-batches per chunk (about; flushed schedules round to whole updates).
        timeout_s: how long a stage waits for a neighbour's message before the group gives up.
        capacity: bytes of a pooled buffer at the least.
        backend: the data groups' ``gloo`` (``p2p``) or ``nccl`` (``p2p_nccl``).
        nccl_rules: on gloo, NCCL's groups and messages (``P2PEndpoint.join``).
    """

    replaces = "all"  # a failed segment leaves the live stages waiting on their neighbours
    hosts_chunks = True

    def __init__(self, chunk: int = 16, timeout_s: float = 1800.0, capacity: int = CAPACITY,
                 backend: str = "gloo", virtual: int = 1, nccl_rules: bool = False) -> None:
        self.chunk = chunk
        self.nccl_rules = nccl_rules
        self.virtual = virtual
        self.timeout_s = timeout_s
        self.capacity = capacity
        self.backend = backend
        self.name = "p2p_nccl" if backend == "nccl" else "p2p"
        self.nccl = "torch" if backend == "nccl" else None
        self.env = dict(ZERO_COPY)

    @classmethod
    def create(cls, spec: TransportSpec, options: TransportOptions) -> P2PTransport:
        """``p2p`` (gloo data groups) or ``p2p_nccl`` (the line that uses NCCL: NCCL data groups)."""
        return cls(options.chunk, backend="nccl" if spec.nccl else "gloo", virtual=options.virtual)

    def start(self, actors: Sequence[Any]) -> None:
        super().start(actors)
        self.open_endpoints(P2PEndpoint)
        n = len(self.actors)
        address, port = ray.get(self.actors[0].endpoint_call.remote("rendezvous", n, self.timeout_s))
        ray.get([a.endpoint_call.remote("join", address, port, k, n, self.timeout_s, self.capacity, self.backend,
                                        None, self.virtual > 1, self.nccl_rules)
                 for k, a in enumerate(self.actors)])

    def run(self, schedule: Schedule, s: dict | None, feed: MicrobatchFeed, on_losses: LossSink) -> None:
        if self.broken:
            raise RuntimeError(f"pipeline.transport={self.name}: an earlier segment failed and left stages waiting on "
                               "their neighbours; load new stages (new actors) before running again")
        chunks = plan_p2p(schedule, s, self.chunk)
        n, last = schedule.ranks, schedule.stages - 1
        pending: deque = deque()
        try:
            for c, per_stage in enumerate(chunks):
                data: list[dict] = [{} for _ in range(n)]
                # numpy arrays: Ray ships them without a copy; tensors would be pickled (ms each)
                for op in per_stage[0]:
                    if op.kind in ("F", "FB") and op.stage == 0:
                        data[0][op.m] = to_wire(feed.input(op.m))
                for op in per_stage[last % n]:
                    if op.kind in ("F", "FB") and op.stage == last:
                        data[last % n][("y", op.m)] = to_wire(feed.labels(op.m))
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
