"""A stage's checks for non-finite losses and gradients, without a host round trip per micro-batch on a GPU.

On CPU a check is a read of a number the stage has anyway, and raises at once. On a GPU reading a
number waits for every kernel queued before it, so each check would stall the stage's stream once per
micro-batch; there the checks keep a flag on the device and ``flush`` reads them all at once, once per
chunk (``pop_losses``) and at the end of a segment. The error then names the first micro-batch or
update that went wrong; the stage's later numbers are not used, as the run stops.
"""

from __future__ import annotations

import math

import torch

__all__ = ["FiniteChecks"]

_FIX = "lower optim.lr or add warm-up (optim.warmup)"


class FiniteChecks:
    """Args:
        stage: the stage index (for the messages).
        defer: keep flags and raise at ``flush`` (default: for tensors on a GPU only).
    """

    def __init__(self, stage: int, defer: bool | None = None) -> None:
        self.stage = stage
        self.defer = defer
        self.losses: list[tuple[int, int, torch.Tensor]] = []  # (micro-batch, update, loss)
        self.grads: list[tuple[int, list[str], torch.Tensor]] = []  # (update, names, finite flags)

    def _deferred(self, t: torch.Tensor) -> bool:
        return t.is_cuda if self.defer is None else self.defer

    def loss(self, loss: torch.Tensor, m: int, update: int) -> None:
        """Check the last stage's loss of micro-batch ``m`` (during ``update``); raises ``FloatingPointError``."""
        if self._deferred(loss):
            self.losses.append((m, update, loss.detach().reshape(())))
            return
        if not math.isfinite(value := float(loss.detach())):
            raise FloatingPointError(self._loss_message(m, value, update))

    def grads_of(self, module: torch.nn.Module, update: int, norms: torch.Tensor | None = None) -> None:
        """Check the gradients ``update`` is about to apply; raises ``FloatingPointError`` naming the first bad one.

        A finite sum proves every element finite, and summing is one vectorized pass (``isfinite`` or an
        infinity norm costs 20-30x more on CPU, torch's foreach 2-norm about 2x: ``benchmarks.stage_cost``);
        ``norms``, the gradients' 2-norms in ``module``'s parameter order when clipping has them anyway, serve
        as well. Only a non-finite value, which finite but huge gradients can also give, is checked element by
        element on CPU. Deferred, a non-finite value counts as non-finite.
        """
        named = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None]
        if not named:
            return
        values = norms if norms is not None else torch.stack([g.sum() for _, g in named])
        if self._deferred(values):
            self.grads.append((update, [name for name, _ in named], torch.isfinite(values)))
            return
        if torch.isfinite(values).all():
            return
        bad = next((name for name, g in named if not torch.isfinite(g).all()), None)
        if bad is not None:
            raise FloatingPointError(self._grad_message(bad, update))

    def flush(self) -> None:
        """Read the deferred flags (one synchronization) and raise for the earliest non-finite one, if any."""
        losses, self.losses = self.losses, []
        grads, self.grads = self.grads, []
        errors: list[tuple[int, str]] = []
        if losses:
            values = torch.stack([v for _, _, v in losses]).tolist()
            errors += [(u, self._loss_message(m, v, u)) for (m, u, _), v in zip(losses, values) if not math.isfinite(v)]
        if grads:
            flags = torch.cat([f for _, _, f in grads]).tolist()
            at = 0
            for update, names, _ in grads:
                bad = [name for name, ok in zip(names, flags[at : at + len(names)]) if not ok]
                at += len(names)
                if bad:
                    errors.append((update, self._grad_message(bad[0], update)))
        if errors:
            raise FloatingPointError(min(errors, key=lambda e: e[0])[1])

    def _loss_message(self, m: int, value: float, update: int) -> str:
        return f"the loss of micro-batch {m} is {value} at update {update} on stage {self.stage} (the last); {_FIX}"

    def _grad_message(self, name: str, update: int) -> str:
        return f"the gradient of {name} is not finite at update {update} on stage {self.stage}; {_FIX}"
