"""What crosses a process boundary between the driver and the stage actors: tensors as numpy arrays where Ray
ships those faster, and the dtypes the stage-to-stage paths carry."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["DTYPES", "NUMPY_DTYPES", "to_wire", "as_tensors", "own"]

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
"""The tensor dtypes a stage may hand to its neighbour; a ``p2p`` message header names one by its index here."""
NUMPY_DTYPES = frozenset(DTYPES) - {torch.bfloat16}
"""The ones numpy has (not bfloat16): these travel as numpy arrays."""


def to_wire(x: Any, host: bool = True) -> Any:
    """What goes to another process: CPU tensors as numpy arrays (Ray's channels and the object store copy
    those about 25x faster than pickled tensors, ``benchmarks.hops``); GPU tensors too when ``host``
    (stages that share a GPU: NCCL refuses two ranks on one device), else as they are, for NCCL; other
    dtypes as they are."""
    if isinstance(x, torch.Tensor) and x.dtype in NUMPY_DTYPES and (host or x.device.type == "cpu"):
        return x.detach().cpu().numpy()
    if isinstance(x, tuple):
        return tuple(to_wire(t, host) for t in x)
    return x


def as_tensors(x: Any, copy: bool = True) -> Any:
    """Numpy arrays that came over the wire as tensors (copied: Ray hands out read-only memory; ``copy=False``
    for a caller that copies them on, to a GPU say); the rest as is."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.copy() if copy else x)
    if isinstance(x, tuple):
        return tuple(as_tensors(t, copy) for t in x)
    return x


def own(x: Any) -> Any:
    """A private tensor copy of what a channel delivered: a channel's buffer is reused by its next write."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    return as_tensors(x) if not isinstance(x, tuple) else tuple(own(t) for t in x)
