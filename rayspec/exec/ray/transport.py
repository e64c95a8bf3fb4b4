"""The interface every data path of ``RayExecutor`` implements (docs/design.md §4).

A ``Transport`` runs one segment over live stage actors: it submits each stage's actions in the
schedule's order, moves activations and gradients between the actors its own way, and hands the
last stage's losses back as they become known. ``RayExecutor`` owns the actors (placement, start,
replacement) and asks the transport only what it needs to know about them.

Each transport's actor side is an *endpoint*: ``open_endpoints`` gives every stage actor one, built there as
``factory(actor, *args)``, and the driver calls its methods through the actor's one generic entry,
``StageActor.endpoint_call(name, *args)``; an endpoint calls the stage through ``StageOps``. ``make_transport``
builds the transport a line of ``rayspec.core.transports.TRANSPORTS`` names ([Note: transports as plug-ins]
there).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from rayspec.core.activations import Activation
from rayspec.core.schedule import Schedule
from rayspec.core.stage import Stage
from rayspec.core.transports import TRANSPORTS, TransportSpec, check_global_norm
from rayspec.errors import ConfigError
from rayspec.exec.base import MicrobatchFeed

__all__ = ["Transport", "TransportOptions", "make_transport", "StageOps", "LossSink", "ZERO_COPY"]

LossSink = Callable[[dict[int, float]], None]
"""Takes losses of the last stage by micro-batch, in order, as a transport learns them."""
ZERO_COPY = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
"""Stage actors' environment for paths through the object store: a stage sends only fresh activations and
gradients that it never writes again, and copies what it receives before writing."""


class StageOps(Protocol):
    """What a transport's endpoint calls on its stage actor (``rayspec.exec.ray.actor.StageActor``): ``chunk`` names
    the stage (model chunk) of an actor that hosts several (virtual stages), ``None`` its first, ``stage``."""

    stage: Stage
    chunks: dict[int, Stage]

    def forward(self, m: int, x: Activation, labels: torch.Tensor | None = None, s: int = 0,
                chunk: int | None = None) -> Activation: ...

    def backward(self, m: int, grad: Activation | None = None, s: int = 0, update: bool = False,
                 chunk: int | None = None) -> Activation: ...

    def forward_backward(self, m: int, x: Activation, labels: Any, s: int, s_b: int, update: bool,
                         chunk: int | None = None) -> Activation: ...

    def backward_input(self, m: int, grad: Activation | None = None, chunk: int | None = None) -> Activation: ...

    def backward_weight(self, m: int, update: bool = False, chunk: int | None = None) -> None: ...

    def pop_losses(self) -> dict[int, float]: ...

    def finish_update(self, *norms: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class TransportOptions:
    """What the executor knows of the stages that a transport may need (``RayExecutor``'s arguments of these names).

    Attributes:
        chunk: micro-batches per actor call (``p2p``, ``compiled``).
        max_in_flight: micro-batches between their stage-0 forward and backward (one call per action).
        gpus_per_stage, cpus_per_stage: what each stage actor holds.
        virtual: model chunks per stage actor (interleaved 1F1B; ``Transport.hosts_chunks``).
    """

    chunk: int = 16
    max_in_flight: int | None = None
    gpus_per_stage: float = 0.0
    cpus_per_stage: float = 1.0
    virtual: int = 1


def make_transport(name: str, options: TransportOptions | None = None) -> Transport:
    """The transport ``name`` (as ``resolve_transport`` returns it) for stages with ``options``: the class its
    registry line names (``TransportSpec.factory``) builds it."""
    spec = TRANSPORTS[name]
    if spec.factory is None:
        raise ValueError(f"pipeline.transport={name} stands for another transport; resolve it first (resolve_transport)")
    module, _, attr = spec.factory.partition(":")
    factory: type[Transport] = getattr(importlib.import_module(module), attr)
    return factory.create(spec, options or TransportOptions())


class Transport(ABC):
    """One data path between the stage actors.

    Attributes:
        name: the ``pipeline.transport`` it implements.
        replaces: which actors a recovery must replace after a stage actor died: only the ``dead`` ones, or
            ``all`` (the survivors are left waiting on their neighbours); ``none``: this transport cannot
            recover, the executor must be recreated.
        env: environment variables of the stage actors (``None``: Ray's defaults).
        broken: a failed segment left the actors unusable; the next ``load`` recreates them.
        nccl: the NCCL the path uses (``torch`` or ``ray``, ``rayspec.core.transports``), checked in every stage
            actor at ``start``; ``None``: none.
        hosts_chunks: whether it runs stage actors that host several model chunks each (virtual stages, interleaved
            1F1B): each actor runs its rank's actions across its chunks.
        global_norm: the stages' updates wait for the gradient norm over all stages (global clipping, as the
            executor says through ``clip_globally``): the transport gathers every stage's ``grad_norms`` and
            hands them to each stage's ``finish_update`` before any stage acts again.
    """

    name: str
    replaces: Literal["dead", "all", "none"] = "dead"
    env: dict[str, str] | None = None
    broken: bool = False
    nccl: str | None = None
    global_norm: bool = False
    hosts_chunks: bool = False

    @classmethod
    @abstractmethod
    def create(cls, spec: TransportSpec, options: TransportOptions) -> Transport:
        """The transport of registry line ``spec`` (``rayspec.core.transports.TRANSPORTS``) for stages with
        ``options`` (``make_transport``)."""

    def clip_globally(self, on: bool, method: str) -> None:
        """Whether the stages' updates wait for the gradient norm over all stages (``rayspec.exec.base.clips_globally``
        of the stages the executor ships, each time it ships them); raises ``ConfigError`` naming the fix where this
        transport cannot gather the norms before an update (``pipeline.method=method``)."""
        if on:
            check_global_norm(self.name, method)
        self.global_norm = on

    def open_endpoints(self, factory: Callable[..., Any], *args: Any) -> None:
        """Give every stage actor a new endpoint, ``factory(actor, *args)`` built in the actor (its ``StageOps``),
        which the driver then calls through ``actor.endpoint_call``."""
        import ray

        ray.get([a.open_endpoint.remote(factory, *args) for a in self.actors])

    def start(self, actors: Sequence[Any]) -> None:
        """Take the (new) live stage actors, stage 0 first, and set up what the path needs among them; raises
        ``ConfigError`` naming the fix when a stage actor lacks the NCCL the path needs."""
        self.actors = list(actors)
        self.broken = False
        if self.nccl is not None:
            import ray

            problems = ray.get([a.nccl_problem.remote(self.nccl, self.name) for a in self.actors])
            for k, problem in enumerate(problems):
                if problem is not None:
                    raise ConfigError(f"stage {k}: {problem}")

    def stop(self) -> None:  # noqa: B027 - optional hook: nothing to release by default
        """Release what ``start`` set up (before the actors are replaced or killed)."""

    @abstractmethod
    def run(self, schedule: Schedule, s: dict | None, feed: MicrobatchFeed, on_losses: LossSink) -> None:
        """Run one segment: ``s`` are SpecTrain's version differences (``None``: no prediction), ``feed`` gives
        stage 0's inputs and the last stage's labels; raises what a stage raised."""
