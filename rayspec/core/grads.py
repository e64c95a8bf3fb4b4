"""A stage's gradients before its update: the non-finite check and gradient-norm clipping.

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

__all__ = ["non_finite_grad", "tensor_norms", "total_norm", "clip_scale", "check_and_clip", "EPS"]

EPS = 1e-6
"""Added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does."""


def non_finite_grad(module: torch.nn.Module) -> str | None:
    """The name of the first parameter whose gradient holds a NaN or an infinity, if any.

    A finite sum proves every element finite, and summing is one vectorized pass (``isfinite``
    or an infinity norm costs 20-30x more on CPU); only a non-finite sum, which finite but huge
    gradients can also give, is checked element by element.
    """
    named = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None]
    if not named or torch.isfinite(torch.stack([g.sum() for _, g in named])).all():
        return None
    return next((name for name, g in named if not torch.isfinite(g).all()), None)


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


def check_and_clip(module: torch.nn.Module, params: Sequence[torch.nn.Parameter], max_norm: float | None,
                   norms: Sequence[torch.Tensor] | None = None, own: torch.Tensor | None = None) -> str | None:
    """Before an update: check the gradients of ``params`` (of ``module``) and clip them to ``max_norm`` (None: no
    clipping) by the norm over ``norms`` (every stage's ``tensor_norms``, stage 0's first) or, without them, by
    their own (``own``: their ``tensor_norms`` if known). Returns what is wrong (``"the gradient of 0.weight is not finite"``) or None; nothing is clipped
    then.

    The check is one foreach norm over the gradients (as fast as the sum that ``non_finite_grad`` takes, in one
    call), which clipping needs anyway: finite norms prove every element finite; otherwise ``non_finite_grad``
    looks element by element (a norm of finite but huge gradients can overflow, and passes).
    """
    grads = [p.grad for p in params if p.grad is not None]
    own = tensor_norms(grads) if own is None else own
    if not bool(torch.isfinite(own).all()) and (bad := non_finite_grad(module)) is not None:
        return f"the gradient of {bad} is not finite"
    if max_norm is None:
        return None
    norm = total_norm([own] if norms is None else norms)
    if not bool(torch.isfinite(norm)):
        return f"the gradient norm over {'all stages' if norms is not None else 'the stage'} is {float(norm)}"
    if grads:
        torch._foreach_mul_(grads, clip_scale(norm, max_norm).to(grads[0].device))
    return None
