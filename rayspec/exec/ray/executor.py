"""``RayExecutor``: one ``StageActor`` per stage in a placement group, a transport between them.

The executor owns the actors: it places them (one bundle each), starts them, replaces dead ones and
gathers their state. How a segment's actions and tensors move between them is the transport's
business (``rayspec.exec.ray.transport``; docs/design.md §4); every transport runs each stage's
actions in the schedule's order, so all of them compute what ``LocalExecutor`` computes.

With ``virtual = v`` model chunks per actor (interleaved 1F1B) there are ``N = len(stages) / v`` actors and actor
``r`` hosts stages ``r, r + N, ...`` (torch's loop placement); state, statistics and timelines come back per stage,
stage 0 first, as from ``LocalExecutor``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayspec.core.activations import Activation
from rayspec.core.schedule import Schedule, ScheduleError
from rayspec.core.stage import Stage
from rayspec.core.transports import resolve_transport
from rayspec.errors import ConfigError
from rayspec.exec.base import Executor, MicrobatchFeed, check_stages, clips_globally
from rayspec.exec.ray.actor import StageActor
from rayspec.exec.ray.cluster import reserve_stages
from rayspec.exec.ray.transport import TransportOptions, make_transport

__all__ = ["RayExecutor"]


class RayExecutor(Executor):
    """Runs each stage in its own Ray actor.

    Args:
        stages: the stages to ship to the actors (their current weights and settings).
        method, variant: as for ``LocalExecutor``.
        transport: ``auto``, ``p2p``, ``p2p_nccl``, ``object_store``, ``gloo``, ``nccl`` or ``compiled``
            (``rayspec.core.transports``; [Note: what auto picks] there).
        cpus_per_stage: CPUs reserved by each stage actor (fractional is fine on CPU).
        gpus_per_stage: GPUs per stage actor (1 on GPU machines, 0 on CPU, a fraction where stages share a GPU).
        max_in_flight: ``object_store``, ``gloo``, ``nccl``: micro-batches allowed between their stage-0 forward
            and backward; raised to what the schedule itself needs; default twice that.
        chunk: ``compiled`` and ``p2p``: micro-batches per actor call (per execution of the compiled graph).
        placement_group: a group to place the stages in (e.g. a Tune trial's), stage ``k`` in
            bundle ``bundle_offset + k``, or ``bundles[k]`` when given; by default the executor creates and owns one.
        placement_strategy: ``PACK`` or ``SPREAD`` for the group it creates.
        virtual: model chunks (stages) per stage actor; ``len(stages)`` must be a multiple. Only transports that
            host chunks run more than 1 (``Transport.hosts_chunks``: ``p2p``, ``p2p_nccl``).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        method: str,
        variant: str = "paper",
        *,
        transport: str = "auto",
        cpus_per_stage: float = 1.0,
        gpus_per_stage: float = 0.0,
        max_in_flight: int | None = None,
        placement_group: PlacementGroup | None = None,
        bundle_offset: int = 0,
        placement_strategy: str = "PACK",
        chunk: int = 16,
        virtual: int = 1,
        bundles: Sequence[int] | None = None,
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("call ray.init() before creating a RayExecutor")
        if virtual < 1 or len(stages) % virtual:
            raise ValueError(f"{len(stages)} stages cannot be split into {virtual} chunks per stage actor")
        self.method, self.variant = method, variant
        self.num_stages, self.virtual = len(stages), virtual
        self.link = make_transport(resolve_transport(transport, gpus_per_stage),
                                   TransportOptions(chunk, max_in_flight, gpus_per_stage, cpus_per_stage, virtual))
        if virtual > 1 and not self.link.hosts_chunks:
            raise ConfigError(f"pipeline.virtual_stages={virtual}: pipeline.transport={self.link.name} runs one stage "
                              "per stage actor; use pipeline.transport=p2p (or p2p_nccl, or auto), whose stage actors "
                              "host several model chunks, or pipeline.executor=local")
        self._owns_pg = placement_group is None
        ranks = self.num_stages // virtual
        if placement_group is None:
            placement_group = reserve_stages(ranks, cpus_per_stage, gpus_per_stage, placement_strategy)
            bundle_offset, bundles = 0, None
        self.pg = placement_group
        self._resources = (cpus_per_stage, gpus_per_stage)
        self._bundles = list(bundles) if bundles is not None else [bundle_offset + k for k in range(ranks)]
        self._clipping(stages)
        self.actors = [self._spawn(k, chunks) for k, chunks in enumerate(self._per_actor(stages))]
        ray.get([a.stats.remote() for a in self.actors])  # wait until every actor is up
        self.link.start(self.actors)

    @property
    def transport(self) -> str:
        """The transport the stages use (what ``auto`` resolved to)."""
        return self.link.name

    @property
    def can_revive(self) -> bool:
        return self.link.replaces != "none"

    def _clipping(self, stages: Sequence[Stage]) -> None:
        """Tell the transport whether it must gather every stage's gradient norm before an update (raises where it
        cannot)."""
        self.link.clip_globally(clips_globally(stages), self.method)

    def _per_actor(self, stages: Sequence[Stage]) -> list[list[Stage]]:
        """Each actor's stages: actor ``r`` hosts ``r, r + N, ...``."""
        ranks = len(stages) // self.virtual
        return [list(stages[r::ranks]) for r in range(ranks)]

    def _by_stage(self, per_actor: Sequence[Sequence[Any]]) -> list[Any]:
        """Per-actor lists (each actor's chunks, lowest stage first) as one list in stage order."""
        ranks = len(per_actor)
        return [per_actor[k % ranks][k // ranks] for k in range(self.num_stages)]

    def _spawn(self, k: int, stage: Stage | Sequence[Stage]) -> Any:
        """A stage actor for rank ``k`` (its stage, or its model chunks) in its bundle."""
        cpus, gpus = self._resources
        env = {"env_vars": dict(self.link.env)} if self.link.env else None
        return StageActor.options(  # type: ignore[attr-defined]
            num_cpus=cpus,
            num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                 placement_group_bundle_index=self._bundles[k]),
            runtime_env=env,
        ).remote(stage, max(1, int(cpus)))

    def revive(self, stages: Sequence[Stage], timeout_s: float = 120.0) -> list[int]:
        """After a stage actor died: start new actors for the dead stages (in their bundles), load ``stages``
        into every actor, and return the stages replaced. Live actors are kept (no new processes), except
        where the transport needs every actor new (``p2p``).

        Raises:
            RuntimeError: with a Ray Direct Transport (``gloo``/``nccl``), whose collective group cannot be
                rebuilt around a dead member; close this executor and create a new one instead.
        """
        if not self.can_revive:
            raise RuntimeError(f"transport={self.transport}: a collective group cannot be revived; recreate the executor")
        if len(stages) != self.num_stages:
            raise ValueError(f"got {len(stages)} stages for {self.num_stages} actors")
        self._clipping(stages)
        if self.link.replaces == "all":
            self._respawn(stages)
            return list(range(self.num_stages))
        assert self.virtual == 1, "only transports that replace all actors host model chunks"
        self.link.stop()
        pings = [a.stats.remote() for a in self.actors]  # answered after what is still queued on a live actor
        ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        dead, ready = [], []
        for k, ping in enumerate(pings):
            try:
                ray.get(ping, timeout=0)
            except Exception:  # died, or did not answer in time: replace it
                dead.append(k)
                ray.kill(self.actors[k])
                self.actors[k] = self._spawn(k, stages[k])
                ready.append(self.actors[k].stats.remote())
            else:
                ready.append(self.actors[k].load.remote(stages[k]))
        ray.get(ready)
        self.link.start(self.actors)
        return dead

    def load(self, stages: Sequence[Stage]) -> None:
        """Ship new stages to the live actors (same count), e.g. to restart from other weights; after a segment
        that left the actors unusable (``p2p``): to new actors."""
        if len(stages) != self.num_stages:
            raise ValueError(f"got {len(stages)} stages for {self.num_stages} actors")
        self._clipping(stages)
        if self.link.broken:
            self._respawn(stages)
            return
        ray.get([a.load.remote(chunks) for a, chunks in zip(self.actors, self._per_actor(stages))])

    def _respawn(self, stages: Sequence[Stage]) -> None:
        """New actors for every stage, in the same bundles, and the transport set up among them."""
        self.link.stop()
        for a in self.actors:
            ray.kill(a)
        self.actors = [self._spawn(k, chunks) for k, chunks in enumerate(self._per_actor(stages))]
        ray.get([a.stats.remote() for a in self.actors])
        self.link.start(self.actors)

    def run(
        self,
        schedule: Schedule,
        microbatches: Iterable[tuple[Activation, torch.Tensor]],
        on_loss: Callable[[int, float], None] | None = None,
    ) -> list[float]:
        if schedule.virtual != self.virtual:
            raise ScheduleError(f"the {schedule.name} schedule puts {schedule.virtual} stages on each rank, but each "
                                f"stage actor hosts {self.virtual}; create the executor with virtual={schedule.virtual} "
                                "(pipeline.virtual_stages)")
        if schedule.splits_backward and self.transport not in ("p2p", "p2p_nccl"):
            raise ScheduleError(f"pipeline.transport={self.transport} runs no split backward (I and W actions); use "
                                "pipeline.transport=p2p or p2p_nccl, or pipeline.executor=local")
        check_stages(schedule, self.num_stages)
        feed = MicrobatchFeed(microbatches, schedule.microbatches)
        losses: dict[int, float] = {}

        def take(part: dict[int, float]) -> None:
            for m, loss in sorted(part.items()):
                losses[m] = loss
                if on_loss is not None:
                    on_loss(m, loss)

        self.link.run(schedule, schedule.differences(self.method, self.variant), feed, take)
        return [losses[m] for m in range(schedule.microbatches)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        with warnings.catch_warnings():  # Ray hands out read-only tensors; we copy them right away
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            parts = ray.get([a.state_dict.remote() for a in self.actors])
        for part in parts:
            merged.update({k: v.clone() for k, v in part.items()})  # writable, not shared memory
        return merged

    def stage_stats(self) -> list[dict]:
        return self._by_stage(ray.get([a.stats.remote() for a in self.actors]))

    def synchronize(self) -> None:
        ray.get([a.synchronize.remote() for a in self.actors])

    def timeline(self) -> list[list[tuple[str, int, float, float]]]:
        return self._by_stage(ray.get([a.timeline.remote() for a in self.actors]))

    def node_ids(self) -> list[str] | None:
        """The Ray node of each stage, stage 0 first (what ``placement_strategy`` decided)."""
        nodes = ray.get([a.node_id.remote() for a in self.actors])
        return self._by_stage([[node] * self.virtual for node in nodes])

    def checkpoint_states(self) -> list[dict]:
        with warnings.catch_warnings():  # read-only zero-copy tensors: the checkpoint writer only reads them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return self._by_stage(ray.get([a.checkpoint_state.remote() for a in self.actors]))

    def close(self) -> None:
        link = getattr(self, "link", None)
        if link is not None:
            link.stop()
        for a in getattr(self, "actors", []):
            ray.kill(a)
        self.actors = []
        if getattr(self, "_owns_pg", False) and getattr(self, "pg", None) is not None:
            remove_placement_group(self.pg)
            self._owns_pg = False  # removed once
