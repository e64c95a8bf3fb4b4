"""The messages of the ``p2p`` transports: what one stage actor sends to a neighbour and receives from it, over
the data groups ``P2PEndpoint.join`` made (the format, the sizes both ends agree on and the buffers:
``rayspec.exec.ray.p2p_wire``, [Note: messages])."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from rayspec.core.device import to_device
from rayspec.exec.ray.p2p_wire import (
    FOLD_BYTES,
    HEADER_BYTES,
    Buffers,
    Link,
    as_bytes,
    encode,
    pack,
    payload_bytes,
    read_header,
    split_sizes,
    views,
)

__all__ = ["DATA_TAG", "Messages"]

DATA_TAG = 0
"""The tag of every payload of a NCCL link: NCCL matches in posting order (p2p_wire, Note: messages)."""


def _direction(t: int) -> str:
    return "F" if t % 2 == 0 else "B"


class Messages:
    """Send and receive one stage actor's messages; ``P2PEndpoint.join`` sets the groups, tags and buffers."""

    rank: int
    device: torch.device
    wire: torch.device  # where payloads travel from: the device (NCCL) or the host (gloo)
    buffers: Buffers
    headers: Buffers

    def __init__(self) -> None:
        self.groups: dict[tuple[int, int, str], Any] = {}  # (sender, receiver, direction) -> data group
        self.tags: dict[tuple[int, int, str], int] = {}  # the same -> the tag of its data messages
        self.nccl_rules = False  # NCCL's groups and messages (p2p_wire, Note: messages), on gloo too if asked
        self.forget()

    def forget(self) -> None:
        """Start afresh: no send in flight, no receive posted, no size known on any link (a new connection)."""
        self.sends: dict[tuple[int, int], list] = {}  # (peer, tag) -> [(work, tensor)] of sends not waited on
        self.posted: dict[tuple[int, int], tuple] = {}  # receives started ahead
        self.links: dict[tuple[int, int, str], Link] = {}  # (sender, receiver, direction) -> what both ends expect

    def _link(self, src: int, dst: int, t: int) -> Link:
        return self.links.setdefault((src, dst, _direction(t)), Link())

    def _group(self, src: int, dst: int, t: int) -> tuple[Any, int]:
        """The data group and tag of the directed link from rank ``src`` to ``dst`` for message ``t``'s direction."""
        link = (src, dst, _direction(t))
        return self.groups[link], self.tags[link]

    def _folds(self, link: Link) -> bool:
        """Whether the link's next message carries its header in front of its payload, one data message
        (p2p_wire, Note: messages): on host buffers (gloo), once its size is known, up to ``FOLD_BYTES``."""
        return not self.nccl_rules and link.expect is not None and link.expect <= FOLD_BYTES

    def send(self, value: Any, peer: int, t: int) -> None:
        """Send ``value`` to stage ``peer`` as message ``t``: its header and its payload, in one data message or
        two (waited on later: ``wait_sends``)."""
        header, parts = pack(value)
        size = payload_bytes(parts)
        link = self._link(self.rank, peer, t)
        group, tag = self._group(self.rank, peer, t)
        if self._folds(link):
            assert link.expect is not None
            total = HEADER_BYTES + size
            first, rest = split_sizes(total, HEADER_BYTES + link.expect)
            message = self.buffers.take(max(total, first))
            message[:HEADER_BYTES].copy_(header)
            encode(parts, message[HEADER_BYTES:])
            self._host_copies_done(parts)
            works = [(dist.isend(message[:first], peer, group=group, tag=tag), message)]
            if rest:
                works.append((dist.isend(message[first:total], peer, group=group, tag=tag), message))
        else:
            first, rest = split_sizes(size, link.expect)
            if len(parts) == 1 and parts[0].nbytes == size == first and parts[0].device.type == self.wire.type:
                payload = as_bytes(parts[0])  # one tensor of the agreed size, where it travels from: no copy
            else:
                payload = self.buffers.take(max(size, first))
                encode(parts, payload)
                self._host_copies_done(parts)
            works = [(dist.isend(header, peer, tag=t), header),
                     (dist.isend(payload[:first], peer, group=group, tag=tag), payload)]
            if rest:
                works.append((dist.isend(payload[first:size], peer, group=group, tag=tag), payload))
        link.expect = size
        self.sends.setdefault((peer, t), []).extend(works)

    def _host_copies_done(self, parts: list[torch.Tensor]) -> None:
        if self.wire.type == "cpu" and any(p.is_cuda for p in parts):
            torch.cuda.current_stream().synchronize()  # gloo reads the host copy as soon as it sends

    def wait_sends(self, keys: Sequence[tuple[int, int]] | None = None) -> None:
        """Wait on the sends ``keys`` (``(peer, tag)``; all if ``None``) and let go of their buffers."""
        for key in list(self.sends) if keys is None else keys:
            for work, _ in self.sends.pop(key, ()):
                work.wait()

    def _post(self, peer: int, t: int) -> None:
        """Start receiving message ``t`` from ``peer`` (once): its header, and its payload at the size the link
        expects when known (the two in one data message where the link folds them), so that both can arrive while
        this stage computes. Call it only once the link's earlier messages are received whole (their second parts
        too: NCCL matches in posting order)."""
        if (peer, t) in self.posted:
            return
        link = self._link(peer, self.rank, t)
        group, tag = self._group(peer, self.rank, t)
        if self._folds(link):
            assert link.expect is not None
            message = self.buffers.take(HEADER_BYTES + link.expect)
            work = dist.irecv(message[: HEADER_BYTES + link.expect], peer, group=group, tag=tag)
            self.posted[(peer, t)] = (None, None, (work, message))
            return
        header = self.headers.take(HEADER_BYTES)[:HEADER_BYTES]
        payload = None
        if link.expect is not None:
            buffer = self.buffers.take(link.expect)
            payload = (dist.irecv(buffer[: link.expect], peer, group=group, tag=tag), buffer)
        self.posted[(peer, t)] = (dist.irecv(header, peer, tag=t), header, payload)

    def recv(self, peer: int, t: int) -> Any:
        """The value of message ``t`` from stage ``peer``, once it arrived (views into a pooled buffer, on the
        stage's device)."""
        self._post(peer, t)
        work, header, posted = self.posted.pop((peer, t))
        link = self._link(peer, self.rank, t)
        group, tag = self._group(peer, self.rank, t)
        if work is None:  # folded: the header is the front of the one data message
            assert link.expect is not None
            work, buffer = posted
            work.wait()
            is_tuple, specs, size, starts = read_header(buffer)
            start, first = HEADER_BYTES, HEADER_BYTES + link.expect
        else:
            work.wait()
            is_tuple, specs, size, starts = read_header(header)
            start, first = 0, split_sizes(size, link.expect)[0]
            if posted is None:  # the link's first message: its size is known only now
                buffer = self.buffers.take(size)
                posted = (dist.irecv(buffer[:size], peer, group=group, tag=tag), buffer)
            work, buffer = posted
            work.wait()
        end = start + size
        if end > first:  # larger than expected: the rest follows
            if buffer.numel() < end:
                larger = self.buffers.take(end)
                larger[:first].copy_(buffer[:first])
                buffer = larger
            dist.recv(buffer[first:end], peer, group=group, tag=tag)
        link.expect = size
        value = views(buffer[start:end], is_tuple, specs, starts)
        if self.wire != self.device:  # through host memory: to the stage's GPU, the buffer free once copied
            value = to_device(value, self.device)
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
                self.buffers.fence(buffer, event)
        return value
