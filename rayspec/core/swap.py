"""Other weights in a stage's parameter storage for one action, restored bit-exactly afterwards.

SpecTrain's predicted weights and PipeDream's stashed ones take the parameter storage's place for
one action (docs/design.md §2, memory). The storage and the other tensor exchange their memory by
pointer (``UntypedStorage._swap_data_ptr_``, the call torch's CUDA graph trees use) and exchange it
back afterwards: the stored weights are never copied, and every alias of the storage, autograd's
saved views included, sees the swapped-in weights during the action.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["SWAP_STORAGE", "Swap", "WeightSwap", "swap_in", "swap_out"]

SWAP_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
"""Exchange two tensors' memory by pointer; without it, or for a tensor that shares its storage, ``swap_in``
copies."""

Swap = torch.Tensor | tuple[torch.Tensor, float, float] | None
"""Per parameter: ``None`` (keep it), ``w`` (the storage holds ``w``) or ``(d, a, b)`` (the storage holds
``a * W + b * d``, computed into the scratch copy: a prediction, ``rayspec.core.predict``)."""


def _owns_storage(t: torch.Tensor) -> bool:
    return bool(t.is_contiguous() and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def swap_in(w: torch.Tensor, t: torch.Tensor) -> torch.Tensor | None:
    """Put ``t``'s contents into ``w`` (one shape, dtype and device): by exchanging their memory where each
    owns its whole storage (returns ``None``), else by copy (returns a copy of ``w``'s contents)."""
    if SWAP_STORAGE and _owns_storage(w) and _owns_storage(t):
        w.untyped_storage()._swap_data_ptr_(t.untyped_storage())  # type: ignore[attr-defined]
        return None
    held = w.clone()
    w.copy_(t)
    return held


def swap_out(w: torch.Tensor, t: torch.Tensor, held: torch.Tensor | None) -> None:
    """Undo ``swap_in``: ``w`` holds its own contents again and ``t`` its own."""
    if held is None:
        w.untyped_storage()._swap_data_ptr_(t.untyped_storage())  # type: ignore[attr-defined]
    else:
        w.copy_(held)


class WeightSwap:
    """Context that puts other weights into ``params``' storage and restores them bit-exactly on exit.

    Args:
        params: the stage's parameters, or tensors that share their storage objects (``p.data``, the
            optimizer's aliases: no new tensor per parameter and action).
        swaps: per parameter, a ``Swap`` (see its doc); ``None`` keeps every parameter.
        scratch: the stage's one scratch copy of its parameters (allocated on first use), which
            predictions are computed into.
    """

    def __init__(self, params: Sequence[torch.Tensor], swaps: Sequence[Swap] | None,
                 scratch: Callable[[], list[torch.Tensor]]) -> None:
        self.params, self.swaps, self.scratch = params, swaps, scratch
        self.swapped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def __enter__(self) -> None:
        if self.swaps is None:
            return
        with torch.no_grad():
            scratch = None
            for i, (p, swap) in enumerate(zip(self.params, self.swaps)):
                if swap is None:
                    continue
                w = p.data if isinstance(p, torch.nn.Parameter) else p  # .data: its own version counter
                if isinstance(swap, torch.Tensor):
                    t = swap
                else:  # the prediction goes into the scratch copy
                    d, a, b = swap
                    scratch = scratch or self.scratch()
                    t = scratch[i]
                    if a == 1.0:
                        torch.add(w, d, alpha=b, out=t)
                    else:
                        torch.mul(w, a, out=t).add_(d, alpha=b)
                self.swapped.append((w, t, swap_in(w, t)))

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for w, t, held in reversed(self.swapped):
                swap_out(w, t, held)
        self.swapped = []
