"""The ``p2p`` transports' messages, the sizes both ends agree on, and the pool of buffers they travel in.

[Note: messages] A message is a fixed-size header (tuple or not, each tensor's dtype and shape, ``None``
for an input without a gradient, the payload's size) and a payload (the tensors' bytes, each at a
multiple of ``_ALIGN``), sent over the data group of its link: gloo (``p2p``) or NCCL (``p2p_nccl``).
The same code runs both; the backends differ in the groups, the tags and where headers go. NCCL
matches messages in the order they are posted and only at exactly the size sent, so the protocol keeps
to that on gloo as well (each link's messages are matched in order, at the size sent):

* per directed link (stage ``a`` to ``b``, activations or gradients) both ends keep ``expect``, the
  payload size of the link's last message (``Link``). The receiver posts the next payload's receive
  ahead at that size, before the header arrives (a pipeline's messages rarely change size);
* a payload of ``S`` bytes goes as ``max(S, expect)`` bytes when it fits (padding after it), else as
  ``expect`` bytes and then the other ``S - expect`` bytes; the first message of a link goes at its
  own size, once the receiver has read its header;
* on host buffers (gloo), once ``expect`` is known and at most ``FOLD_BYTES``, the header travels in
  front of the payload, in the same data message (``HEADER_BYTES + expect`` bytes posted ahead): one
  message per hop instead of two, for a copy of the payload into a pooled buffer. Otherwise (a link's
  first message, larger payloads, NCCL, whose buffers are on the GPU where the host cannot read a
  header without a synchronization) the header goes alone over the stage actors' gloo group, matched
  by the message's tag, and a single tensor of the agreed size is sent from its own bytes. Both ends
  decide from ``expect``, so they agree;
* NCCL: one data group per pair of neighbours and direction, of those two ranks only: a NCCL send
  waits for its receive, and a communicator runs its operations in the order they were posted, so a
  receive posted ahead in one direction would hold up a send in the other on a shared communicator;
  and a communicator of more ranks would be created by all of them at once, each waiting on the
  others. gloo matches a message by its sender and tag and holds no such order across them: one data
  group of every stage actor carries every link, each directed link with a tag of its own (each
  gloo group has threads of its own; a ping-pong over two groups took 0.21 ms a hop here, over one
  0.18 ms).

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

__all__ = ["HEADER_BYTES", "CAPACITY", "FOLD_BYTES", "MIN_PAYLOAD", "Spec", "Link", "pack", "payload_bytes", "encode", "views",
           "read_header", "split_sizes", "Buffers", "as_bytes"]

_HEADER_WORDS = 64  # int64: [is_tuple, count, payload bytes, then per tensor (dtype code or -1 for None, ndim, *shape)]
HEADER_BYTES = 8 * _HEADER_WORDS
_ALIGN = 64  # each tensor's bytes start at a multiple of this in the payload
MIN_PAYLOAD = _ALIGN
"""A payload is never empty (a message of ``None`` and empty tensors still sends this many bytes)."""
CAPACITY = 1 << 20
"""Bytes of a pooled buffer at the least: room for a payload that grows without a new buffer."""
FOLD_BYTES = 1 << 20
"""The largest payload whose header travels in the same message on host buffers (the payload is then copied in
behind the header). Measured between two stage actors here (ping-pong, 10 interleaved rounds), a hop took 0.37
against 0.51 ms at 512 KiB and 0.78 against 0.91 ms at 1 MiB with the header in front than with it apart: up to
1 MiB at least, the copy costs less than the message it saves; larger payloads keep the zero-copy send."""

Spec = tuple[torch.dtype, tuple[int, ...]] | None


@dataclass
class Link:
    """What both ends of one directed link know alike: the payload size the receiver posts next (None: unknown)."""

    expect: int | None = None


_HEADERS: dict[tuple, torch.Tensor] = {}
"""Headers by the message's layout (tuple or not, each tensor's dtype and shape): a pipeline sends few layouts, and
building one costs several tensor operations per message."""
_LAYOUTS: dict[bytes, tuple[bool, list[Spec], int, list]] = {}
"""What a header says, by its bytes: ``read_header``'s answer and where each tensor starts (``views``)."""
_CACHED = 1024  # layouts kept at the most: a run whose shapes never repeat gets no cache worth keeping


def pack(value: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The header of ``value`` (a tensor or a tuple of tensors and ``None``) as CPU bytes, and its tensors
    (contiguous, detached, where they are). The header is shared by messages of one layout: read it only."""
    flat = tuple(value) if isinstance(value, tuple) else (value,)
    layout = (isinstance(value, tuple), *(None if t is None else (t.dtype, t.shape) for t in flat))
    header = _HEADERS.get(layout)
    if header is None:
        header = _header(value, flat)
        if len(_HEADERS) >= _CACHED:
            _HEADERS.clear()
        _HEADERS[layout] = header
    return header, [t.detach().contiguous() for t in flat if t is not None]


def _header(value: Any, flat: tuple) -> torch.Tensor:
    words = [int(isinstance(value, tuple)), len(flat), 0]  # word 2: the payload's bytes
    nbytes = []
    for t in flat:
        if t is None:
            words.append(-1)
            continue
        if t.dtype not in DTYPES:
            raise TypeError(f"pipeline.transport=p2p sends tensors of {', '.join(map(str, DTYPES))}; got {t.dtype}")
        words += [DTYPES.index(t.dtype), t.dim(), *t.shape]
        nbytes.append(t.numel() * t.element_size())
    if len(words) > _HEADER_WORDS:
        raise ValueError(f"pipeline.transport=p2p: a message of {len(flat)} tensors needs a header of {len(words)} "
                         f"words, more than {_HEADER_WORDS}; use pipeline.transport=object_store")
    words[2] = _payload(nbytes)
    return torch.tensor(words + [-2] * (_HEADER_WORDS - len(words)), dtype=torch.int64).view(torch.uint8)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def payload_bytes(parts: list[torch.Tensor]) -> int:
    """Bytes of the payload of packed ``parts``: each tensor's aligned bytes, at least ``MIN_PAYLOAD``."""
    return _payload([t.numel() * t.element_size() for t in parts])


def _payload(nbytes: list[int]) -> int:
    return max(MIN_PAYLOAD, sum(_aligned(b) for b in nbytes))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, a flat ``uint8`` view."""
    return t.reshape(-1).view(torch.uint8)


def encode(parts: list[torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """Packed ``parts`` (``pack``) copied into the front of ``buffer`` (on the buffer's device: host to GPU or back
    asynchronously where the memory allows); the payload, a view of ``buffer``. Each tensor is copied at its own
    dtype (twice as fast here as a copy of its bytes)."""
    start = 0
    for t in parts:
        nbytes = t.numel() * t.element_size()
        buffer[start : start + nbytes].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
        start += _aligned(nbytes)
    return buffer[: max(MIN_PAYLOAD, start)]


def views(payload: torch.Tensor, is_tuple: bool, specs: list[Spec], starts: list | None = None) -> Any:
    """The tensors that a header (``read_header``) describes, as views into ``payload``: no copy (each tensor
    starts at a multiple of ``_ALIGN``; ``starts``: ``read_header``'s offsets, or computed here)."""
    if starts is None:
        starts = _starts(specs)
    out = [None if spec is None else payload[a:b].view(spec[0]).view(spec[1]) for spec, (a, b) in zip(specs, starts)]
    return tuple(out) if is_tuple else out[0]


def _starts(specs: list[Spec]) -> list[tuple[int, int]]:
    out, start = [], 0
    for spec in specs:
        nbytes = 0 if spec is None else math.prod(spec[1]) * spec[0].itemsize
        out.append((start, start + nbytes))
        start += _aligned(nbytes)
    return out


def read_header(header: torch.Tensor) -> tuple[bool, list[Spec], int, list[tuple[int, int]]]:
    """Whether the message is a tuple, each tensor's dtype and shape (``None`` where it sent none), payload bytes,
    and where each tensor's bytes are in the payload (for ``views``)."""
    key = header[:HEADER_BYTES].numpy().tobytes()
    known = _LAYOUTS.get(key)
    if known is not None:
        return known
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
    if len(_LAYOUTS) >= _CACHED:
        _LAYOUTS.clear()
    known = _LAYOUTS[key] = (bool(words[0]), specs, words[2], _starts(specs))
    return known


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
