"""Mixed precision (``train.precision``): what a stage computes in, and the dtype of what it hands on.

``fp32`` computes and hands on float32. ``bf16`` runs a stage's forward (and a recomputed one) under
``torch.autocast`` on its device, and hands its float activations on in bfloat16, so the input gradients
coming back are bfloat16 too: half the bytes across every stage boundary. The weights, their gradients,
the optimizer's state and SpecTrain's predictions stay float32 (autocast casts a weight for each op; the
gradient of the cast is float32). Integer and boolean tensors (token ids, masks) pass unchanged.
"""

from __future__ import annotations

import contextlib

import torch

from rayspec.core.activations import Activation, map_tensors

__all__ = ["PRECISIONS", "autocast", "boundary"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
"""``train.precision`` -> the dtype a stage computes in under autocast and hands on (None: float32, no autocast)."""


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The context a stage's forward runs in."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def boundary(x: Activation, precision: str) -> Activation:
    """A stage's output as it goes to the next stage: float tensors in the precision's dtype (the cast is part of
    the graph, so its backward takes the next stage's gradient in that dtype)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return x
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, x)
