"""What flows between stages: a tensor, or a (nested) tuple of tensors; helpers over both forms."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Activation", "tensors", "map_tensors", "activation_bytes", "flat", "detach", "as_input", "input_grad"]

Activation = Any  # a tensor, or a tuple of tensors


def tensors(x: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``x``, depth first."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for item in x:
            yield from tensors(item)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], x: Any) -> Any:
    """``x`` with ``fn`` applied to every tensor, the nesting kept."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(map_tensors(fn, item) for item in x)
    return x


def activation_bytes(x: Any) -> int:
    """Bytes of every tensor in ``x``, a tensor or a (nested) tuple of tensors."""
    return sum(t.numel() * t.element_size() for t in tensors(x))


def flat(x: Activation) -> tuple:
    """The top-level entries of ``x`` as a tuple (one entry for a tensor)."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def detach(x: Activation) -> Activation:
    return tuple(t.detach() for t in x) if isinstance(x, (tuple, list)) else x.detach()


def as_input(x: Activation, device: torch.device, requires_grad: bool) -> Activation:
    """A stage's input: on ``device``, detached, float tensors requiring grad when ``requires_grad``."""

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device).detach()
        if requires_grad and t.is_floating_point():
            t.requires_grad_(True)
        return t

    return tuple(one(t) for t in x) if isinstance(x, (tuple, list)) else one(x)


def input_grad(inputs: Activation) -> Activation:
    """The gradient of each input (``None`` where it needs none), shaped like ``inputs``."""
    grads = tuple(t.grad if t.requires_grad else None for t in flat(inputs))
    return grads if isinstance(inputs, tuple) else grads[0]
