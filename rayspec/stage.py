"""One pipeline stage in plain PyTorch: its sub-module, optimizer, version counter and staleness policy.

A ``Stage`` knows nothing of Ray or of the schedule's order; executors call ``forward`` and
``backward`` per micro-batch, and a ``B`` whose action carries ``update`` steps the optimizer.

Staleness policies (DESIGN §2):

* ``none`` (``vanilla``, ``gpipe``, ``async``): every action runs at the stored weights.
* ``stash`` (``pipedream``): ``F(m)`` records the version it used; ``B(m)`` swaps exactly
  those weights into the parameter storage for its backward. One copy per version in
  flight, at most ``N - k`` on stage ``k``.
* ``predict`` (``spectrain``): for an action ``s`` versions ahead, the storage holds
  ``W + alpha * v`` during the action (``alpha = -s * lr`` for the paper's ``linear`` predictor;
  ``rayspec.predict`` has the others), computed into one scratch copy whose memory the
  storage borrows for the action (a pointer swap, no copy of the stored weights); no weight
  copy outlives the action. A ``PredictionProbe`` scores every prediction
  against the weights the stage reaches at the target version (``stats()["prediction"]``).

[Note: mixed backward] Autograd's saved tensors alias the parameter storage, so a backward
uses whatever the storage holds *during the backward* together with the activations saved
at the forward. With ``backward="mixed"`` (the default, as the paper and the authors' code
run it) an asynchronous backward therefore mixes two weight versions. With
``backward="recompute"`` the forward keeps only its input and the backward recomputes the
stage's forward at the backward's weights (restoring the forward's RNG state): gradients
are then exact at those weights, at the price of one more forward. ``stash`` is exact
either way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rayspec.optim import SGD, LRSchedule
from rayspec.predict import PREDICTORS, PredictionProbe, step_scale
from rayspec.profile import activation_bytes

__all__ = ["Stage", "Activation", "POLICIES", "METHOD_POLICY"]

log = logging.getLogger(__name__)

Activation = Any  # a tensor, or a tuple of tensors
POLICIES = ("none", "stash", "predict")
METHOD_POLICY = {"vanilla": "none", "gpipe": "none", "async": "none", "pipedream": "stash", "spectrain": "predict"}


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
        momentum, weight_decay, dampening, nesterov: SGD settings (``rayspec.optim.SGD``).
        group: micro-batches accumulated per update; the last stage scales its loss by ``1/group``.
        backward: ``mixed`` or ``recompute``.
        loss_fn: loss of the last stage, ``loss_fn(output, labels)``; default cross-entropy.
        device: where the stage computes.
        record: keep, per action, the weights it used and what was stored before and after
            (tests and debugging only: one weight copy per action).
        seed: seeds the stage's own random stream (dropout): each stage draws from its own
            stream in its own action order, so the numbers do not depend on how stages interleave
            or on which process runs them.
        trace: keep the start and end (wall-clock seconds) of every action in ``timeline``.
        predictor: ``linear`` (the paper's), ``momentum`` or ``adaptive`` (``predict`` policy; ``rayspec.predict``).
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
        if backward not in ("mixed", "recompute"):
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
            self.rng = _rng_state(self.device)
        self.records: list[dict[str, Any]] = []
        self.trace = trace
        self.predictor = predictor
        self.probe = PredictionProbe(self.params, probe, self._seed) if policy == "predict" and probe > 0 else None
        self.timeline: list[tuple[str, int, float, float]] = []  # (kind, micro-batch, start, end) in epoch s

    # ------------------------------------------------------------------ actions
    def forward(self, m: int, x: Activation, labels: torch.Tensor | None = None, s: int = 0) -> Activation:
        """Run ``F(m)``; on the last stage ``labels`` give the loss, which is returned instead of the output.

        Args:
            s: versions ahead to predict (``predict`` policy only).
        """
        t0 = time.perf_counter()
        inputs = _prepare_input(x, self.device, requires_grad=not self.is_first)
        if self.policy == "stash":
            self._stash_current()
        rng = self.rng if self.backward_mode == "recompute" else None
        with torch.random.fork_rng(devices=self._rng_devices), self._weights_for("F", m, s):
            _set_rng_state(self.rng, self.device)
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
                if not math.isfinite(value := float(loss.detach())):
                    raise FloatingPointError(
                        f"the loss of micro-batch {m} is {value} at update {self.version + 1} on stage {self.index} "
                        "(the last); lower optim.lr or add warm-up (optim.warmup)"
                    )
                keep = loss if keep is not None else None
                result = loss.detach()
            else:
                result = _detach(out)
                self.stats.sent_bytes["F"] += activation_bytes(result)
            self.rng = _rng_state(self.device)
        held_labels = labels if self.is_last and keep is None else None
        self.inflight[m] = _InFlight(inputs, keep, self.version, rng, held_labels)
        if self.record:
            self.records[-1].update(inputs=_detach(inputs), labels=labels)
        self._account("F", t0, m)
        return result

    def backward(self, m: int, grad: Activation | None = None, s: int = 0, update: bool = False) -> Activation | None:
        """Run ``B(m)`` with the gradient of the stage output (none on the last stage); return the input gradient.

        Args:
            s: versions ahead to predict (``predict`` policy, ``paper`` variant).
            update: step the optimizer after this backward.
        """
        t0 = time.perf_counter()
        job = self.inflight.pop(m)
        if self.policy == "stash":
            ctx = self._stashed_weights(job.version, m)
        else:
            ctx = self._weights_for("B", m, s)
        with ctx:
            outputs = job.outputs
            if outputs is None:  # recompute at the weights in storage now
                with torch.random.fork_rng(devices=self._rng_devices):
                    _set_rng_state(job.rng, self.device)
                    outputs = self.module(job.inputs)
                if self.is_last:
                    assert job.labels is not None  # kept by forward() on the last stage
                    outputs = self.loss_fn(outputs, job.labels) / self.group
            if self.is_last:
                outputs.backward()
            else:
                pairs = [(o, g) for o, g in zip(_flat(outputs), _flat(grad)) if g is not None and o.requires_grad]
                torch.autograd.backward([o for o, _ in pairs], [g.to(self.device) for _, g in pairs])
        grad_in = None if self.is_first else _input_grad(job.inputs)
        if grad_in is not None:
            self.stats.sent_bytes["B"] += activation_bytes(grad_in)
        if self.record:
            self.records[-1].update(
                inputs=_detach(job.inputs), grad_output=grad, labels=job.labels,
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
        bad = _non_finite_grad(self.module)
        if bad is not None:
            raise FloatingPointError(
                f"the gradient of {bad} is not finite at update {self.version + 1} on stage {self.index}; "
                "lower optim.lr or add warm-up (optim.warmup)"
            )
        self.optimizer.step(self.lr(self.version))
        self.optimizer.zero_grad()
        self.version += 1
        self.pending = 0
        if self.probe is not None:
            self.probe.reached(self.version, self.params, self.optimizer.buffers)
        if self.version == 1:  # the optimizer's state exists from the first step on
            self._track_memory()

    # --------------------------------------------------------------- weights
    def _weights_for(self, kind: str, m: int, s: int) -> _WeightSwap:
        if self.policy != "predict" or s == 0:
            return _WeightSwap(self, kind, m, s, None)
        damping = self.probe.damping() if self.probe is not None else 1.0
        alpha = step_scale(self.predictor, s, self.version, self.lr, self.optimizer.momentum, damping)
        # Before the first update there is no velocity yet: nothing to predict.
        predicted = [None if v is None else (v, alpha) for v in self.optimizer.buffers]
        scored = self.probe is not None and any(v is not None for v in self.optimizer.buffers)
        return _WeightSwap(self, kind, m, s, predicted, target=self.version + s if scored else None)

    def _stashed_weights(self, version: int, m: int) -> _WeightSwap:
        if version == self.version:
            return _WeightSwap(self, "B", m, 0, None)
        return _WeightSwap(self, "B", m, 0, [(w, None) for w in self.stash[version][0]])

    def _stash_current(self) -> None:
        weights, users = self.stash.get(self.version, (None, 0))
        if weights is None:
            weights = [p.data.clone() for p in self.params]
        self.stash[self.version] = (weights, users + 1)
        self.stats.peak_stash = max(self.stats.peak_stash, len(self.stash))
        self._track_memory()

    def _release(self, version: int) -> None:
        weights, users = self.stash[version]
        if users == 1:
            del self.stash[version]
        else:
            self.stash[version] = (weights, users - 1)

    def _scratch(self) -> list[torch.Tensor]:
        if self.scratch is None:
            self.scratch = [torch.empty_like(p.data) for p in self.params]
            self._track_memory()
        return self.scratch

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of parameter-sized state held now: weights, optimizer state, scratch copy, stash."""
        size = sum(p.numel() * p.element_size() for p in self.params)
        return {
            "weights": size,
            "optimizer": self.optimizer.state_bytes(),
            "scratch": size if self.scratch is not None else 0,
            "stash": size * len(self.stash),
        }

    def _track_memory(self) -> None:
        self.stats.peak_weight_bytes = max(self.stats.peak_weight_bytes, sum(self.weight_bytes().values()))

    def _account(self, kind: str, t0: float, m: int) -> None:
        busy = time.perf_counter() - t0
        self.stats.actions[kind] += 1
        self.stats.busy_s[kind] += busy
        if self.trace:
            end = time.time()
            self.timeline.append((kind, m, end - busy, end))

    # ----------------------------------------------------------------- state
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
        """Everything a drained stage needs to continue exactly (``rayspec.checkpoint``): weights and buffers,
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


class _WeightSwap:
    """Context that puts other weights into the parameter storage for one action and restores them bit-exactly.

    ``swaps[i]`` is ``None`` (keep parameter ``i``), ``(v, alpha)`` (storage becomes ``W + alpha * v``,
    computed into the stage's one scratch copy) or ``(w, None)`` (storage becomes ``w``). The
    parameter's storage and the other tensor's exchange their memory (a pointer swap, ``_swap_in``),
    and exchange it back afterwards (``_swap_out``): the stored weights are never copied, and every alias of the
    storage, autograd's saved views included, sees the swapped-in weights during the action.
    """

    def __init__(self, stage: Stage, kind: str, m: int, s: int, swaps: list | None, target: int | None = None) -> None:
        self.stage, self.kind, self.m, self.s, self.swaps = stage, kind, m, s, swaps
        self.target = target  # a prediction the stage's probe scores once it holds this version
        self.swapped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def __enter__(self) -> None:
        st = self.stage
        before = [p.data.clone() for p in st.params] if st.record else None
        probe = st.probe if self.target is not None else None
        stale, velocity = probe.held(st.version, st.params, st.optimizer.buffers) if probe is not None else (None, None)
        if self.swaps is not None:
            with torch.no_grad():
                for i, (p, swap) in enumerate(zip(st.params, self.swaps)):
                    if swap is None:
                        continue
                    t, alpha = swap
                    if alpha is not None:  # the prediction goes into the scratch copy, allocated on first use
                        t = torch.add(p.data, t, alpha=alpha, out=st._scratch()[i])
                    self.swapped.append((p.data, t, _swap_in(p.data, t)))
        if probe is not None and stale is not None and velocity is not None and self.target is not None:
            paper = velocity * (-self.s * st.lr(st.version))
            probe.predicted(self.target, stale, probe.sample(st.params), paper)
        if st.record:
            self.before = before
            self.used = [p.data.clone() for p in st.params]
            self.velocity = [None if v is None else v.clone() for v in st.optimizer.buffers]

    def __exit__(self, *exc: object) -> None:
        st = self.stage
        with torch.no_grad():
            for w, t, held in reversed(self.swapped):
                _swap_out(w, t, held)
        self.swapped = []
        if st.record:
            st.records.append(
                {"kind": self.kind, "microbatch": self.m, "version": st.version, "s": self.s,
                 "lr": st.lr(st.version), "velocity": self.velocity,
                 "before": self.before, "used": self.used, "after": [p.data.clone() for p in st.params]}
            )


def _owns_storage(t: torch.Tensor) -> bool:
    return bool(t.is_contiguous() and t.storage_offset() == 0
                and t.untyped_storage().nbytes() == t.numel() * t.element_size())


SWAP_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
"""Exchange two tensors' memory by pointer (``UntypedStorage._swap_data_ptr_``, as torch's own CUDA
graph trees do); without it, or for a tensor that shares its storage, ``_swap_in`` copies."""


def _swap_in(w: torch.Tensor, t: torch.Tensor) -> torch.Tensor | None:
    """Put ``t``'s contents into ``w`` (one shape, dtype and device): by exchanging their memory where each
    owns its whole storage (returns ``None``), else by copy (returns a copy of ``w``'s contents)."""
    if SWAP_STORAGE and _owns_storage(w) and _owns_storage(t):
        w.untyped_storage()._swap_data_ptr_(t.untyped_storage())  # type: ignore[attr-defined]
        return None
    held = w.clone()
    w.copy_(t)
    return held


def _swap_out(w: torch.Tensor, t: torch.Tensor, held: torch.Tensor | None) -> None:
    """Undo ``_swap_in``: ``w`` holds its own contents again and ``t`` its own."""
    if held is None:
        w.untyped_storage()._swap_data_ptr_(t.untyped_storage())  # type: ignore[attr-defined]
    else:
        w.copy_(held)


# --------------------------------------------------------------------- helpers
def _non_finite_grad(module: nn.Module) -> str | None:
    """The name of the first parameter whose gradient holds a NaN or an infinity, if any.

    A finite sum proves every element finite, and summing is one vectorized pass (``isfinite``
    or an infinity norm costs 20-30x more on CPU); only a non-finite sum, which finite but huge
    gradients can also give, is checked element by element.
    """
    named = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None]
    if not named or torch.isfinite(torch.stack([g.sum() for _, g in named])).all():
        return None
    return next((name for name, g in named if not torch.isfinite(g).all()), None)


def _flat(x: Activation) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _prepare_input(x: Activation, device: torch.device, requires_grad: bool) -> Activation:
    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device).detach()
        if requires_grad and t.is_floating_point():
            t.requires_grad_(True)
        return t

    return tuple(one(t) for t in x) if isinstance(x, (tuple, list)) else one(x)


def _detach(x: Activation) -> Activation:
    return tuple(t.detach() for t in x) if isinstance(x, (tuple, list)) else x.detach()


def _input_grad(inputs: Activation) -> Activation:
    grads = tuple(t.grad if t.requires_grad else None for t in _flat(inputs))
    return grads if isinstance(inputs, tuple) else grads[0]


def _rng_state(device: torch.device) -> tuple[torch.Tensor, ...]:
    state = [torch.get_rng_state()]
    if device.type == "cuda":
        state.append(torch.cuda.get_rng_state(device))
    return tuple(state)


def _set_rng_state(state: tuple[torch.Tensor, ...] | None, device: torch.device) -> None:
    if state is None:
        return
    torch.set_rng_state(state[0])
    if device.type == "cuda" and len(state) > 1:
        torch.cuda.set_rng_state(state[1], device)
