"""A stage's gradients before its update: gradient-norm clipping (the non-finite check is ``rayspec.core.finite``'s).

[Note: clipping] ``optim.clip_grad_norm`` scales the gradients by ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does. Where the pipeline flushes (``vanilla``, ``gpipe``) ``norm`` is the
global one, over every stage: each stage computes the norms of its own gradients (``tensor_norms``), the
executor gathers them in stage order, and every stage takes the norm of the whole vector
(``total_norm``): the same numbers, in the same order, as ``clip_grad_norm_`` on the whole model in one
process, so the result is bit-exact. Where it does not flush (``async``, ``pipedream``, ``spectrain``) no
update of one stage waits for another, and each stage clips by the norm of its own gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["tensor_norms", "total_norm", "clip_scale", "clip_grads", "EPS"]

EPS = 1e-6
"""Added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does."""


def tensor_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of each gradient, as a vector ``(len(grads),)`` on the gradients' device (torch's foreach norm,
    as ``clip_grad_norm_`` computes them)."""
    if not grads:
        return torch.zeros(0)
    return torch.stack(torch._foreach_norm(list(grads), 2))


def total_norm(norms: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the gradients whose ``tensor_norms`` are ``norms`` (stage 0's first), as one scalar tensor."""
    parts = [n.reshape(-1) for n in norms]
    if not parts:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.cat([n.to(parts[0].device) for n in parts]), 2)


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor ``clip_grad_norm_`` multiplies the gradients by: ``min(1, max_norm / (norm + 1e-6))``."""
    return torch.clamp(max_norm / (norm + EPS), max=1.0)


def clip_grads(grads: Sequence[torch.Tensor], max_norm: float, norms: Sequence[torch.Tensor]) -> str | None:
    """Clip ``grads`` in place to 2-norm ``max_norm`` by the norm over ``norms`` (``tensor_norms`` of these gradients,
    or of every stage's, stage 0's first). Returns what is wrong (``"the gradient norm over all stages is nan"``)
    or None; nothing is clipped then. The check for non-finite gradients themselves is ``rayspec.core.finite``'s.
    """
    norm = total_norm(norms)
    if not bool(torch.isfinite(norm)):
        return f"the gradient norm over {'all stages' if len(norms) > 1 else 'the stage'} is {float(norm)}"
    if grads:
        torch._foreach_mul_(list(grads), clip_scale(norm, max_norm).to(grads[0].device))
    return None
