"""One pipeline stage in plain PyTorch: its sub-module, optimizer, version counter and staleness policy.

A ``Stage`` knows nothing of Ray or of the schedule's order; executors call ``forward`` and
``backward`` per micro-batch, and a ``B`` whose action carries ``update`` steps the optimizer.

Staleness policies (docs/design.md §2; ``rayspec.core.methods`` picks one per method): ``none`` runs
every action at the stored weights; ``stash`` (PipeDream) swaps the version ``F(m)`` used into the
parameter storage for ``B(m)``, one copy per version in flight; ``predict`` (SpecTrain) puts
``W + alpha * v`` into the storage for an action ``s`` versions ahead (``rayspec.core.predict``),
computed into one scratch copy whose memory the storage borrows for the action (``rayspec.core.swap``),
and its ``PredictionProbe`` scores every prediction against the weights the stage then reaches.

[Note: mixed backward] Autograd's saved tensors alias the parameter storage, so a backward runs at
whatever the storage holds *during the backward*, with the activations saved at the forward: with
``backward="mixed"`` (the default, as the paper's code) an asynchronous backward mixes two versions;
``backward="recompute"`` keeps only the forward's input and recomputes the forward at the backward's
weights (same random stream), exact at one more forward (docs/design.md §2). ``stash`` is exact either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rayspec.core.activations import Activation, activation_bytes, as_input, detach, flat, input_grad
from rayspec.core.finite import FiniteChecks
from rayspec.core.methods import BACKWARDS, METHODS, POLICIES
from rayspec.core.optim import SGD, LRSchedule
from rayspec.core.predict import PREDICTORS, PredictionProbe, step_scale
from rayspec.core.rng import rng_state, set_rng_state
from rayspec.core.swap import Swap, WeightSwap
from rayspec.core.timing import StageClock

__all__ = ["Stage", "StageStats", "make_stages"]

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    inputs: Activation  # detached stage input (leaves that require grad where float)
    outputs: Activation | None  # outputs with graph; None under recompute
    version: int
    rng: tuple[torch.Tensor, ...] | None = None
    labels: torch.Tensor | None = None  # last stage under recompute


@dataclass
class StageStats:
    """Per-stage counters: actions run, busy seconds per kind, peak copies kept."""

    actions: dict[str, int] = field(default_factory=lambda: {"F": 0, "B": 0})
    busy_s: dict[str, float] = field(default_factory=lambda: {"F": 0.0, "B": 0.0})
    peak_stash: int = 0
    peak_weight_bytes: int = 0
    sent_bytes: dict[str, int] = field(default_factory=lambda: {"F": 0, "B": 0})
    """Bytes of the tensors this stage hands on: activations to the next stage (``F``) and input
    gradients to the previous one (``B``); what the transport moves across its boundaries."""


class Stage:
    """Stage ``index`` of ``num_stages``: runs forwards and backwards of micro-batches.

    Args:
        module: the stage's slice of the model.
        index: ``k``, 0-based; stage 0 takes the input.
        num_stages: ``N``.
        policy: ``none``, ``stash`` or ``predict`` (see the module docstring).
        lr: learning rate per update count.
        momentum, weight_decay, dampening, nesterov: SGD settings (``rayspec.core.optim.SGD``).
        group: micro-batches accumulated per update; the last stage scales its loss by ``1/group``.
        backward: ``mixed`` or ``recompute``.
        loss_fn: loss of the last stage, ``loss_fn(output, labels)``; default cross-entropy.
        device: where the stage computes.
        record: keep, per action, the weights it used and what was stored before and after
            (tests and debugging only: one weight copy per action).
        seed: seeds the stage's own random stream (dropout; ``rayspec.core.rng``).
        trace: keep the start and end (wall-clock seconds) of every action in ``timeline``.
        predictor: ``linear`` (the paper's), ``momentum`` or ``adaptive`` (``predict`` policy; ``rayspec.core.predict``).
        probe: weight coordinates the prediction probe samples (``predict`` policy); 0 turns it off.
    """

    def __init__(
        self,
        module: nn.Module,
        index: int,
        num_stages: int,
        *,
        policy: str = "none",
        lr: LRSchedule | float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        group: int = 1,
        backward: str = "mixed",
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        device: str | torch.device = "cpu",
        record: bool = False,
        seed: int = 0,
        trace: bool = False,
        predictor: str = "linear",
        probe: int = 4096,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is unknown; choose one of {', '.join(POLICIES)}")
        if backward not in BACKWARDS:
            raise ValueError(f"backward={backward!r} is unknown; choose mixed or recompute")
        if predictor not in PREDICTORS:
            raise ValueError(f"predictor={predictor!r} is unknown; choose one of {', '.join(PREDICTORS)}")
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.policy, self.backward_mode, self.group = policy, backward, group
        self.device = torch.device(device)
        self.module = module.to(self.device)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.lr = lr if isinstance(lr, LRSchedule) else LRSchedule(float(lr))
        self.optimizer = SGD(self.params, momentum, weight_decay, dampening, nesterov, keep_velocity=policy == "predict")
        self.loss_fn = loss_fn or nn.functional.cross_entropy
        self.version = 0
        self.pending = 0  # backwards accumulated since the last update
        self.inflight: dict[int, _InFlight] = {}
        self.stash: dict[int, tuple[list[torch.Tensor], int]] = {}  # version -> (weights, users)
        self.scratch: list[torch.Tensor] | None = None  # one copy, allocated on first use
        self.stats = StageStats()
        self.record = record
        self._rng_devices = [self.device] if self.device.type == "cuda" else []
        self._seed = seed * 7919 + index + 1
        with torch.random.fork_rng(devices=self._rng_devices):
            torch.manual_seed(self._seed)
            self.rng = rng_state(self.device)
        self.records: list[dict[str, Any]] = []
        self.trace = trace
        self.clock = StageClock(trace)  # host time on CPU, CUDA events on a GPU (settled when read)
        self.checks = FiniteChecks(index)  # on a GPU: flags on the device, raised at checks.flush()
        self.predictor = predictor
        self.probe = PredictionProbe(self.params, probe, self._seed) if policy == "predict" and probe > 0 else None
        self.timeline: list[tuple[str, int, float, float]] = []  # (kind, micro-batch, start, end) in epoch s

    def forward(self, m: int, x: Activation, labels: torch.Tensor | None = None, s: int = 0) -> Activation:
        """Run ``F(m)``; on the last stage ``labels`` give the loss, which is returned instead of the output.

        Args:
            s: versions ahead to predict (``predict`` policy only).
        """
        t0 = self.clock.start(self.device)
        inputs = as_input(x, self.device, requires_grad=not self.is_first)
        if self.policy == "stash":
            self._stash_current()
        rng = self.rng if self.backward_mode == "recompute" else None
        with torch.random.fork_rng(devices=self._rng_devices), self._weights_for("F", m, s):
            set_rng_state(self.rng, self.device)
            if self.backward_mode == "recompute":
                with torch.no_grad():
                    out = self.module(inputs)
                keep = None
            else:
                out = keep = self.module(inputs)
            result: Activation
            if self.is_last:
                if labels is None:
                    raise ValueError("the last stage needs labels to compute the loss")
                labels = labels.to(self.device)
                with torch.set_grad_enabled(keep is not None):
                    loss = self.loss_fn(out, labels) / self.group
                self.checks.loss(loss, m, self.version + 1)
                keep = loss if keep is not None else None
                result = loss.detach()
            else:
                result = detach(out)
                self.stats.sent_bytes["F"] += activation_bytes(result)
            self.rng = rng_state(self.device)
        held_labels = labels if self.is_last and keep is None else None
        self.inflight[m] = _InFlight(inputs, keep, self.version, rng, held_labels)
        if self.record:
            self.records[-1].update(inputs=detach(inputs), labels=labels)
        self._account("F", t0, m)
        return result

    def backward(self, m: int, grad: Activation | None = None, s: int = 0, update: bool = False) -> Activation | None:
        """Run ``B(m)`` with the gradient of the stage output (none on the last stage); return the input gradient.

        Args:
            s: versions ahead to predict (``predict`` policy, ``paper`` variant).
            update: step the optimizer after this backward.
        """
        t0 = self.clock.start(self.device)
        job = self.inflight.pop(m)
        if self.policy == "stash":
            ctx = self._stashed_weights(job.version, m)
        else:
            ctx = self._weights_for("B", m, s)
        with ctx:
            outputs = job.outputs
            if outputs is None:  # recompute at the weights in storage now
                with torch.random.fork_rng(devices=self._rng_devices):
                    set_rng_state(job.rng, self.device)
                    outputs = self.module(job.inputs)
                if self.is_last:
                    assert job.labels is not None  # kept by forward() on the last stage
                    outputs = self.loss_fn(outputs, job.labels) / self.group
            if self.is_last:
                outputs.backward()
            else:
                pairs = [(o, g) for o, g in zip(flat(outputs), flat(grad)) if g is not None and o.requires_grad]
                torch.autograd.backward([o for o, _ in pairs], [g.to(self.device) for _, g in pairs])
        grad_in = None if self.is_first else input_grad(job.inputs)
        if grad_in is not None:
            self.stats.sent_bytes["B"] += activation_bytes(grad_in)
        if self.record:
            self.records[-1].update(
                inputs=detach(job.inputs), grad_output=grad, labels=job.labels,
                grads=[None if p.grad is None else p.grad.clone() for p in self.params],
            )
        if self.policy == "stash":
            self._release(job.version)
        self.pending += 1
        if update:
            self.step()
        self._account("B", t0, m)
        return grad_in

    def step(self) -> None:
        """Apply the accumulated gradient: one update, one version; a non-finite gradient raises first."""
        self.checks.grads_of(self.module, self.version + 1)
        self.optimizer.step(self.lr(self.version))
        self.optimizer.zero_grad()
        self.version += 1
        self.pending = 0
        if self.probe is not None:
            self.probe.reached(self.version, self.params, self.optimizer.buffers)
        if self.version == 1:  # the optimizer's state exists from the first step on
            self._track_memory()

    def _weights_for(self, kind: str, m: int, s: int) -> contextlib.AbstractContextManager[None]:
        if self.policy != "predict" or s == 0:
            return self._action_weights(kind, m, s, None)
        damping = self.probe.damping() if self.probe is not None else 1.0
        alpha = step_scale(self.predictor, s, self.version, self.lr, self.optimizer.momentum, damping)
        # Before the first update there is no velocity yet: nothing to predict.
        predicted: list[Swap] = [None if v is None else (v, alpha) for v in self.optimizer.buffers]
        scored = self.probe is not None and any(v is not None for v in self.optimizer.buffers)
        return self._action_weights(kind, m, s, predicted, target=self.version + s if scored else None)

    def _stashed_weights(self, version: int, m: int) -> contextlib.AbstractContextManager[None]:
        if version == self.version:
            return self._action_weights("B", m, 0, None)
        return self._action_weights("B", m, 0, [(w, None) for w in self.stash[version][0]])

    @contextlib.contextmanager
    def _action_weights(self, kind: str, m: int, s: int, swaps: Sequence[Swap] | None,
                        target: int | None = None) -> Iterator[None]:
        """The weights of one action in the parameter storage (``WeightSwap``), restored afterwards; with
        ``target``, the probe scores this prediction once the stage holds that version; with ``record``, the
        weights before, during and after the action are kept."""
        before = [p.data.clone() for p in self.params] if self.record else None
        probe = self.probe if target is not None else None
        stale, velocity = probe.held(self.version, self.params, self.optimizer.buffers) if probe else (None, None)
        used: list[torch.Tensor] | None = None
        buffers: list[torch.Tensor | None] | None = None
        try:
            with WeightSwap(self.params, swaps, self._scratch):
                if probe is not None and stale is not None and velocity is not None and target is not None:
                    paper = velocity * (-s * self.lr(self.version))
                    probe.predicted(target, stale, probe.sample(self.params), paper)
                if self.record:
                    used = [p.data.clone() for p in self.params]
                    buffers = [None if v is None else v.clone() for v in self.optimizer.buffers]
                yield
        finally:
            if self.record:
                self.records.append(
                    {"kind": kind, "microbatch": m, "version": self.version, "s": s, "lr": self.lr(self.version),
                     "velocity": buffers, "before": before, "used": used,
                     "after": [p.data.clone() for p in self.params]}
                )

    def _stash_current(self) -> None:
        weights, users = self.stash.get(self.version, (None, 0))
        if weights is None:
            weights = [p.data.clone() for p in self.params]
        self.stash[self.version] = (weights, users + 1)
        self.stats.peak_stash = max(self.stats.peak_stash, len(self.stash))
        self._track_memory()

    def _release(self, version: int) -> None:
        weights, users = self.stash.pop(version)
        if users > 1:
            self.stash[version] = (weights, users - 1)

    def _scratch(self) -> list[torch.Tensor]:
        if self.scratch is None:
            self.scratch = [torch.empty_like(p.data) for p in self.params]
            self._track_memory()
        return self.scratch

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of parameter-sized state held now: weights, optimizer state, scratch copy, stash."""
        size = sum(p.numel() * p.element_size() for p in self.params)
        return {"weights": size, "optimizer": self.optimizer.state_bytes(),
                "scratch": size if self.scratch is not None else 0, "stash": size * len(self.stash)}

    def _track_memory(self) -> None:
        self.stats.peak_weight_bytes = max(self.stats.peak_weight_bytes, sum(self.weight_bytes().values()))

    def _account(self, kind: str, t0: Any, m: int) -> None:
        self.clock.stop(kind, m, t0, self.stats, self.timeline)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def to(self, device: str | torch.device) -> Stage:
        """Move a drained stage (weights, momentum) to ``device``; on CUDA its stream gains a CUDA state seeded
        like the CPU one."""
        device = torch.device(device)
        if device == self.device:
            return self
        if self.inflight or self.stash:
            raise RuntimeError(f"stage {self.index} has micro-batches in flight; move only a drained stage")
        self.module.to(device)  # in place: self.params and the optimizer keep the same Parameter objects
        self.optimizer.buffers = [None if b is None else b.to(device) for b in self.optimizer.buffers]
        self.scratch = None
        self.device = device
        if self.probe is not None:
            self.probe.to(device)
        self._rng_devices = [device] if device.type == "cuda" else []
        if device.type == "cuda" and len(self.rng) == 1:
            with torch.random.fork_rng(devices=self._rng_devices):
                torch.cuda.manual_seed(self._seed)
                self.rng = (self.rng[0], torch.cuda.get_rng_state(device))
        return self

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything a drained stage needs to continue exactly (docs/design.md §7): weights and buffers,
        the optimizer's momentum (SpecTrain's velocity), the version, the random stream and the counters."""
        if not self.drained():
            raise RuntimeError(
                f"stage {self.index} has {len(self.inflight)} micro-batches in flight and {self.pending} pending "
                "backwards; checkpoint only a drained pipeline"
            )
        return {
            "module": self.state_dict(),
            "momentum": [None if b is None else b.detach().cpu().clone() for b in self.optimizer.buffers],
            "version": self.version,
            "rng": [t.clone() for t in self.rng],
            "stats": json.dumps(dataclasses.asdict(self.stats)),
            **({"probe": self.probe.state()} if self.probe is not None else {}),
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Continue from ``checkpoint_state()``'s output (of the same stage of the same partition)."""
        if len(state["momentum"]) != len(self.params):
            raise ValueError(
                f"stage {self.index}: the checkpoint has {len(state['momentum'])} parameters, this stage "
                f"{len(self.params)}; resume with the partition the checkpoint was written with"
            )
        self.module.load_state_dict(state["module"])
        self.optimizer.buffers = [None if b is None else b.to(self.device).clone() for b in state["momentum"]]
        self.version = int(state["version"])
        self.pending = 0
        self.inflight.clear()
        self.stash.clear()
        self.rng = tuple(t.clone() for t in state["rng"])
        self.stats = StageStats(**json.loads(state["stats"]))
        if self.probe is not None:
            self.probe.forget()
            if "probe" in state:
                self.probe.load(state["probe"])

    def drained(self) -> bool:
        return not self.inflight and self.pending == 0


def make_stages(parts: Sequence[nn.Module], method: str, **settings: Any) -> list[Stage]:
    """One ``Stage`` per part, stage 0 first, with ``method``'s staleness policy (``rayspec.core.methods``);
    ``settings`` are ``Stage``'s keyword arguments (learning rate, optimizer, group, device, ...)."""
    policy = METHODS[method].policy
    return [Stage(part, k, len(parts), policy=policy, **settings) for k, part in enumerate(parts)]
