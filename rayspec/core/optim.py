"""The stage optimizers (``optim.name``): torch's own, stepping aliases of a stage's parameters, and the step
each would take next, which SpecTrain's predictors extrapolate (``rayspec.core.predict``).

[Note: aliases] Asynchronous pipelines update a stage's weights between a micro-batch's forward and its
backward. A ``torch.optim`` optimizer given the parameters writes through them (``p.add_``), which bumps
their autograd version counter and makes the pending backward fail with "modified by an inplace
operation". Each stage's optimizer therefore steps *aliases*: the tensors ``p.data``, which share the
parameter's storage object but carry a version counter of their own. The update lands in the storage
and no pending backward sees a version change (``tests/test_optim.py``). Sharing the storage object, the
aliases also follow the pointer swap of ``rayspec.core.swap``, which exchanges the memory under it. The
aliases are made again whenever the parameters' tensors are replaced (``to``) and after unpickling
(``__setstate__``); the optimizer's state goes with them.

[Note: fused] Each optimizer runs torch's fused kernel where the device has one (``fused=True``, the default:
one pass over each parameter's weights, gradient and state; on CPU AdamW's is 5-7x faster than its
per-tensor loop and SGD's 1.4x), else its foreach kernel. The foreach kernels compute what torch's
per-tensor loops compute, bit for bit (and SGD's what the hand-written SGD that this module replaced
computed); the fused ones differ from them by rounding (they contract multiply-adds), so a test that wants
equality compares with torch's optimizer of the same kernel. With ``compile`` a predicting stage's update and
the prediction after it run as one compiled pass instead (``rayspec.core.fused``, [Note: one pass]; equal to
torch's step to rounding, its state in torch's format); ``direction_at`` gives the direction at a probe's
sampled positions without computing all of it.

[Note: the next step] SpecTrain extrapolates an optimizer's step. Each optimizer states the step it would
take next from its current state, if the state stayed as it is, as

    W  <-  (1 - lr * wd) * W  -  lr * D

with ``D`` its *direction* (``Optimizer.direction``; computed once per version) and ``wd`` its decoupled
weight decay (``decay``): for SGD ``D`` is the momentum buffer (weight decay included as it enters the
buffer; Nesterov's look-ahead not) and ``wd = 0``; for Adam and AdamW ``D = m_hat / (sqrt(v_hat) + eps)``
with the bias corrections of the next step, and ``wd`` is AdamW's weight decay (0 for Adam, whose decay
enters the gradient). The ``i``-th step ahead is ``factor(i)`` times that: 1 for SGD with its state as it
is, ``mu^i`` when no new gradient comes (the buffer decays); for Adam the ratio of the bias corrections,
times ``beta1^i / sqrt(beta2^i)`` when no new gradient comes (exact where ``eps`` is negligible against
``sqrt(v_hat)``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rayspec.core.fused import adam_step, sgd_step
from rayspec.errors import unknown

__all__ = ["OPTIMIZERS", "OptimSpec", "Optimizer", "Rule", "sgd_state"]


@dataclass(frozen=True)
class OptimSpec:
    """One optimizer's settings (``optim.*``; ``rayspec.config.sections.OptimConfig`` holds the defaults).

    Attributes:
        name: a key of ``OPTIMIZERS``.
        momentum, dampening, nesterov: SGD's.
        weight_decay: L2 for SGD and Adam (it enters the gradient), decoupled for AdamW.
        betas, eps: Adam's and AdamW's.
        fused: torch's fused kernels where the device has them, else (and with False) the foreach ones.
        compile: where a prediction follows the update, the step and the prediction as one compiled pass
            (``rayspec.core.fused``); torch's step everywhere else.
    """

    name: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    fused: bool = True
    compile: bool = False


class Rule(ABC):
    """What differs between optimizers: how torch builds one, its direction, its future steps, its decay."""

    name: str
    summary: str

    @abstractmethod
    def build(self, tensors: list[torch.Tensor], spec: OptimSpec, fused: bool) -> torch.optim.Optimizer:
        """torch's optimizer over ``tensors`` (the aliases), ``fused`` or foreach."""

    @abstractmethod
    def direction(self, opt: Optimizer) -> list[torch.Tensor | None]:
        """``D`` per parameter (None before its first step); see the module's note."""

    @abstractmethod
    def factor(self, spec: OptimSpec, version: int, i: int, decaying: bool) -> float:
        """The ``i``-th step ahead of ``version`` as a multiple of ``lr * D``: with the state as it is
        (``decaying=False``), or with no new gradient (``decaying=True``)."""

    def decay(self, spec: OptimSpec) -> float:
        """The decoupled weight decay ``wd`` of ``W <- (1 - lr * wd) * W - ...``."""
        return 0.0

    def direction_at(self, opt: Optimizer, index: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """``D`` per parameter at the flat positions ``index[k]`` only, equal to ``direction``'s there."""
        return [None if d is None else d.reshape(-1).index_select(0, i) for d, i in zip(self.direction(opt), index)]

    def fused_step(self, opt: Optimizer, lr: float, a: float, b: float, out: Sequence[torch.Tensor]) -> bool:
        """The step at ``lr`` and ``out = a * W + b * D`` of the new state in one pass (``rayspec.core.fused``);
        False, with nothing written, where this optimizer or its state has no such pass."""
        return False


class _SGD(Rule):
    name = "sgd"
    summary = "momentum SGD (torch.optim.SGD): momentum, dampening, nesterov, weight_decay (L2)"

    def build(self, tensors: list[torch.Tensor], spec: OptimSpec, fused: bool) -> torch.optim.Optimizer:
        kernel: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
        return torch.optim.SGD(tensors, lr=0.0, momentum=spec.momentum, dampening=spec.dampening,
                               weight_decay=spec.weight_decay, nesterov=spec.nesterov, **kernel)

    def direction(self, opt: Optimizer) -> list[torch.Tensor | None]:
        if opt.spec.momentum == 0:  # no buffer: the last step's direction, kept when asked (Optimizer.keep_last)
            return list(opt.last)
        state = opt.torch.state
        return [state[a].get("momentum_buffer") if a in state else None for a in opt.aliases]

    def factor(self, spec: OptimSpec, version: int, i: int, decaying: bool) -> float:
        return spec.momentum**i if decaying else 1.0

    def fused_step(self, opt: Optimizer, lr: float, a: float, b: float, out: Sequence[torch.Tensor]) -> bool:
        state = opt.torch.state
        buffers = [state[x].get("momentum_buffer") if x in state else None for x in opt.aliases]
        if opt.spec.momentum == 0 or any(t is None for t in buffers):  # no buffer yet: torch makes it
            return False
        grads = [p.grad for p in opt.params]
        return sgd_step(opt.aliases, grads, buffers, out, lr, opt.spec, a, b)  # type: ignore[arg-type]


class _Adam(Rule):
    def __init__(self, decoupled: bool) -> None:
        self.decoupled = decoupled
        self.name = "adamw" if decoupled else "adam"
        self.summary = (f"{'AdamW' if decoupled else 'Adam'} (torch.optim.{'AdamW' if decoupled else 'Adam'}): "
                        f"betas, eps, weight_decay ({'decoupled' if decoupled else 'L2'})")

    def build(self, tensors: list[torch.Tensor], spec: OptimSpec, fused: bool) -> torch.optim.Optimizer:
        kernel: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
        cls = torch.optim.AdamW if self.decoupled else torch.optim.Adam
        return cls(tensors, lr=0.0, betas=(spec.betas[0], spec.betas[1]), eps=spec.eps, weight_decay=spec.weight_decay,
                   **kernel)

    @torch.no_grad()
    def direction(self, opt: Optimizer) -> list[torch.Tensor | None]:
        b1, b2 = opt.spec.betas
        state, out = opt.torch.state, opt.buffers()
        found: list[torch.Tensor | None] = []
        for a, d in zip(opt.aliases, out):
            st = state.get(a)
            if not st or "exp_avg" not in st:
                found.append(None)
                continue
            t = float(st["step"]) + 1  # the next step's bias corrections, as torch's Adam computes them
            torch.sqrt(st["exp_avg_sq"], out=d).div_(math.sqrt(1 - b2**t)).add_(opt.spec.eps)
            torch.div(st["exp_avg"], d, out=d).div_(1 - b1**t)
            found.append(d)
        return found

    @torch.no_grad()
    def direction_at(self, opt: Optimizer, index: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        b1, b2 = opt.spec.betas
        found: list[torch.Tensor | None] = []
        for a, i in zip(opt.aliases, index):
            st = opt.torch.state.get(a)
            if not st or "exp_avg" not in st:
                found.append(None)
                continue
            t = float(st["step"]) + 1  # the same operations as direction's, on the sampled positions
            d = torch.sqrt(st["exp_avg_sq"].reshape(-1).index_select(0, i))
            d.div_(math.sqrt(1 - b2**t)).add_(opt.spec.eps)
            found.append(torch.div(st["exp_avg"].reshape(-1).index_select(0, i), d).div_(1 - b1**t))
        return found

    def fused_step(self, opt: Optimizer, lr: float, a: float, b: float, out: Sequence[torch.Tensor]) -> bool:
        states = [opt.torch.state.get(x) or {} for x in opt.aliases]
        if any("exp_avg" not in st for st in states) or len({float(st["step"]) for st in states}) != 1:
            return False  # before the first step, or parameters at different step counts
        grads = [p.grad for p in opt.params]
        return adam_step(opt.aliases, grads, states, out, lr, opt.spec, self.decoupled, a, b)  # type: ignore[arg-type]

    def factor(self, spec: OptimSpec, version: int, i: int, decaying: bool) -> float:
        b1, b2 = spec.betas

        def scale(t: int) -> float:  # sqrt(1 - beta2^t) / (1 - beta1^t): Adam's bias corrections at step t
            return math.sqrt(1 - b2**t) / (1 - b1**t)

        ratio = scale(version + i) / scale(version + 1)
        return ratio * b1**i / math.sqrt(b2**i) if decaying else ratio

    def decay(self, spec: OptimSpec) -> float:
        return spec.weight_decay if self.decoupled else 0.0


OPTIMIZERS: dict[str, Rule] = {r.name: r for r in (_SGD(), _Adam(decoupled=False), _Adam(decoupled=True))}
"""Every optimizer by ``optim.name``."""


def _fusable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether torch has fused optimizer kernels for all of ``tensors`` (floating point, on CPU or CUDA)."""
    return bool(tensors) and all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors)


class Optimizer:
    """One stage's optimizer: torch's, stepping aliases of ``params`` (see the module's notes).

    Args:
        params: the stage's trainable parameters, in order.
        spec: the optimizer and its settings.
        keep_last: SGD without momentum keeps no buffer; keep the last step's direction (SpecTrain predicts
            along it).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], spec: OptimSpec = OptimSpec(),
                 keep_last: bool = False) -> None:
        if spec.name not in OPTIMIZERS:
            raise unknown("optim.name", spec.name, OPTIMIZERS)
        self.params = list(params)
        self.spec = spec
        self.rule = OPTIMIZERS[spec.name]
        self.keep_last = keep_last and spec.name == "sgd" and spec.momentum == 0
        self.last: list[torch.Tensor | None] = [None] * len(self.params)
        self._bind()

    def _bind(self) -> None:
        """Aliases of the parameters' current tensors and a fresh torch optimizer over them (no state)."""
        self.aliases = [p.data for p in self.params]
        self.torch = self.rule.build(self.aliases, self.spec, self.spec.fused and _fusable(self.aliases))
        self._buffers: list[torch.Tensor] | None = None
        self._direction: list[torch.Tensor | None] | None = None

    @property
    def decay(self) -> float:
        """The decoupled weight decay (see the module's note on the next step)."""
        return self.rule.decay(self.spec)

    def factor(self, version: int, i: int, decaying: bool) -> float:
        """``Rule.factor`` of this optimizer's settings."""
        return self.rule.factor(self.spec, version, i, decaying)

    @torch.no_grad()
    def step(self, lr: float, predict: tuple[float, float, Sequence[torch.Tensor]] | None = None) -> bool:
        """One update at learning rate ``lr`` from the parameters' gradients (those without one are left alone).

        Args:
            predict: ``(a, b, out)``: with ``spec.compile``, also write ``a * W + b * D`` of the new state into
                ``out`` in the same pass where the optimizer has one (``rayspec.core.fused``).

        Returns:
            Whether ``out`` holds the prediction (else the caller computes it).
        """
        if (predict is not None and self.spec.compile and not self.keep_last and _fusable(self.aliases)
                and all(p.grad is not None for p in self.params)):
            for group in self.torch.param_groups:
                group["lr"] = lr
            if self.rule.fused_step(self, lr, *predict):
                self._direction = None
                return True
        if self.keep_last:
            wd = self.spec.weight_decay
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    self.last[i] = p.grad.add(p.data, alpha=wd) if wd else p.grad.clone()
        for a, p in zip(self.aliases, self.params):
            a.grad = p.grad
        for group in self.torch.param_groups:
            group["lr"] = lr
        self.torch.step()
        for a in self.aliases:
            a.grad = None
        self._direction = None
        return False

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def direction(self) -> list[torch.Tensor | None]:
        """``D`` per parameter (None before its first update), computed once per update."""
        if self._direction is None:
            self._direction = self.rule.direction(self)
        return self._direction

    def direction_at(self, index: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """``D`` per parameter at the flat positions ``index[k]`` (a probe's sample) without computing all of it."""
        if self._direction is not None:
            return [None if d is None else d.reshape(-1).index_select(0, i) for d, i in zip(self._direction, index)]
        return self.rule.direction_at(self, index)

    def buffers(self) -> list[torch.Tensor]:
        """Parameter-shaped scratch the direction may be computed into (allocated on first use)."""
        if self._buffers is None:
            self._buffers = [torch.empty_like(a) for a in self.aliases]
        return self._buffers

    def state_dict(self, device: str | torch.device | None = None) -> dict[str, Any]:
        """The optimizer's state, copied (to ``device`` if given): its tensors per parameter index and the kept
        directions. The settings are the spec's, not part of the state."""
        return {"name": self.spec.name, "state": _copied(self.torch.state_dict()["state"], device),
                "last": _copied(self.last, device)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s output (copied: the caller's tensors are never written)."""
        if state.get("name", "sgd") != self.spec.name:
            raise ValueError(f"the optimizer state is {state.get('name')}'s, this optimizer is {self.spec.name}")
        self._bind()
        groups = self.torch.state_dict()["param_groups"]  # the spec's settings and kernel, the saved state
        self.torch.load_state_dict({"state": _copied(state["state"]), "param_groups": groups})
        self.last = [None if t is None else t.detach().to(a.device).clone()
                     for t, a in zip(state.get("last") or [None] * len(self.params), self.aliases)]

    def to(self, device: torch.device) -> None:
        """After the parameters moved to ``device``: new aliases, the state moved with them."""
        self.load_state_dict(self.state_dict())

    def state_bytes(self) -> int:
        """Bytes of the optimizer's tensors: its state, the kept directions and the direction's scratch."""
        tensors = [t for st in self.torch.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        tensors += [t for t in self.last if t is not None] + list(self._buffers or [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def __getstate__(self) -> dict[str, Any]:
        return {"params": self.params, "spec": self.spec, "keep_last": self.keep_last, "state": self.state_dict()}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.params, self.spec, self.keep_last = saved["params"], saved["spec"], saved["keep_last"]
        self.rule = OPTIMIZERS[self.spec.name]
        self.last = [None] * len(self.params)
        self.load_state_dict(saved["state"])


def sgd_state(buffers: Sequence[torch.Tensor | None], momentum: float) -> dict[str, Any]:
    """``Optimizer.state_dict()`` of SGD from its per-parameter buffers (a checkpoint written before ``optim.name``
    existed): the momentum buffers, or, without momentum, the last directions."""
    if not momentum:
        return {"name": "sgd", "state": {}, "last": list(buffers)}
    return {"name": "sgd", "state": {i: {"momentum_buffer": b} for i, b in enumerate(buffers) if b is not None},
            "last": None}


def _copied(value: Any, device: str | torch.device | None = None) -> Any:
    """``value`` with every tensor in it copied (to ``device`` if given; dicts and lists rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device).clone() if device is not None else value.detach().clone()
    if isinstance(value, dict):
        return {k: _copied(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v, device) for v in value)
    return value
