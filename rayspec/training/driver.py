"""The driver actor: a Ray run's loop in an actor of its own, and the relay that the calling process runs.

With ``pipeline.executor=ray``, ``rayspec.training.runner.run_training`` hands the run loop (segments, evaluations,
checkpoints, stage restarts, the data feed) to a ``DriverActor``. The actor is placed in the run's driver
bundle: bundle ``bundle_offset - 1`` of a given placement group (a Tune trial's bundle 0), else on the
calling process's node, so the run directory it writes (``metrics.jsonl``, checkpoints, ``summary.json``,
``model.pt``, the trace) is the caller's. The stage actors are reserved by the caller and owned by the
driver actor: they go when it goes.

The caller only relays what the actor streams back (log lines, metrics records, weights at
evaluations, restarts) to its loggers and callbacks (W&B, ``tune.report``, a study's recorder). When
the driver actor is lost, the caller starts a new one from the newest checkpoint; driver and stage
restarts share ``fault.max_restarts``.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import queue
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rayspec.core.transports import resolve_transport
from rayspec.exec.ray.cluster import (
    actor_died,
    bundle_resources,
    profile_in_bundle,
    reserve_stages,
    stage_resources,
)
from rayspec.exec.ray.connect import ensure_ray
from rayspec.training.checkpoint import CheckpointStore
from rayspec.training.console import ROOT, relayed_to
from rayspec.training.context import RunContext
from rayspec.training.failures import death
from rayspec.training.loop import run
from rayspec.training.prepare import Prepared, profile_sample, replan
from rayspec.training.storage import absolute

__all__ = ["DriverActor", "run_in_driver"]


log = logging.getLogger(__name__)

_END, _ERROR = "end", "error"


class _Relay:
    """The driver actor's callback: puts every record, restart and (when asked) weights on the event queue."""

    def __init__(self, events: queue.Queue, weights: bool) -> None:
        self.events = events
        if weights:
            self.on_weights = lambda step, state: events.put(("weights", step, state))

    def on_metrics(self, record: dict[str, Any]) -> None:
        self.events.put(("metrics", record))

    def on_restart(self, index: int, record: dict[str, Any]) -> None:
        self.events.put(("restart", index, record))


class _LogEvents(logging.Handler):
    """The driver actor's log handler: puts every line of the ``rayspec`` loggers on the event queue."""

    def __init__(self, events: queue.Queue) -> None:
        super().__init__()
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        self.events.put(("log", record.name, record.levelno, self.format(record)))


@dataclass
class _Launch:
    """A driver actor's start: the caller's run context less its callbacks and prepared pieces (which are
    shipped apart, once for every driver actor), and what to stream back."""

    run_dir: str
    placement_group: Any
    bundle_offset: int
    own_group: bool
    """Whether the caller reserved ``placement_group`` for this run (not a Tune trial's)."""
    resume_path: str | None
    """The checkpoint to go on from (absolute); None: the start."""
    restarts: list[dict[str, Any]]
    started: float
    weights: bool
    """Whether to stream the weights at evaluations (a callback has ``on_weights``)."""
    level: int
    """The least level of the log lines the caller would show."""

    def context(self, prepared: Prepared, callbacks: list[Any]) -> RunContext:
        ctx = RunContext.create(prepared, Path(self.run_dir), callbacks, self.placement_group, self.bundle_offset)
        ctx.restarts.records, ctx.started, ctx.own_group = self.restarts, self.started, self.own_group
        ctx.go_on_from(absolute(self.resume_path) if self.resume_path else None)
        return ctx


def _portable(err: BaseException) -> BaseException:
    """``err`` with the driver's traceback as a note, or a ``RuntimeError`` naming it when it cannot be pickled."""
    text = "".join(traceback.format_exception(err)).rstrip()
    try:
        err.add_note(f"raised in the driver actor:\n{text}")
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}\nraised in the driver actor:\n{text}")


@ray.remote(num_cpus=0, max_restarts=0)  # type: ignore[call-overload]
class DriverActor:
    """Runs one run loop (``rayspec.training.loop.run``) and streams its events: ``("log", logger, level, line)``,
    ``("metrics", record)``, ``("weights", step, state)``, ``("restart", index, record)``, then
    ``("end", summary)`` or ``("error", exception)``."""

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(max(1, threads))  # evaluation and the data feed run here, as in the caller

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run(self, prepared: Prepared, launch: _Launch) -> Iterator[tuple]:
        events: queue.Queue = queue.Queue()

        def work() -> None:
            try:
                with relayed_to(_LogEvents(events), launch.level):
                    summary = run(launch.context(prepared, [_Relay(events, launch.weights)]))
                events.put((_END, summary))
            except BaseException as err:  # noqa: BLE001 - every failure goes back to the caller
                events.put((_ERROR, _portable(err)))

        thread = threading.Thread(target=work, name="rayspec-run", daemon=True)
        thread.start()
        while True:
            event = events.get()
            yield event
            if event[0] in (_END, _ERROR):
                break
        thread.join()


def _driver_placement(placement_group: Any, bundle_offset: int) -> Any:
    """The driver bundle of ``placement_group`` (the one before the stages'), else the calling process's node."""
    if placement_group is not None and bundle_offset >= 1:
        return PlacementGroupSchedulingStrategy(placement_group=placement_group,
                                                placement_group_bundle_index=bundle_offset - 1)
    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def _absolute(prepared: Prepared) -> Prepared:
    """``prepared`` for the driver actor: absolute paths (its working directory is not the caller's), and
    only the step of the checkpoint resumed from (the actor reads the checkpoint itself)."""
    resume = None if prepared.resume is None else {"step": prepared.resume["step"]}
    return dataclasses.replace(
        prepared, resume=resume,
        checkpoints=None if prepared.checkpoints is None else absolute(prepared.checkpoints),
        resume_path=None if prepared.resume_path is None else absolute(prepared.resume_path),
    )


def run_in_driver(ctx: RunContext) -> dict[str, Any]:
    """Run ``ctx`` in a driver actor and relay its events; returns the run summary.

    Reserves the stage bundles first when no ``ctx.placement_group`` is given (``ConfigError`` when the cluster
    cannot hold them). A lost driver actor is replaced by a new one that resumes from the newest checkpoint,
    up to ``fault.max_restarts`` restarts in all; then ``RunFailed``. An exception raised by a callback stops
    the driver actor and its stages.
    """
    ensure_ray(ctx.config.ray)
    owned = _reserve_stages(ctx)
    try:
        _replan_on_gpu(ctx)
        return _drive(ctx)
    finally:
        if owned is not None:
            remove_placement_group(owned)


def _reserve_stages(ctx: RunContext) -> Any:
    """Reserve the stage bundles into ``ctx`` unless it has a placement group; returns the one reserved, if any."""
    if ctx.placement_group is not None:
        return None
    p = ctx.config.pipeline
    cpus, gpus = stage_resources(p.cpus_per_stage, p.gpus_per_stage, p.stages)
    resolve_transport(p.transport, gpus)  # refused here, before any actor starts, when it cannot carry them
    ctx.placement_group, ctx.bundle_offset = reserve_stages(p.stages, cpus, gpus, p.placement.upper()), 0
    ctx.own_group = True
    return ctx.placement_group


def _replan_on_gpu(ctx: RunContext) -> None:
    """With GPU stages, choose the partition again from block times measured where stage 0 will run, on its GPU:
    the driver's CPU times say little about them."""
    prepared = ctx.prepared
    if prepared.plan is None or bundle_resources(ctx.placement_group, ctx.bundle_offset)[1] == 0:
        return
    sample = profile_sample(prepared.data, ctx.config)
    ctx.prepared = replan(prepared, profile_in_bundle(prepared.model, sample, ctx.placement_group, ctx.bundle_offset))
    plan = ctx.prepared.plan
    assert plan is not None  # replan() chose one
    log.info("partition (%s, times per micro-batch on a stage's GPU):", plan.partition)
    for line in plan.table().splitlines():
        log.info("  %s", line)


def _drive(ctx: RunContext) -> dict[str, Any]:
    """Start a driver actor and follow it; start another from the newest checkpoint each time one is lost."""
    prepared = _absolute(ctx.prepared)
    shipped = ray.put(prepared)
    assert prepared.checkpoints is not None  # RunContext.create checked it
    store = CheckpointStore(prepared.checkpoints, ctx.config.checkpoint.keep)  # absolute: the actor reads it too
    resume_path = prepared.resume_path
    caller = _Caller(ctx, 0 if prepared.resume is None else prepared.resume["step"])
    launch = _Launch(str(Path(ctx.run_dir).resolve()), ctx.placement_group, ctx.bundle_offset, ctx.own_group, None,
                     ctx.restarts.records, ctx.started, ctx.callbacks.wants("on_weights"),
                     logging.getLogger(ROOT).getEffectiveLevel())
    placement = _driver_placement(ctx.placement_group, ctx.bundle_offset)
    driver = None
    try:
        while True:
            driver = DriverActor.options(scheduling_strategy=placement).remote(torch.get_num_threads())  # type: ignore[attr-defined]
            launch.resume_path = None if resume_path is None else str(resume_path)
            try:
                kind, result = caller.follow(driver.run.remote(shipped, launch))
            except Exception as err:
                if not actor_died(err):
                    raise
                latest = store.latest() or resume_path
                resume = ctx.restarts.restart("driver", death("the driver actor", err, caller.seen), caller.seen,
                                              latest, err, " in a new driver actor")
                resume_path, caller.seen = latest, (resume["step"] if resume is not None else 0)
                ray.kill(driver)
                continue
            if kind == _ERROR:
                raise result
            return result
    finally:
        if driver is not None:
            ray.kill(driver)  # and with it the stage actors it owns


class _Caller:
    """The calling process's side of a driver actor's stream: logs its lines again here, calls the callbacks
    and keeps the last update heard of."""

    def __init__(self, ctx: RunContext, seen: int) -> None:
        self.ctx, self.seen = ctx, seen

    def follow(self, stream: Any) -> tuple[str, Any]:
        """Relay the stream's events up to its last: ``("end", summary)`` or ``("error", exception)``."""
        for ref in stream:
            event = ray.get(ref)
            if event[0] in (_END, _ERROR):
                return event[0], event[1]
            self.relay(event)
        raise RuntimeError("the driver actor's stream ended without a result")

    def relay(self, event: tuple) -> None:
        """Hand one streamed event to its logger or the callbacks."""
        kind, callbacks = event[0], self.ctx.callbacks
        if kind == "log":
            logging.getLogger(event[1]).log(event[2], "%s", event[3])
        elif kind == "metrics":
            self.seen = max(self.seen, int(event[1].get("step", 0)))
            callbacks.on_metrics(event[1])
        elif kind == "weights":
            callbacks.on_weights(event[1], event[2])
        elif kind == "restart":
            index, record = event[1], event[2]
            self.ctx.restarts.records[index:index + 1] = [record]
            callbacks.on_restart(index, record)
