"""``StageActor``: a thin Ray actor around one ``Stage`` (or the model chunks of one rank), hosting the actor side
(endpoint) of its transport."""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch

from rayspec.core.activations import Activation
from rayspec.core.device import deterministic, nccl_problem, to_device
from rayspec.core.stage import Stage
from rayspec.exec.base import stage_stats
from rayspec.exec.ray.wire import as_tensors

__all__ = ["StageActor"]

log = logging.getLogger(__name__)


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class StageActor:
    """Runs one stage's actions as the driver's transport asks; logs carry a ``[stage k]`` prefix.

    ``forward``, ``backward`` and ``forward_backward`` are the object-store transport's calls and what every
    transport's endpoint runs (``rayspec.exec.ray.transport.StageOps``). A transport's own actor side is an
    endpoint that the actor hosts whatever its kind: ``open_endpoint`` builds it, ``endpoint_call`` calls it.

    With virtual stages (interleaved 1F1B) the actor of rank ``r`` holds the model chunks ``r, r + N, ...``, each a
    ``Stage`` of its own (``chunks``, by stage index); an action names its chunk by ``chunk``, the stage index
    (``None``: the actor's first, ``stage``). State, statistics and timelines come per chunk, lowest index first.
    """

    def __init__(self, stage: Stage | Sequence[Stage], threads: int = 1) -> None:
        torch.set_num_threads(max(1, threads))
        _warm_up_backward()
        # Zero-copy transport is safe here: a stage sends only fresh activations and gradients that
        # it never writes again, and copies what it receives before writing (``load``).
        warnings.filterwarnings("ignore", message="Zero-copy tensor serialization is enabled")
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        self.endpoint: Any = None  # the transport's actor side (open_endpoint)
        self.load(stage)

    def load(self, stage: Stage | Sequence[Stage]) -> None:
        """Replace the stage, or the model chunks (new weights, optimizer and policy), on this live actor."""
        # Own writable copies: zero-copy deserialization hands out read-only shared memory,
        # and a stage updates its weights in place.
        stages = copy.deepcopy([stage] if isinstance(stage, Stage) else list(stage))
        for st in stages:
            if ray.get_gpu_ids():  # given a GPU: compute there, whatever the driver has (a CPU-only head, say)
                st.to("cuda")
        self.chunks: dict[int, Stage] = {st.index: st for st in sorted(stages, key=lambda st: st.index)}
        self.stage = next(iter(self.chunks.values()))
        self.losses: dict[int, torch.Tensor] = {}  # the last stage's, on its device
        self.failed: BaseException | None = None  # a failed finish_update, raised again by every later action
        log.debug("[stage %s] loaded", ",".join(map(str, self.chunks)))

    # ------------------------------------------------------------------ actions
    def forward(self, m: int, x: Activation, labels: Any = None, s: int = 0, chunk: int | None = None) -> Activation:
        self._raise_failed()
        stage = self._chunk(chunk)
        out = stage.forward(m, self._here(x), self._here(labels), s)
        if stage.is_last:
            self.losses[m] = out  # on the stage's device until pop_losses: no host round trip per micro-batch
            return None
        return _contiguous(out)

    def backward(self, m: int, grad: Activation | None = None, s: int = 0, update: bool = False,
                 chunk: int | None = None) -> Activation:
        self._raise_failed()
        return _contiguous(self._chunk(chunk).backward(m, self._here(grad), s, update))

    def forward_backward(self, m: int, x: Activation, labels: Any, s: int, s_b: int, update: bool,
                         chunk: int | None = None) -> Activation:
        """The last stage's ``F(m)`` and ``B(m)`` in one call: one actor call fewer on the critical path."""
        self._raise_failed()
        stage = self._chunk(chunk)
        self.losses[m] = stage.forward(m, self._here(x), self._here(labels), s)
        return _contiguous(stage.backward(m, None, s_b, update))

    def backward_input(self, m: int, grad: Activation | None = None, chunk: int | None = None) -> Activation:
        """``I(m)``: the input-gradient half of a split backward (``rayspec.core.split``)."""
        self._raise_failed()
        return _contiguous(self._chunk(chunk).backward_input(m, self._here(grad)))

    def backward_weight(self, m: int, update: bool = False, chunk: int | None = None) -> None:
        """``W(m)``: the weight-gradient half of a split backward; ``update`` steps the optimizer after it."""
        self._raise_failed()
        self._chunk(chunk).backward_weight(m, update)

    def _chunk(self, index: int | None) -> Stage:
        """The model chunk of stage ``index`` (``None``: the first)."""
        return self.stage if index is None else self.chunks[index]

    def pop_losses(self) -> dict[int, float]:
        """The losses since the last call, fetched from the device at once (one synchronization per chunk); raises
        for a non-finite loss or gradient since the last call (``FiniteChecks``)."""
        for stage in self.chunks.values():
            stage.checks.flush()
        out, self.losses = self.losses, {}
        if not out:
            return {}
        return dict(zip(out, torch.stack([v.reshape(()) for v in out.values()]).tolist()))

    def _here(self, x: Any) -> Any:
        """What came over the wire as tensors on the stage's device: numpy copied out of Ray's read-only memory
        on CPU; to a GPU through pinned memory, asynchronously."""
        if self.stage.device.type == "cpu":
            return as_tensors(x)
        return to_device(as_tensors(x, copy=False), self.stage.device)

    # ------------------------------------------------------------------ device
    def nccl_problem(self, kind: str, transport: str) -> str | None:
        """Why this actor cannot run the NCCL ``kind`` that ``transport`` uses (``rayspec.core.device``), else None."""
        return nccl_problem(kind, transport)

    def deterministic(self, on: bool = True) -> None:
        """Comparable numbers in this actor (TF32 off, cuDNN deterministic), as an equality check needs them."""
        deterministic(on)

    def grad_norms(self) -> torch.Tensor:
        """The norms of this stage's gradients (global clipping: ``Stage.grad_norms``)."""
        return self.stage.grad_norms()

    def finish_update(self, *norms: torch.Tensor) -> None:
        """Apply the update waiting for the global norm in every chunk, from every stage's ``grad_norms`` (stage 0's
        first). The object-store transport waits on no call of it: a failure here is raised again by the stage's
        next action."""
        try:
            for stage in self.chunks.values():
                stage.finish_update(norms)
        except BaseException as err:
            self.failed = err
            raise

    def _raise_failed(self) -> None:
        if self.failed is not None:
            raise self.failed

    # ------------------------------------------------------------------ transport
    def open_endpoint(self, factory: Callable[..., Any], *args: Any) -> None:
        """Host a new endpoint of the transport, ``factory(self, *args)`` (``Transport.open_endpoints``)."""
        self.endpoint = factory(self, *args)

    def endpoint_call(self, name: str, *args: Any) -> Any:
        """The endpoint's method ``name`` on ``args``: every call a transport makes on its actor side, one Ray method
        (a compiled graph binds it with ``name`` as a constant). The lookup by name costs about 0.35 us a call more
        than a method of its own (on the 2-core CPU box), against milliseconds a hop."""
        return getattr(self.endpoint, name)(*args)

    def synchronize(self) -> None:
        """Return once this stage's device has run everything queued (a timing then measures work done, not queued)."""
        if self.stage.device.type == "cuda":
            torch.cuda.synchronize(self.stage.device)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for stage in self.chunks.values() for k, v in stage.state_dict().items()}

    def stats(self) -> list[dict]:
        """Per chunk, lowest stage index first: ``rayspec.exec.base.stage_stats``."""
        return [stage_stats(stage) for stage in self.chunks.values()]

    def timeline(self) -> list[list[tuple[str, int, float, float]]]:
        """Per chunk, lowest stage index first: its actions' ``(kind, micro-batch, start, end)``."""
        for stage in self.chunks.values():
            stage.clock.settle()
        return [stage.timeline for stage in self.chunks.values()]

    def node_id(self) -> str:
        """The id of the Ray node this actor runs on."""
        return ray.get_runtime_context().get_node_id()

    def checkpoint_state(self) -> list[dict[str, Any]]:
        """Per chunk, lowest stage index first: ``Stage.checkpoint_state``."""
        for stage in self.chunks.values():
            stage.clock.settle()
        return [stage.checkpoint_state() for stage in self.chunks.values()]


def _warm_up_backward() -> None:
    """One tiny backward given an output gradient, as a stage's backward is. The first such backward in a process
    imports ``torch.fx.experimental.symbolic_shapes`` (``torch.autograd``'s ``_make_grads``), 0.16 s on an idle
    2-core machine and 0.4-0.6 s on a busy one: in a pipeline's first segment the stages paid it one after another,
    each first backward waiting for its successor's. Here each actor pays it while it starts, all at once."""
    x = torch.ones(1, requires_grad=True)
    torch.autograd.backward([x * 2.0], [torch.ones(1)])


def _contiguous(x: Activation) -> Activation:
    if isinstance(x, tuple):
        return tuple(t if t is None else t.contiguous() for t in x)
    return x if x is None else x.contiguous()
