"""The ``p2p`` transports' messages, the sizes both ends agree on, and the pool of buffers they travel in.

[Note: messages] A message is a fixed-size header (tuple or not, each tensor's dtype and shape, ``None``
for an input without a gradient, the payload's size), sent over the stage actors' gloo group, and a
payload (the tensors' bytes, each at a multiple of ``_ALIGN``), sent over the data group of its
direction: gloo (``p2p``) or NCCL (``p2p_nccl``). The same code runs both; only the data group's
backend differs. NCCL matches messages in the order they are posted and only at exactly the size
sent, so the protocol keeps to that on gloo as well (every data message has tag 0):

* per directed link (stage ``a`` to ``b``, activations or gradients) both ends keep ``expect``, the
  payload size of the link's last message (``Link``). The receiver posts the next payload's receive
  ahead at that size, before the header arrives (a pipeline's messages rarely change size);
* a payload of ``S`` bytes goes as ``max(S, expect)`` bytes when it fits (padding after it), else as
  ``expect`` bytes and then the other ``S - expect`` bytes; the first message of a link goes at its
  own size, once the receiver has read its header;
* one data group per pair of neighbours and direction, of those two ranks only: a NCCL send waits for
  its receive, and a communicator runs its operations in the order they were posted, so a receive
  posted ahead in one direction would hold up a send in the other on a shared communicator; and a
  communicator of more ranks would be created by all of them at once, each waiting on the others.

The receiver reads headers on the host (no device synchronization) and hands out views into the
payload buffer, no copy; buffers come from a pool (``Buffers``) and are reused once no tensor refers
to them (and, for host buffers that a copy to the GPU still reads, once that copy is done).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rayspec.exec.ray.wire import DTYPES

__all__ = ["HEADER_BYTES", "CAPACITY", "MIN_PAYLOAD", "Spec", "Link", "pack", "payload_bytes", "encode", "views",
           "read_header", "split_sizes", "Buffers"]

_HEADER_WORDS = 64  # int64: [is_tuple, count, payload bytes, then per tensor (dtype code or -1 for None, ndim, *shape)]
HEADER_BYTES = 8 * _HEADER_WORDS
_ALIGN = 64  # each tensor's bytes start at a multiple of this in the payload
MIN_PAYLOAD = _ALIGN
"""A payload is never empty (a message of ``None`` and empty tensors still sends this many bytes)."""
CAPACITY = 1 << 20
"""Bytes of a pooled buffer at the least: room for a payload that grows without a new buffer."""

Spec = tuple[torch.dtype, tuple[int, ...]] | None


@dataclass
class Link:
    """What both ends of one directed link know alike: the payload size the receiver posts next (None: unknown)."""

    expect: int | None = None


def pack(value: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The header of ``value`` (a tensor or a tuple of tensors and ``None``) as CPU bytes, and each tensor's bytes
    (flat ``uint8`` views, where the tensors are)."""
    flat = tuple(value) if isinstance(value, tuple) else (value,)
    words = [int(isinstance(value, tuple)), len(flat), 0]  # word 2: the payload's bytes
    parts = []
    for t in flat:
        if t is None:
            words.append(-1)
            continue
        if t.dtype not in DTYPES:
            raise TypeError(f"pipeline.transport=p2p sends tensors of {', '.join(map(str, DTYPES))}; got {t.dtype}")
        words += [DTYPES.index(t.dtype), t.dim(), *t.shape]
        parts.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
    if len(words) > _HEADER_WORDS:
        raise ValueError(f"pipeline.transport=p2p: a message of {len(flat)} tensors needs a header of {len(words)} "
                         f"words, more than {_HEADER_WORDS}; use pipeline.transport=object_store")
    words[2] = payload_bytes(parts)
    header = torch.full((_HEADER_WORDS,), -2, dtype=torch.int64)
    header[: len(words)] = torch.tensor(words, dtype=torch.int64)
    return header.view(torch.uint8), parts


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def payload_bytes(parts: list[torch.Tensor]) -> int:
    """Bytes of the payload of packed ``parts``: each tensor's aligned bytes, at least ``MIN_PAYLOAD``."""
    return max(MIN_PAYLOAD, sum(_aligned(b.numel()) for b in parts))


def encode(parts: list[torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """Packed ``parts`` (``pack``) copied into the front of ``buffer`` (on the buffer's device: host to GPU or back
    asynchronously where the memory allows); the payload, a view of ``buffer``."""
    start = 0
    for b in parts:
        buffer[start : start + b.numel()].copy_(b, non_blocking=True)
        start += _aligned(b.numel())
    return buffer[: payload_bytes(parts)]


def views(payload: torch.Tensor, is_tuple: bool, specs: list[Spec]) -> Any:
    """The tensors that a header (``read_header``) describes, as views into ``payload``: no copy (each tensor
    starts at a multiple of ``_ALIGN``)."""
    out: list[torch.Tensor | None] = []
    start = 0
    for spec in specs:
        if spec is None:
            out.append(None)
            continue
        dtype, shape = spec
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(payload[start : start + nbytes].view(dtype).view(shape))
        start += _aligned(nbytes)
    return tuple(out) if is_tuple else out[0]


def read_header(header: torch.Tensor) -> tuple[bool, list[Spec], int]:
    """Whether the message is a tuple, each tensor's dtype and shape (``None`` where it sent none), payload bytes."""
    words = header[:HEADER_BYTES].view(torch.int64).tolist()
    specs: list[Spec] = []
    i = 3
    for _ in range(words[1]):
        if words[i] == -1:
            specs.append(None)
            i += 1
            continue
        ndim = words[i + 1]
        specs.append((DTYPES[words[i]], tuple(words[i + 2 : i + 2 + ndim])))
        i += 2 + ndim
    return bool(words[0]), specs, words[2]


def split_sizes(size: int, expect: int | None) -> tuple[int, int]:
    """How a payload of ``size`` bytes crosses a link that expects ``expect``: ``(first, rest)``, the bytes of the
    first data message (``expect`` when known: padded, or cut where the payload is larger) and of the second
    (0: none)."""
    if expect is None:
        return size, 0
    return expect, max(0, size - expect)


# references to a storage; private in torch: without it every message gets a new buffer
USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


class Buffers:
    """Byte buffers on one device, each reused once nothing refers to it any more.

    A fresh buffer per message doubles the cost of a 512 KiB hop over gloo here (0.31 against 0.15 ms,
    the new pages fault in during gloo's copy). ``take`` hands out a view of a buffer; the view, the
    views ``views`` cuts from it and anything autograd saved from those hold the buffer's storage, so a
    buffer whose storage only this pool holds is free, once the copy ``fence`` names is done. The pool
    grows to the most buffers in use at once; a buffer holds at least ``nbytes``.

    Args:
        nbytes: the smallest buffer.
        device: where the buffers are.
        pin: page-locked host memory (host buffers that GPU copies read and write asynchronously).
    """

    def __init__(self, nbytes: int, device: torch.device | str = "cpu", pin: bool = False) -> None:
        self.nbytes = nbytes
        self.device = torch.device(device)
        self.pin = pin
        self.buffers: list[torch.Tensor] = []
        self.fences: dict[int, Any] = {}  # buffer index -> a CUDA event that a copy from it must reach first
        self._next = 0

    def _new(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin)

    def take(self, nbytes: int = 0) -> torch.Tensor:
        """A free buffer (a view of all of it) of at least ``nbytes`` and the pool's smallest size."""
        need = max(nbytes, self.nbytes)
        if USE_COUNT is None:
            return self._new(need)
        for i in range(len(self.buffers)):
            j = (self._next + i) % len(self.buffers)
            buffer = self.buffers[j]
            # the pool's tensor and the probe's storage object: nothing else refers to this buffer
            if buffer.numel() >= need and USE_COUNT(buffer.untyped_storage()._cdata) == 2 and self._done(j):
                self._next = j + 1
                return buffer[:]
        self.buffers.append(self._new(need))
        return self.buffers[-1][:]

    def _done(self, j: int) -> bool:
        fence = self.fences.get(j)
        if fence is None or fence.query():
            self.fences.pop(j, None)
            return True
        return False

    def fence(self, view: torch.Tensor, event: Any) -> None:
        """``view``'s buffer is read by a copy that completes at ``event`` (``torch.cuda.Event``): reuse it after."""
        ptr = view.untyped_storage().data_ptr()
        for j, buffer in enumerate(self.buffers):
            if buffer.untyped_storage().data_ptr() == ptr:
                self.fences[j] = event
                return
