"""The backward split in two, as zero-bubble schedules run it: ``I`` (the input gradient, which the previous stage
waits for) now, ``W`` (the weight gradient) later, from the graph ``I`` kept (``rayspec.core.stage``'s ``Stage``
has these as methods).

[Note: split backward] As torch's ``stage_backward_input``, ``I`` runs autograd on the stage's outputs with
``inputs=`` the stage's input leaves and ``retain_graph=True``: only the input gradient is computed, and the
graph stays. ``W`` runs autograd again on the kept outputs and output gradients with ``inputs=`` the parameters:
the weight gradients accumulate into ``p.grad``, where ``B`` puts them, so the update is unchanged. torch's
``stage_backward_weight`` instead resumes from the intermediate ``grad_fn`` nodes and skips the path to the
input; this re-traverses it (a second walk of the graph, no forward recomputed). On stage 0 nothing needs the
input gradient: its ``I`` only keeps the output gradient and its ``W`` is the whole backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rayspec.core.activations import Activation, activation_bytes, detach, flat, input_grad
from rayspec.core.rng import set_rng_state

__all__ = ["SplitBackward"]


class SplitBackward:
    """``backward_input`` (``I``) and ``backward_weight`` (``W``) of a ``Stage``; they need no staleness policy
    (the schedules that split the backward are synchronous)."""

    # provided by Stage
    index: int
    is_first: bool
    is_last: bool
    policy: str
    version: int
    pending: int
    waiting: bool
    clip_grad_norm: float | None
    clip_scope: str
    device: torch.device
    params: list[torch.nn.Parameter]
    inflight: dict[int, Any]
    weights: Any
    stats: Any
    clock: Any
    rng: Any
    _rng_devices: list
    _check_ready: Callable[[str, int], None]
    _account: Callable[[str, Any, int], None]
    _output: Callable[[Activation], Activation]
    _loss: Callable[[Activation, torch.Tensor], torch.Tensor]
    step: Callable[[], None]

    def backward_input(self, m: int, grad: Activation | None = None) -> Activation | None:
        """Run ``I(m)`` with the gradient of the stage output (none on the last stage); return the input gradient.
        The graph and the output gradient stay for ``backward_weight(m)`` ([Note: split backward])."""
        t0 = self.clock.start(self.device)
        self._check_split("I", m)
        job = self.inflight[m]
        with self.weights.backward(m, 0, self.version, job.version):
            if job.outputs is None:  # recompute at the weights in storage now; W reuses this graph
                with torch.random.fork_rng(devices=self._rng_devices):
                    set_rng_state(job.rng, self.device)
                    job.outputs = self._loss(job.inputs, job.labels) if self.is_last else self._output(job.inputs)
            if self.is_last:
                roots, grads = [job.outputs], [None]
            else:
                pairs = [(o, g) for o, g in zip(flat(job.outputs), flat(grad)) if g is not None and o.requires_grad]
                roots, grads = [o for o, _ in pairs], [g.to(self.device) for _, g in pairs]
            job.split = (roots, grads)
            leaves = [t for t in flat(job.inputs) if t.requires_grad]
            if leaves and roots:
                torch.autograd.backward(roots, grads, inputs=leaves, retain_graph=True)
        grad_in = None if self.is_first else input_grad(job.inputs)
        if grad_in is not None:
            self.stats.sent_bytes["B"] += activation_bytes(grad_in)
        if self.weights.record:
            self.weights.records[-1].update(inputs=detach(job.inputs), grad_output=grad, labels=job.labels)
        self._account_split("I", t0, m)
        return grad_in

    def backward_weight(self, m: int, update: bool = False) -> None:
        """Run ``W(m)``: the weight gradients of ``I(m)``'s kept graph into ``p.grad``; ``update`` steps the
        optimizer after it (with global clipping: leaves the update waiting, as ``backward`` does)."""
        t0 = self.clock.start(self.device)
        self._check_split("W", m)
        job = self.inflight.pop(m)
        roots, grads = job.split
        with self.weights.backward(m, 0, self.version, job.version):
            if roots:
                torch.autograd.backward(roots, grads, inputs=self.params)
        job.outputs = job.split = None  # the graph goes now
        if self.weights.record:
            self.weights.records[-1].update(grads=[None if p.grad is None else p.grad.clone() for p in self.params])
        self._gradient_done(update)
        self._account_split("W", t0, m)

    def _gradient_done(self, update: bool) -> None:
        """A micro-batch's weight gradient is complete (``B`` or ``W``): count it, and update when ``update`` says so,
        or wait for every stage's norm first under global clipping."""
        self.pending += 1
        if update:
            if self.clip_grad_norm is not None and self.clip_scope == "global":
                self.waiting = True
            else:
                self.step()

    def _check_split(self, kind: str, m: int) -> None:
        self._check_ready(kind, m)
        if self.policy != "none":
            raise RuntimeError(f"stage {self.index}: {kind}({m}) splits the backward, which only the synchronous "
                               f"methods do; this stage's staleness policy is {self.policy}")
        job = self.inflight.get(m)
        if job is None or (kind == "W") != (job.split is not None):
            before = "F" if kind == "I" else "I"
            raise RuntimeError(f"stage {self.index}: {kind}({m}) needs {before}({m}) first, and once")

    def _account_split(self, kind: str, t0: Any, m: int) -> None:
        self.stats.actions.setdefault(kind, 0)
        self.stats.busy_s.setdefault(kind, 0.0)
        self._account(kind, t0, m)
