"""A stage's own random stream (dropout): saved and restored around each action, so the numbers do not depend
on how stages interleave or on which process runs them."""

from __future__ import annotations

import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state(device: torch.device) -> tuple[torch.Tensor, ...]:
    """The CPU generator's state, and the CUDA one of ``device`` when it is a GPU."""
    state = [torch.get_rng_state()]
    if device.type == "cuda":
        state.append(torch.cuda.get_rng_state(device))
    return tuple(state)


def set_rng_state(state: tuple[torch.Tensor, ...] | None, device: torch.device) -> None:
    """Restore ``rng_state``'s output (nothing for ``None``)."""
    if state is None:
        return
    torch.set_rng_state(state[0])
    if device.type == "cuda" and len(state) > 1:
        torch.cuda.set_rng_state(state[1], device)
