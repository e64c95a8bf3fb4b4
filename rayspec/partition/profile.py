"""Per-block profiling: forward and backward time, parameters and output activation size of each block."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rayspec.core.activations import activation_bytes, map_tensors, tensors

__all__ = ["BlockProfile", "profile_blocks"]


@dataclass(frozen=True)
class BlockProfile:
    """What one block costs on one sample input.

    Attributes:
        forward_s: median seconds of the block's forward (the last block's includes its loss).
        backward_s: median seconds of the block's backward from the incoming output gradient
            (gradients of its parameters and of its float inputs; 0 when there is none).
        parameters: scalars in the block's parameters.
        output_bytes: bytes of the block's output activation (all tensors of a tuple output).
    """

    forward_s: float
    backward_s: float
    parameters: int
    output_bytes: int

    @property
    def seconds(self) -> float:
        """Forward plus backward seconds."""
        return self.forward_s + self.backward_s


def _leaf(x: Any, requires_grad: bool) -> Any:
    """``x`` detached, float tensors requiring grad when ``requires_grad`` (a stage's input)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.requires_grad_(True) if requires_grad and t.is_floating_point() else t

    return map_tensors(one, x)


def _loss(out: Any, device: torch.device) -> torch.Tensor:
    """Cross-entropy on random labels for ``(B, C)`` logits, else the sum of the float outputs."""
    if isinstance(out, torch.Tensor) and out.dim() == 2 and out.is_floating_point() and out.shape[1] > 1:
        labels = torch.randint(out.shape[1], (out.shape[0],), device=out.device)
        return nn.functional.cross_entropy(out, labels)
    floats = [t.float().sum() for t in tensors(out) if t.is_floating_point()]
    return torch.stack(floats).sum() if floats else torch.zeros((), device=device)


def _backward(block: nn.Module, inp: Any, out: Any, grad: Any, params: Sequence[torch.Tensor]) -> Any:
    """Gradients of ``block``'s float inputs (a tuple shaped like ``inp``'s tensors, None where none)."""
    pairs = [(o, g) for o, g in zip(tensors(out), _tensors_or_none(grad)) if g is not None and o.requires_grad]
    leaves = [t for t in tensors(inp) if t.requires_grad]
    if not pairs or not (leaves or params):
        return tuple(None for _ in tensors(inp))
    grads = torch.autograd.grad([o for o, _ in pairs], leaves + list(params), [g for _, g in pairs], allow_unused=True)
    it = iter(grads[: len(leaves)])
    return tuple(next(it) if t.requires_grad else None for t in tensors(inp))


def _tensors_or_none(x: Any) -> Iterator[torch.Tensor | None]:
    if x is None or isinstance(x, torch.Tensor):
        yield x
    else:
        for item in x:
            yield from _tensors_or_none(item)


def profile_blocks(
    model: nn.Sequential, sample_input: Any, device: str | torch.device = "cpu", warmup: int = 2, repeats: int = 5
) -> list[BlockProfile]:
    """Time every block's forward and backward on ``sample_input``, as a pipeline stage would run it.

    The blocks run in sequence in training mode on a copy of ``model`` (its weights, gradients,
    BatchNorm statistics and the random number generators are left as they were). Each block's
    input is detached (float tensors requiring grad, except the first block's), so each forward
    and each backward is timed on its own; the backward of block ``i`` gets the input gradient the
    backward of block ``i + 1`` produced, and the last block's loss is a cross-entropy on random
    labels (or the sum of its float outputs). Times are medians over ``repeats`` runs after
    ``warmup`` untimed ones; on CUDA each is bracketed by ``torch.cuda.synchronize``.

    Args:
        model: an ``nn.Sequential`` of blocks.
        sample_input: a batch of the model's input, a tensor or a tuple of tensors.
        device: where to run, e.g. ``"cpu"`` or ``"cuda:0"``.
        warmup: untimed runs first (at least 0).
        repeats: timed runs (at least 1).

    Returns:
        One ``BlockProfile`` per block.

    Raises:
        ValueError: for a negative ``warmup``, ``repeats < 1`` or an empty ``model``.
    """
    _check_profile(model, warmup, repeats)
    device = torch.device(device)
    blocks = list(copy.deepcopy(model).to(device).train())
    params = [[p for p in b.parameters() if p.requires_grad] for b in blocks]
    x0 = map_tensors(lambda t: t.to(device), sample_input)
    cuda = device.type == "cuda"
    n = len(blocks)
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.manual_seed(0)
        for run in range(warmup + repeats):
            forward_s, backward_s, out_bytes = _one_pass(blocks, params, x0, device)
            if run >= warmup:
                for i in range(n):
                    fwd[i].append(forward_s[i])
                    bwd[i].append(backward_s[i])
    return [
        BlockProfile(statistics.median(fwd[i]), statistics.median(bwd[i]), sum(p.numel() for p in blocks[i].parameters()),
                     out_bytes[i])
        for i in range(n)
    ]


def _check_profile(model: nn.Sequential, warmup: int, repeats: int) -> None:
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an integer >= 0")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1; time at least one run")
    if len(model) == 0:
        raise ValueError("profile_blocks needs a model with at least one block, got an empty nn.Sequential")


def _one_pass(blocks: list[nn.Module], params: Sequence[Sequence[torch.Tensor]], x0: Any, device: torch.device
              ) -> tuple[list[float], list[float], list[int]]:
    """Every block's forward, then every block's backward from the last, each on its own detached input:
    seconds forward and backward per block, and the bytes of each block's output."""
    cuda = device.type == "cuda"

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    n = len(blocks)
    fwd, bwd, out_bytes = [0.0] * n, [0.0] * n, [0] * n
    x, saved = x0, []
    for i, block in enumerate(blocks):
        inp = _leaf(x, requires_grad=i > 0)
        t0 = clock()
        out = block(inp)
        loss = _loss(out, device) if i == n - 1 else None
        fwd[i] = clock() - t0
        out_bytes[i] = activation_bytes(out)
        saved.append((inp, loss if loss is not None else out))
        x = out
    grad: Any = torch.ones((), device=device)
    for i in reversed(range(n)):
        inp, out = saved[i]
        t0 = clock()
        grad = _backward(blocks[i], inp, out, grad, params[i])
        bwd[i] = clock() - t0
        saved.pop()
    return fwd, bwd, out_bytes
