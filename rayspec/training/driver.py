"""The driver actor: a Ray run's loop in an actor of its own, and the relay that the calling process runs.

With ``pipeline.executor=ray``, ``rayspec.training.trainer.train`` hands the run loop (segments, evaluations,
checkpoints, stage restarts, the data feed) to a ``DriverActor``. The actor is placed in the run's driver
bundle: bundle ``bundle_offset - 1`` of a given placement group (a Tune trial's bundle 0), else on the
calling process's node, so the run directory it writes (``metrics.jsonl``, checkpoints, ``summary.json``,
``model.pt``, the trace) is the caller's. The stage actors are reserved by the caller and owned by the
driver actor: they go when it goes.

The caller only relays what the actor streams back (console lines, metrics records, weights at
evaluations, restarts) to its ``echo`` and callbacks (W&B, ``tune.report``, a study's recorder). When
the driver actor is lost, the caller starts a new one from the newest checkpoint; driver and stage
restarts share ``fault.max_restarts``.
"""

from __future__ import annotations

import dataclasses
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
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
from rayspec.training.checkpoint import CheckpointStore, load_checkpoint
from rayspec.training.failures import Restarts, death
from rayspec.training.loop import run
from rayspec.training.prepare import Prepared, profile_sample, replan
from rayspec.training.progress import notify
from rayspec.training.storage import absolute

__all__ = ["DriverActor", "run_in_driver"]

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
    """Runs one run loop (``rayspec.training.loop.run``) and streams its events: ``("echo", line)``,
    ``("metrics", record)``, ``("weights", step, state)``, ``("restart", index, record)``, then
    ``("end", summary)`` or ``("error", exception)``."""

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(max(1, threads))  # evaluation and the data feed run here, as in the caller

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run(self, prepared: Prepared, run_dir: str, placement_group: Any, bundle_offset: int, resume_path: str | None,
            restarts: list[dict[str, Any]], started: float, weights: bool) -> Iterator[tuple]:
        events: queue.Queue = queue.Queue()

        def work() -> None:
            try:
                path = absolute(resume_path) if resume_path else None
                summary = run(prepared, Path(run_dir), lambda line: events.put(("echo", line)),
                               [_Relay(events, weights)], placement_group, bundle_offset,
                               resume=load_checkpoint(path) if path else None, resume_path=path,
                               restarts=restarts, started=started)
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


def run_in_driver(prepared: Prepared, run_dir: Path, echo: Callable[[str], None], callbacks: Sequence[Any],
                  placement_group: Any = None, bundle_offset: int = 0) -> dict[str, Any]:
    """Run ``prepared`` in a driver actor and relay its events; returns the run summary.

    Reserves the stage bundles first when no ``placement_group`` is given (``ConfigError`` when the cluster
    cannot hold them). A lost driver actor is replaced by a new one that resumes from the newest checkpoint,
    up to ``fault.max_restarts`` restarts in all; then ``RunFailed``. An exception raised by a callback stops
    the driver actor and its stages.
    """
    c, p = prepared.config, prepared.config.pipeline
    ensure_ray(c.ray, echo)
    owned = None
    if placement_group is None:
        cpus, gpus = stage_resources(p.cpus_per_stage, p.gpus_per_stage, p.stages)
        resolve_transport(p.transport, gpus)  # refused here, before any actor starts, when it cannot carry them
        owned = placement_group = reserve_stages(p.stages, cpus, gpus, p.placement.upper())
        bundle_offset = 0
    if prepared.plan is not None and bundle_resources(placement_group, bundle_offset)[1] > 0:
        # The driver's CPU times say little about GPU stages: profile again where stage 0 will run, on its GPU.
        profiles = profile_in_bundle(prepared.model, profile_sample(prepared.data, c), placement_group, bundle_offset)
        prepared = replan(prepared, profiles)
        echo(f"partition ({prepared.plan.partition}, times per micro-batch on a stage's GPU):")  # type: ignore[union-attr]
        for line in prepared.plan.table().splitlines():  # type: ignore[union-attr]
            echo("  " + line)
    placement = _driver_placement(placement_group, bundle_offset)
    shipped = ray.put(_absolute(prepared))
    run_dir = Path(run_dir).resolve()
    checkpoints = _absolute(prepared).checkpoints
    if checkpoints is None:
        raise ValueError("a run needs its checkpoint folder: prepare() it with the run directory")
    store = CheckpointStore(checkpoints, c.checkpoint.keep)
    weights = any(hasattr(cb, "on_weights") for cb in callbacks)
    restarts: list[dict[str, Any]] = []
    policy = Restarts(c.fault.max_restarts, restarts, echo)
    started = time.time()
    resume_path = None if prepared.resume_path is None else absolute(prepared.resume_path)
    seen = 0 if prepared.resume is None else prepared.resume["step"]  # the last update the caller heard of
    driver = None
    try:
        while True:
            driver = DriverActor.options(scheduling_strategy=placement).remote(torch.get_num_threads())  # type: ignore[attr-defined]
            stream = driver.run.remote(shipped, str(run_dir), placement_group, bundle_offset,
                                       None if resume_path is None else str(resume_path), restarts, started, weights)
            result: tuple | None = None
            try:
                for ref in stream:
                    event = ray.get(ref)
                    if event[0] in (_END, _ERROR):
                        result = event
                        break
                    seen = _relay(event, echo, callbacks, restarts, seen)
            except Exception as err:
                if not actor_died(err):
                    raise
                latest = store.latest() or resume_path
                resume = policy.restart("driver", death("the driver actor", err, seen), seen, latest, err,
                                        " in a new driver actor")
                resume_path, seen = latest, (resume["step"] if resume is not None else 0)
                ray.kill(driver)
                continue
            if result is None:
                raise RuntimeError("the driver actor's stream ended without a result")
            if result[0] == _ERROR:
                raise result[1]
            return result[1]
    finally:
        if driver is not None:
            ray.kill(driver)  # and with it the stage actors it owns
        if owned is not None:
            remove_placement_group(owned)


def _relay(event: tuple, echo: Callable[[str], None], callbacks: Sequence[Any], restarts: list[dict[str, Any]],
           seen: int) -> int:
    """Hand one streamed event to ``echo`` or the callbacks; returns the last update heard of."""
    kind = event[0]
    if kind == "echo":
        echo(event[1])
    elif kind == "metrics":
        seen = max(seen, int(event[1].get("step", 0)))
        notify(callbacks, "on_metrics", event[1])
    elif kind == "weights":
        notify(callbacks, "on_weights", event[1], event[2])
    elif kind == "restart":
        index, record = event[1], event[2]
        restarts[index:index + 1] = [record]
        notify(callbacks, "on_restart", index, record)
    return seen
