"""``RayExecutor``: one ``StageActor`` per stage in a placement group, driven by ObjectRefs passed stage to stage.

The driver submits each stage's actions in schedule order; Ray runs one caller's calls on an
actor in submission order, so the pipeline advances by data flow, with no driver round trip
per action. Activations and gradients go from actor to actor (object store, or Ray Direct
Tensor Transport with ``gloo``/``nccl``), never through the driver. The driver waits only to
bound the micro-batches in flight.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayspec.compiled import ChunkRunner, CompiledPipeline, _as_tensors, _wire
from rayspec.config import TRANSPORTS, ConfigError
from rayspec.executor import Executor, MicrobatchFeed, check_stages, fused_backward, plan, stats_of
from rayspec.p2p import P2PPipeline, P2PRunner
from rayspec.schedule import Schedule
from rayspec.stage import Activation, Stage

__all__ = ["RayExecutor", "StageActor", "TRANSPORTS", "resolve_transport", "reserve_stages", "bundle_resources",
           "actor_died", "task_cause"]

log = logging.getLogger(__name__)

_ZERO_COPY = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}


def ensure_ray(options: Mapping[str, Any]) -> None:
    """Start Ray with the config's ``ray`` section (``address``, ``num_cpus``, ``log_to_driver``) unless it runs."""
    if not ray.is_initialized():
        ray.init(address=options.get("address"), num_cpus=options.get("num_cpus"), include_dashboard=False,
                 log_to_driver=options.get("log_to_driver", True))


def stage_resources(cpus: float | None, gpus: float | None, stages: int, reserved_cpus: float = 0.0) -> tuple[float, float]:
    """CPUs and GPUs of one stage actor (or worker): by default the cluster's CPUs, less ``reserved_cpus``,
    shared among ``stages`` (at most 1 each), and one GPU each when the cluster has GPUs."""
    if cpus is None:
        total = ray.cluster_resources().get("CPU", 1.0) - reserved_cpus
        cpus = max(0.01, math.floor(min(1.0, total / stages) * 100) / 100)
    if gpus is None:  # the cluster's GPUs, not the driver's: a job's driver may run on a CPU-only head
        gpus = default_gpus(ray.cluster_resources().get("GPU", 0.0), stages)
    return float(cpus), float(gpus)


def default_gpus(available: float, stages: int) -> float:
    """GPUs per stage when ``pipeline.gpus_per_stage`` is null: one each on a cluster with GPUs, none without."""
    if 0 < available < stages:
        raise ConfigError(
            f"{stages} stages need one GPU each but the Ray cluster has {available:g}; lower pipeline.stages, "
            "or set pipeline.gpus_per_stage (0 for CPU stages)"
        )
    return 1.0 if available else 0.0


def reserve_stages(stages: int, cpus: float, gpus: float, strategy: str = "PACK",
                   timeout_s: float = 120.0) -> PlacementGroup:
    """A placement group of one ``{CPU: cpus, GPU: gpus}`` bundle per stage, ready; raises ``ConfigError``
    naming what is missing when the cluster cannot place it within ``timeout_s``."""
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    group = ray.util.placement_group([bundle] * stages, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        have = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise ConfigError(
            f"the Ray cluster could not place {stages} stage bundle(s) of {bundle} ({strategy}) in {timeout_s:g} s; "
            f"it has {have or 'none'} free: lower pipeline.stages or pipeline.cpus_per_stage/gpus_per_stage, "
            "or add nodes"
        )
    return group


def bundle_resources(group: PlacementGroup, index: int) -> tuple[float, float]:
    """The CPUs and GPUs that bundle ``index`` of ``group`` holds."""
    spec = group.bundle_specs[index]
    return float(spec.get("CPU", 0.0)), float(spec.get("GPU", 0.0))


def actor_died(err: BaseException) -> bool:
    """Whether ``err`` (or what it wraps) says a stage actor or an object it made was lost."""
    from ray.exceptions import ObjectLostError, RayActorError

    seen = 0
    cause: BaseException | None = err
    while cause is not None and seen < 10:
        if isinstance(cause, (RayActorError, ObjectLostError)):
            return True
        cause, seen = getattr(cause, "cause", None) or cause.__cause__, seen + 1
    return False


def task_cause(err: BaseException) -> BaseException:
    """The exception a stage raised inside its actor, unwrapped from Ray's ``RayTaskError``; else ``err``."""
    from ray.exceptions import RayTaskError

    while isinstance(err, RayTaskError) and isinstance(getattr(err, "cause", None), BaseException):
        err = err.cause
    return err


def resolve_transport(transport: str, use_gpu: bool) -> str:
    """``auto`` is ``nccl`` RDT on GPUs and ``p2p`` on CPU (``rayspec.p2p``: 1.4x the object store's samples/s
    in the trainer, ``benchmarks.throughput``); ``compiled`` is a Ray Compiled Graph over the same actors
    (``rayspec.compiled``)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"pipeline.transport={transport!r} is unknown; choose one of {', '.join(TRANSPORTS)}")
    if transport == "auto":
        return "nccl" if use_gpu else "p2p"
    return transport


@ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
class StageActor(ChunkRunner, P2PRunner):
    """A thin Ray wrapper around one ``Stage``; logs carry a ``[stage k]`` prefix."""

    def __init__(self, stage: Stage, threads: int = 1) -> None:
        torch.set_num_threads(max(1, threads))
        # Zero-copy transport is safe here: a stage sends only fresh activations and gradients that
        # it never writes again, and copies what it receives before writing (``load``).
        warnings.filterwarnings("ignore", message="Zero-copy tensor serialization is enabled")
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        self.load(stage)

    def load(self, stage: Stage) -> None:
        """Replace the stage (new weights, optimizer and policy) on this live actor."""
        # Own writable copies: zero-copy deserialization hands out read-only shared memory,
        # and a stage updates its weights in place.
        stage = copy.deepcopy(stage)
        if ray.get_gpu_ids():  # given a GPU: compute there, whatever the driver has (a CPU-only head, say)
            stage.to("cuda")
        self.stage = stage
        self.losses: dict[int, float] = {}
        logging.getLogger(__name__).debug("[stage %d] loaded", stage.index)

    def forward(self, m: int, x: Activation, labels: torch.Tensor | None = None, s: int = 0) -> Activation:
        out = self.stage.forward(m, _as_tensors(x), _as_tensors(labels), s)
        if self.stage.is_last:
            self.losses[m] = float(out)
            return None
        return _contiguous(out)

    def backward(self, m: int, grad: Activation | None = None, s: int = 0, update: bool = False) -> Activation:
        return _contiguous(self.stage.backward(m, grad, s, update))

    def forward_backward(
        self, m: int, x: Activation, labels: torch.Tensor, s: int, s_b: int, update: bool
    ) -> Activation:
        """The last stage's ``F(m)`` and ``B(m)`` in one call: one actor call fewer on the critical path."""
        self.losses[m] = float(self.stage.forward(m, _as_tensors(x), _as_tensors(labels), s))
        return _contiguous(self.stage.backward(m, None, s_b, update))

    def pop_losses(self) -> dict[int, float]:
        out, self.losses = self.losses, {}
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.stage.state_dict()

    def stats(self) -> dict:
        return stats_of(self.stage)

    def records(self) -> list[dict[str, Any]]:
        return self.stage.records

    def timeline(self) -> list[tuple[str, int, float, float]]:
        return self.stage.timeline

    def get_stage(self) -> Stage:
        return self.stage

    def node_id(self) -> str:
        """The id of the Ray node this actor runs on."""
        return ray.get_runtime_context().get_node_id()

    def checkpoint_state(self) -> dict[str, Any]:
        return self.stage.checkpoint_state()


def _contiguous(x: Activation) -> Activation:
    if isinstance(x, tuple):
        return tuple(t if t is None else t.contiguous() for t in x)
    return x if x is None else x.contiguous()


@functools.cache  # once per process and setting, however many executors a study or benchmark creates
def _warn_compiled_shares_cores(cpus_per_stage: float) -> None:
    log.warning("pipeline.transport=compiled with %.2g CPUs per stage: a compiled graph's stage spins a core while "
                "it waits, so stages that share cores slow each other down; give each stage a core "
                "(pipeline.cpus_per_stage=1) or use pipeline.transport=p2p", cpus_per_stage)


class RayExecutor(Executor):
    """Runs each stage in its own Ray actor.

    Args:
        stages: the stages to ship to the actors (their current weights and settings).
        method, variant: as for ``LocalExecutor``.
        transport: ``auto``, ``object_store``, ``gloo``, ``nccl``, ``compiled`` or ``p2p`` (see ``resolve_transport``).
        cpus_per_stage: CPUs reserved by each stage actor (fractional is fine on CPU).
        gpus_per_stage: GPUs per stage actor (1 on GPU machines, 0 on CPU).
        max_in_flight: micro-batches allowed between their stage-0 forward and backward; raised
            to what the schedule itself needs; default twice that (``compiled``, ``p2p``: what the schedule
            needs, plus the inputs of two chunks).
        chunk: ``compiled`` and ``p2p``: micro-batches per execution of the compiled graph, per call to a stage.
        placement_group: a group to place the stages in (e.g. a Tune trial's), stage ``k`` in
            bundle ``bundle_offset + k``; by default the executor creates and owns one.
        placement_strategy: ``PACK`` or ``SPREAD`` for the group it creates.
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
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("call ray.init() before creating a RayExecutor")
        self.method, self.variant = method, variant
        self.num_stages = len(stages)
        self.transport = resolve_transport(transport, gpus_per_stage > 0)
        if self.transport == "p2p" and gpus_per_stage > 0:
            raise ConfigError(
                f"pipeline.transport=p2p moves CPU tensors over gloo, but the stages have {gpus_per_stage:g} GPU each; "
                "use pipeline.transport=nccl or compiled on GPUs (or pipeline.gpus_per_stage=0)"
            )
        self.max_in_flight = max_in_flight
        self._owns_pg = placement_group is None
        if placement_group is None:
            placement_group = reserve_stages(self.num_stages, cpus_per_stage, gpus_per_stage, placement_strategy)
            bundle_offset = 0
        self.pg = placement_group
        self._resources = (cpus_per_stage, gpus_per_stage, bundle_offset)
        self.actors = [self._spawn(k, stage) for k, stage in enumerate(stages)]
        ray.get([a.stats.remote() for a in self.actors])  # wait until every actor is up
        self._rdt = self.transport in ("gloo", "nccl") and self.num_stages > 1
        if self._rdt:
            from ray.experimental.collective import create_collective_group

            create_collective_group(self.actors, backend=self.transport)
        self._compiled = self._p2p = None
        self._chunk = chunk
        if self.transport == "p2p":
            self._p2p = P2PPipeline(self.actors, chunk)
        if self.transport == "compiled":
            self._compiled = CompiledPipeline(self.actors, chunk, nccl=gpus_per_stage >= 1)
            if gpus_per_stage == 0 and cpus_per_stage < 1:
                _warn_compiled_shares_cores(cpus_per_stage)

    def _spawn(self, k: int, stage: Stage) -> Any:
        """A stage actor for stage ``k`` in its bundle."""
        cpus, gpus, offset = self._resources
        env = {"env_vars": dict(_ZERO_COPY)} if self.transport in ("object_store", "p2p") else None
        return StageActor.options(  # type: ignore[attr-defined]
            num_cpus=cpus,
            num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                 placement_group_bundle_index=offset + k),
            runtime_env=env,
        ).remote(stage, max(1, int(cpus)))

    def revive(self, stages: Sequence[Stage], timeout_s: float = 120.0) -> list[int]:
        """After a stage actor died: start new actors for the dead stages (in their bundles), load ``stages``
        into every actor, and return the stages replaced. Live actors are kept (no new processes).

        Raises:
            RuntimeError: with a Ray Direct Transport (``gloo``/``nccl``), whose collective group cannot be
                rebuilt around a dead member; close this executor and create a new one instead.
        """
        if self._rdt:
            raise RuntimeError(f"transport={self.transport}: a collective group cannot be revived; recreate the executor")
        if self._p2p is not None:  # a failed segment leaves the live stages waiting on their neighbours
            self._respawn(stages)
            return list(range(self.num_stages))
        if self._compiled is not None:
            self._compiled.teardown()
        if len(stages) != self.num_stages:
            raise ValueError(f"got {len(stages)} stages for {self.num_stages} actors")
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
                if self._compiled is not None:
                    self._compiled.actors[k] = self.actors[k]
                ready.append(self.actors[k].stats.remote())
            else:
                ready.append(self.actors[k].load.remote(stages[k]))
        ray.get(ready)
        return dead

    def load(self, stages: Sequence[Stage]) -> None:
        """Ship new stages to the live actors (same count), e.g. to restart from other weights; ``p2p`` after a
        failed segment: to new actors."""
        if len(stages) != self.num_stages:
            raise ValueError(f"got {len(stages)} stages for {self.num_stages} actors")
        if self._p2p is not None and self._p2p.broken:
            self._respawn(stages)
            return
        ray.get([a.load.remote(st) for a, st in zip(self.actors, stages)])

    def _respawn(self, stages: Sequence[Stage]) -> None:
        """``p2p``: new actors for every stage, in the same bundles, and a new gloo group among them."""
        for a in self.actors:
            ray.kill(a)
        self.actors = [self._spawn(k, stage) for k, stage in enumerate(stages)]
        ray.get([a.stats.remote() for a in self.actors])
        self._p2p = P2PPipeline(self.actors, self._chunk)

    def _call(self, method: Any, sends_tensors: bool) -> Any:
        if self._rdt and sends_tensors:
            return method.options(tensor_transport=self.transport)
        return method

    def run(
        self,
        schedule: Schedule,
        microbatches: Iterable[tuple[Activation, torch.Tensor]],
        on_loss: Callable[[int, float], None] | None = None,
        report_every: int = 10,
    ) -> list[float]:
        """See ``Executor.run``; losses are fetched from the last stage every ``report_every`` micro-batches."""
        n = self.num_stages
        check_stages(schedule, n)
        feed = MicrobatchFeed(microbatches, schedule.microbatches)
        losses: dict[int, float] = {}
        if self._compiled is not None or self._p2p is not None:

            def chunk_done(part: dict[int, float]) -> None:
                for m, loss in sorted(part.items()):
                    losses[m] = loss
                    if on_loss is not None:
                        on_loss(m, loss)

            if self._p2p is not None:
                self._p2p.run(schedule, self.method, self.variant, feed, chunk_done)
            elif self._compiled is not None:
                self._compiled.run(schedule, schedule.differences(self.method, self.variant), feed, chunk_done)
            return [losses[m] for m in range(schedule.microbatches)]
        s = schedule.differences(self.method, self.variant)
        reports: deque = deque()  # pop_losses refs, oldest first
        last_forwards = 0
        # The bound is for memory; it must never stall the pipeline: the driver submits in one
        # global order, so waiting on a recent backward would hold back calls that other stages
        # could already run. Default: twice what the schedule itself keeps in flight.
        need = schedule.max_in_flight(0)
        window = max(self.max_in_flight or 2 * need, need)
        acts: dict[tuple[int, int], Any] = {}
        grads: dict[tuple[int, int], Any] = {}
        done0: deque = deque()  # stage-0 backward refs not yet waited on, oldest first
        started0 = finished0 = 0  # stage-0 forwards submitted, stage-0 backwards known done
        last = n - 1
        for p in plan(schedule, s):
            a, k, m = p.action, p.action.stage, p.action.microbatch
            actor = self.actors[k]
            if a.kind == "F":
                if k == 0:
                    while started0 - finished0 >= window and done0:
                        ray.get(done0.popleft())  # raises here if any stage failed on that micro-batch
                        finished0 += 1
                    started0 += 1
                    self._collect(reports, losses, on_loss, block=False)
                # What the driver sends goes as numpy arrays, which Ray ships without a copy (tensors: pickled)
                x = _wire(feed.input(m)) if k == 0 else acts.pop((k - 1, m))
                if p.fused:
                    sb, update = fused_backward(schedule, m, s)
                    ref = self._call(actor.forward_backward, k > 0).remote(m, x, _wire(feed.labels(m)), p.s, sb, update)
                    self._after_backward(k, m, ref, grads, done0)
                elif k == last:
                    actor.forward.remote(m, x, _wire(feed.labels(m)), p.s)
                else:
                    acts[(k, m)] = self._call(actor.forward, True).remote(m, x, None, p.s)
            else:
                g = None if k == last else grads.pop((k + 1, m))
                ref = self._call(actor.backward, k > 0).remote(m, g, p.s, a.update)
                self._after_backward(k, m, ref, grads, done0)
            if k == last and a.kind == "F":
                last_forwards += 1
                if on_loss is not None and last_forwards % report_every == 0:
                    reports.append(self.actors[last].pop_losses.remote())
        ray.get(list(done0))
        reports.append(self.actors[last].pop_losses.remote())
        self._collect(reports, losses, on_loss, block=True)
        return [losses[m] for m in range(schedule.microbatches)]

    @staticmethod
    def _collect(reports: deque, losses: dict, on_loss: Callable | None, block: bool) -> None:
        while reports:
            if not block and not ray.wait([reports[0]], timeout=0)[0]:
                return
            for m, loss in sorted(ray.get(reports.popleft()).items()):
                losses[m] = loss
                if on_loss is not None:
                    on_loss(m, loss)

    @staticmethod
    def _after_backward(k: int, m: int, ref: Any, grads: dict, done0: deque) -> None:
        if k == 0:
            done0.append(ref)
        else:
            grads[(k, m)] = ref

    def state_dict(self) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        with warnings.catch_warnings():  # Ray hands out read-only tensors; we copy them right away
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            parts = ray.get([a.state_dict.remote() for a in self.actors])
        for part in parts:
            merged.update({k: v.clone() for k, v in part.items()})  # writable, not shared memory
        return merged

    def stage_stats(self) -> list[dict]:
        return ray.get([a.stats.remote() for a in self.actors])

    def stages(self) -> list[Stage]:
        """Copies of the live stages (weights, optimizer, version), fetched from the actors."""
        return ray.get([a.get_stage.remote() for a in self.actors])

    def records(self) -> list[list[dict[str, Any]]]:
        return ray.get([a.records.remote() for a in self.actors])

    def timeline(self) -> list[list[tuple[str, int, float, float]]]:
        return ray.get([a.timeline.remote() for a in self.actors])

    def node_ids(self) -> list[str]:
        """The Ray node of each stage actor, stage 0 first (what ``placement_strategy`` decided)."""
        return ray.get([a.node_id.remote() for a in self.actors])

    def checkpoint_states(self) -> list[dict]:
        with warnings.catch_warnings():  # read-only zero-copy tensors: the checkpoint writer only reads them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return ray.get([a.checkpoint_state.remote() for a in self.actors])

    def close(self) -> None:
        compiled = getattr(self, "_compiled", None)
        if compiled is not None:
            compiled.teardown()
        for a in getattr(self, "actors", []):
            ray.kill(a)
        self.actors = []
        if getattr(self, "_owns_pg", False) and getattr(self, "pg", None) is not None:
            remove_placement_group(self.pg)
            self._owns_pg = False  # removed once
