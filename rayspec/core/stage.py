"""One pipeline stage in plain PyTorch: its sub-module, optimizer, version counter and staleness policy.

A ``Stage`` knows nothing of Ray or of the schedule's order; executors call ``forward`` and
``backward`` per micro-batch, and a ``B`` whose action carries ``update`` steps the optimizer. Which
weights each action runs at (the stored ones, PipeDream's stash or SpecTrain's prediction) is the
business of its ``ActionWeights`` (``rayspec.core.staleness``).

[Note: mixed backward] Autograd's saved tensors alias the parameter storage, so a backward runs at
whatever the storage holds *during the backward*, with the activations saved at the forward: with
``backward="mixed"`` (the default, as the paper's code) an asynchronous backward mixes two versions;
``backward="recompute"`` keeps only the forward's input and recomputes the forward at the backward's
weights (same random stream), exact at one more forward (docs/design.md §2). ``stash`` is exact either way.

[Note: global clipping] With ``clip_scope="global"`` (the flushed methods, ``rayspec.core.grads``) an update
needs every stage's gradient norms: ``backward(update=True)`` leaves the update *waiting*, the executor
gathers ``grad_norms()`` of all stages in stage order and hands them to each stage's ``finish_update``.
Until then the stage refuses any other action.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rayspec.core.activations import Activation, activation_bytes, as_input, detach, flat, input_grad
from rayspec.core.finite import FiniteChecks
from rayspec.core.grads import clip_grads, tensor_norms
from rayspec.core.methods import METHODS, PREDICTING
from rayspec.core.optim import Optimizer, sgd_state
from rayspec.core.precision import autocast, boundary
from rayspec.core.predict import PredictionProbe
from rayspec.core.rng import rng_state, set_rng_state
from rayspec.core.split import SplitBackward
from rayspec.core.stage_spec import StageSpec
from rayspec.core.staleness import ActionWeights
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
    split: Any = None  # between I and W: the outputs and their gradients (rayspec.core.split)


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


class Stage(SplitBackward):
    """Stage ``index`` of ``num_stages``: runs forwards and backwards of micro-batches.

    Args:
        module: the stage's slice of the model.
        spec: how it trains: optimizer, learning rate, staleness policy, clipping, precision, ... (``StageSpec``).
        index: ``k``, 0-based; stage 0 takes the input.
        num_stages: ``N``.
    """

    def __init__(self, module: nn.Module, spec: StageSpec, index: int, num_stages: int) -> None:
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.policy, self.backward_mode, self.group = spec.policy, spec.backward, spec.group
        self.precision = spec.precision
        self.clip_grad_norm = spec.clip_grad_norm
        # One stage is the whole model: its own norm is the global one.
        self.clip_scope = spec.clip_scope if num_stages > 1 else "stage"
        self.device = torch.device(spec.device)
        self.module = module.to(self.device)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.lr = spec.schedule
        self.optimizer = Optimizer(self.params, spec.optim, keep_last=spec.policy in PREDICTING)
        self.loss_fn = spec.loss_fn or nn.functional.cross_entropy
        self.version = 0
        self.pending = 0  # backwards accumulated since the last update
        self.waiting = False  # an update waits for every stage's gradient norms (global clipping)
        self.inflight: dict[int, _InFlight] = {}
        self.stats = StageStats()
        self._rng_devices = [self.device] if self.device.type == "cuda" else []
        self._seed = spec.seed * 7919 + index + 1
        with torch.random.fork_rng(devices=self._rng_devices):
            torch.manual_seed(self._seed)
            self.rng = rng_state(self.device)
        self.trace = spec.trace
        self.clock = StageClock(spec.trace)  # host time on CPU, CUDA events on a GPU (settled when read)
        self.checks = FiniteChecks(index)  # on a GPU: flags on the device, raised at checks.flush()
        self.predictor = spec.predictor
        predicts = spec.policy in PREDICTING and spec.probe > 0
        self.probe = PredictionProbe(self.params, spec.probe, self._seed) if predicts else None
        self.weights = ActionWeights(self.params, spec.policy, self.optimizer, self.lr, spec.predictor, self.probe,
                                     spec.record, self._track_memory)
        self.timeline: list[tuple[str, int, float, float]] = []  # (kind, micro-batch, start, end) in epoch s

    @property
    def records(self) -> list[dict[str, Any]]:
        """Per action (``record=True``): its kind, micro-batch, version, ``s``, the weights before, used and after."""
        return self.weights.records

    def forward(self, m: int, x: Activation, labels: torch.Tensor | None = None, s: int = 0) -> Activation:
        """Run ``F(m)``; on the last stage ``labels`` give the loss, which is returned instead of the output.

        Args:
            s: versions ahead to predict (``predict`` policy only).
        """
        t0 = self.clock.start(self.device)
        self._check_ready("F", m)
        inputs = as_input(x, self.device, requires_grad=not self.is_first)
        rng = self.rng if self.backward_mode == "recompute" else None
        with torch.random.fork_rng(devices=self._rng_devices), self.weights.forward(m, s, self.version):
            set_rng_state(self.rng, self.device)
            result: Activation
            if self.is_last:
                if labels is None:
                    raise ValueError("the last stage needs labels to compute the loss")
                labels = labels.to(self.device)
                with torch.set_grad_enabled(self.backward_mode != "recompute"):
                    keep = self._loss(inputs, labels)
                self.checks.loss(keep, m, self.version + 1)
                result = keep.detach()
            else:
                with torch.set_grad_enabled(self.backward_mode != "recompute"):
                    keep = self._output(inputs)
                result = detach(keep)
                self.stats.sent_bytes["F"] += activation_bytes(result)
            self.rng = rng_state(self.device)
        held_labels = labels if self.is_last and self.backward_mode == "recompute" else None
        kept = keep if self.backward_mode != "recompute" else None
        self.inflight[m] = _InFlight(inputs, kept, self.version, rng, held_labels)
        if self.weights.record:
            self.records[-1].update(inputs=detach(inputs), labels=labels)
        self._account("F", t0, m)
        return result

    def _output(self, inputs: Activation) -> Activation:
        """The module's output as it goes to the next stage (in the precision's dtype)."""
        with autocast(self.precision, self.device):
            out = self.module(inputs)
        return boundary(out, self.precision)

    def _loss(self, inputs: Activation, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss, scaled by ``1/group``."""
        with autocast(self.precision, self.device):
            return self.loss_fn(self.module(inputs), labels) / self.group

    def backward(self, m: int, grad: Activation | None = None, s: int = 0, update: bool = False) -> Activation | None:
        """Run ``B(m)`` with the gradient of the stage output (none on the last stage); return the input gradient.

        Args:
            s: versions ahead to predict (``predict`` policy, ``paper`` variant).
            update: step the optimizer after this backward (with global clipping: leave the update waiting
                for ``finish_update``).
        """
        t0 = self.clock.start(self.device)
        self._check_ready("B", m)
        job = self.inflight.pop(m)
        with self.weights.backward(m, s, self.version, job.version):
            outputs = job.outputs
            if outputs is None:  # recompute at the weights in storage now
                with torch.random.fork_rng(devices=self._rng_devices):
                    set_rng_state(job.rng, self.device)
                    if self.is_last:
                        assert job.labels is not None  # kept by forward() on the last stage
                        outputs = self._loss(job.inputs, job.labels)
                    else:
                        outputs = self._output(job.inputs)
            if self.is_last:
                outputs.backward()
            else:
                pairs = [(o, g) for o, g in zip(flat(outputs), flat(grad)) if g is not None and o.requires_grad]
                torch.autograd.backward([o for o, _ in pairs], [g.to(self.device) for _, g in pairs])
        grad_in = None if self.is_first else input_grad(job.inputs)
        if grad_in is not None:
            self.stats.sent_bytes["B"] += activation_bytes(grad_in)
        if self.weights.record:
            self.records[-1].update(
                inputs=detach(job.inputs), grad_output=grad, labels=job.labels,
                grads=[None if p.grad is None else p.grad.clone() for p in self.params],
            )
        self._gradient_done(update)
        self._account("B", t0, m)
        return grad_in

    def _check_ready(self, kind: str, m: int) -> None:
        if self.waiting:
            raise RuntimeError(
                f"stage {self.index}: {kind}({m}) while update {self.version + 1} waits for the global gradient norm; "
                "the executor must call finish_update with every stage's grad_norms() first"
            )

    def grad_norms(self) -> torch.Tensor:
        """The 2-norm of each gradient of this stage (those that exist, in order), on the CPU."""
        return tensor_norms([p.grad for p in self.params if p.grad is not None]).cpu()

    def finish_update(self, norms: Sequence[torch.Tensor]) -> None:
        """Apply the waiting update, clipped by the norm over every stage's ``grad_norms()`` (stage 0's first)."""
        if not self.waiting:
            raise RuntimeError(f"stage {self.index} has no update waiting for the global gradient norm")
        self.step(norms)

    def step(self, norms: Sequence[torch.Tensor] | None = None) -> None:
        """Apply the accumulated gradient: one update, one version; a non-finite gradient raises first.

        Args:
            norms: with clipping, every stage's ``grad_norms()`` in stage order (global); None: this stage's own.
        """
        if self.clip_grad_norm is None:
            self.checks.grads_of(self.module, self.version + 1)  # on a GPU: a flag, read at checks.flush()
        else:  # the norms clipping needs serve the check too
            grads = [p.grad for p in self.params if p.grad is not None]
            own = norms[self.index] if norms is not None else tensor_norms(grads)
            self.checks.grads_of(self.module, self.version + 1, own)
            problem = clip_grads(grads, self.clip_grad_norm, [own] if norms is None else norms)
            if problem is not None:
                raise FloatingPointError(f"{problem} at update {self.version + 1} on stage {self.index}; "
                                         "lower optim.lr or add warm-up (optim.warmup)")
        self.weights.updating(self.version)  # 2bw: keeps the version its forwards in flight ran at
        ahead = self.weights.ahead(self.version + 1)  # optim.compile: the next prediction, in the update's pass
        predicted = self.optimizer.step(self.lr(self.version), ahead)
        self.optimizer.zero_grad()
        self.version += 1
        self.pending = 0
        self.waiting = False
        self.weights.reached(self.version, ahead if predicted else None)
        if self.version == 1:  # the optimizer's state exists from the first step on
            self._track_memory()

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of parameter-sized state held now: weights, optimizer state, scratch copy, stash."""
        size = sum(p.numel() * p.element_size() for p in self.params)
        return {"weights": size, "optimizer": self.optimizer.state_bytes(), **self.weights.bytes(size)}

    def _track_memory(self) -> None:
        self.stats.peak_stash = max(self.stats.peak_stash, len(self.weights.stash))
        self.stats.peak_weight_bytes = max(self.stats.peak_weight_bytes, sum(self.weight_bytes().values()))

    def _account(self, kind: str, t0: Any, m: int) -> None:
        self.clock.stop(kind, m, t0, self.stats, self.timeline)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def to(self, device: str | torch.device) -> Stage:
        """Move a drained stage (weights, optimizer state) to ``device``; on CUDA its stream gains a CUDA state
        seeded like the CPU one."""
        device = torch.device(device)
        if device == self.device:
            return self
        if not self.drained() or self.weights.stash:
            raise RuntimeError(f"stage {self.index} has micro-batches in flight; move only a drained stage")
        self.module.to(device)  # in place: self.params keep the same Parameter objects, their tensors change
        self.optimizer.to(device)
        self.weights.clear()
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
        the optimizer's state (SpecTrain's direction comes from it), the version, the random stream and the
        counters."""
        if not self.drained():
            raise RuntimeError(
                f"stage {self.index} has {len(self.inflight)} micro-batches in flight and {self.pending} pending "
                "backwards; checkpoint only a drained pipeline"
            )
        return {
            "module": self.state_dict(),
            "parameters": len(self.params),
            "optimizer": self.optimizer.state_dict(device="cpu"),
            "version": self.version,
            "rng": [t.clone() for t in self.rng],
            "stats": json.dumps(dataclasses.asdict(self.stats)),
            **({"probe": self.probe.state()} if self.probe is not None else {}),
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Continue from ``checkpoint_state()``'s output (of the same stage of the same partition)."""
        # written before optim.name existed: SGD's momentum buffers
        optimizer = state.get("optimizer") or sgd_state(state["momentum"], self.optimizer.spec.momentum)
        count = state.get("parameters", len(state.get("momentum") or []))
        if count != len(self.params):
            raise ValueError(
                f"stage {self.index}: the checkpoint has {count} parameters, this stage {len(self.params)}; "
                "resume with the partition the checkpoint was written with"
            )
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(optimizer)
        self.version = int(state["version"])
        self.pending = 0
        self.waiting = False
        self.inflight.clear()
        self.weights.clear()
        self.rng = tuple(t.clone() for t in state["rng"])
        self.stats = StageStats(**json.loads(state["stats"]))
        if self.probe is not None:
            self.probe.forget()
            if "probe" in state:
                self.probe.load(state["probe"])

    def drained(self) -> bool:
        return not self.inflight and self.pending == 0 and not self.waiting


def make_stages(parts: Sequence[nn.Module], method: str, spec: StageSpec | None = None) -> list[Stage]:
    """One ``Stage`` per part, stage 0 first, all built from ``spec`` (default: ``StageSpec()``) with ``method``'s
    staleness policy and clipping scope (``rayspec.core.methods``)."""
    m = METHODS[method]
    spec = dataclasses.replace(spec or StageSpec(), policy=m.policy, clip_scope="global" if m.flushes else "stage")
    return [Stage(part, spec, k, len(parts)) for k, part in enumerate(parts)]
