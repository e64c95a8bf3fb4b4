"""The run loop of a pipeline method: segments between evaluations and checkpoints, restarts after a stage
actor died, and the run directory's files (docs/design.md §5)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rayspec.core.methods import METHODS
from rayspec.core.predict import window as prediction_window
from rayspec.core.schedule import build_schedule
from rayspec.core.schedule_text import load_schedule
from rayspec.core.stage import Stage
from rayspec.data.loader import train_batches
from rayspec.exec import Executor, LocalExecutor
from rayspec.training.checkpoint import CheckpointStore, payload
from rayspec.training.failures import Restarts, StageDied, reraise
from rayspec.training.prepare import Prepared, build_stages, split_batches
from rayspec.training.progress import Progress, keep_metrics, notify
from rayspec.training.report import evaluate, report_stages, write_summary
from rayspec.training.resplit import resumed_states
from rayspec.training.trace import bubble_fraction, write_chrome_trace, write_gantt

__all__ = ["run", "make_executor"]


def make_executor(prepared: Prepared, stages: list[Stage], placement_group: Any = None, bundle_offset: int = 0) -> Executor:
    """The configured executor; on Ray, starts Ray when needed, and places stage ``k`` in bundle
    ``bundle_offset + k`` of ``placement_group`` if given."""
    p = prepared.config.pipeline
    if p.executor == "local":
        return LocalExecutor(stages, p.method, p.variant)
    from rayspec.exec.ray import RayExecutor  # Ray only for a Ray run
    from rayspec.exec.ray.cluster import bundle_resources, stage_resources
    from rayspec.exec.ray.connect import ensure_ray

    ensure_ray(prepared.config.ray)
    cpus, gpus = stage_resources(p.cpus_per_stage, p.gpus_per_stage, p.stages)
    if placement_group is not None:  # what the bundles hold, unless set
        held = bundle_resources(placement_group, bundle_offset)
        cpus = cpus if p.cpus_per_stage is not None else held[0]
        gpus = gpus if p.gpus_per_stage is not None else held[1]
    return RayExecutor(
        stages, p.method, p.variant, transport=p.transport, cpus_per_stage=cpus, gpus_per_stage=gpus,
        max_in_flight=p.max_in_flight, placement_strategy=p.placement.upper(), placement_group=placement_group,
        bundle_offset=bundle_offset,
    )


def run(prepared: Prepared, run_dir: Path, echo: Callable[[str], None], callbacks: Sequence[Any],
        placement_group: Any, bundle_offset: int, *, resume: dict[str, Any] | None | str = "prepared",
        resume_path: Path | None = None, restarts: list[dict[str, Any]] | None = None,
        started: float | None = None) -> dict[str, Any]:
    """Run to the end; when a stage actor dies, restart from the last checkpoint up to ``fault.max_restarts`` times.

    ``resume`` (the loaded checkpoint at ``resume_path``), ``restarts`` (the restarts so far, which count
    towards ``fault.max_restarts``) and ``started`` (``time.time()`` of the run's start) continue a run
    whose driver was lost; by default the run starts from ``prepared.resume``.
    """
    c = prepared.config
    if prepared.checkpoints is None:
        raise ValueError("a run needs its checkpoint folder: prepare() it with the run directory")
    store = CheckpointStore(prepared.checkpoints, c.checkpoint.keep)
    store.last_saved = resume_path  # a lost driver's newest checkpoint, which this run goes on from
    policy = Restarts(c.fault.max_restarts, [] if restarts is None else restarts, echo)
    if isinstance(resume, str):
        resume = prepared.resume
    wall_start = time.time() if started is None else started
    live: list[Executor] = []  # the executor kept across a restart, to replace only its dead actors
    while True:
        try:
            return _run_segments(prepared, run_dir, echo, callbacks, placement_group, bundle_offset, store, resume,
                                 policy.records, wall_start, live)
        except StageDied as err:
            try:
                resume = policy.restart("stage", str(err), err.updates, _last(store, prepared), err.__cause__ or err)
            except BaseException:
                for executor in live:
                    executor.close()
                raise


def _last(store: CheckpointStore, prepared: Prepared) -> Path | None:
    """The checkpoint this run would continue from: its newest own one, else the one it resumed from."""
    return store.last_saved or prepared.resume_path


def _boundary(done: int, end: int, *every: int) -> int:
    """The first update after ``done`` that is a multiple of a non-zero ``every``, or ``end``."""
    return min([end] + [(done // e + 1) * e for e in every if e])


def _run_segments(prepared: Prepared, run_dir: Path, echo: Callable[[str], None], callbacks: Sequence[Any],
                  placement_group: Any, bundle_offset: int, store: CheckpointStore, resume: dict[str, Any] | None,
                  restarts: list[dict[str, Any]], wall_start: float, live: list[Executor]) -> dict[str, Any]:
    c, p, ck = prepared.config, prepared.config.pipeline, prepared.config.checkpoint
    stages = build_stages(prepared)  # on CPU; a stage actor given a GPU moves its stage there
    done, run_s, evals = 0, 0.0, {}
    changes: list[dict[str, Any]] = []  # re-splits of the run's state onto another partition, oldest first
    if resume is not None:
        states, changes = resumed_states(resume, prepared.model, prepared.balance, c.seed)
        for stage, state in zip(stages, states):
            stage.load_checkpoint_state(state)
        done, run_s, evals = resume["step"], float(resume["train_s"]), json.loads(resume["evals"])
    group, end = p.group, c.train.max_steps
    method = METHODS[p.method]
    assert method.schedule is not None  # prepare() sent the methods without a pipeline elsewhere
    stream = split_batches(train_batches(prepared.data.train, c.train.batch_size, c.seed, start=done), group)
    keep_metrics(run_dir / "metrics.jsonl", done)
    segments: list[tuple[float, float]] = []
    scoring = method.predicts and p.probe > 0
    last_scored: list[dict[str, Any]] | None = None  # stage stats at the last evaluation: prediction scores per window
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        executor = _executor(prepared, stages, placement_group, bundle_offset, live, restarts, echo, done)
        try:
            if restarts and "recovery_s" not in restarts[-1]:
                restarts[-1]["recovery_s"] = time.time() - restarts[-1]["failed_at"]
                notify(callbacks, "on_restart", len(restarts) - 1, dict(restarts[-1]))
            progress = Progress(c, metrics, echo, callbacks)
            progress.updates, progress.t0 = done, time.perf_counter() - run_s
            if scoring and done:  # resumed: windows count from here, as they would have without the restart
                last_scored = executor.stage_stats()
            try:  # every executor call: a stage can die in any of them
                while done < end:
                    updates = _boundary(done, end, c.train.eval_every, ck.every) - done
                    schedule = (load_schedule(p.schedule_file, updates) if p.schedule_file else
                                build_schedule(method.schedule, p.stages, updates * group, group=group,
                                               virtual=p.virtual_stages))
                    t0, wall0 = time.perf_counter(), time.time()
                    executor.run(schedule, stream, on_loss=progress.loss)
                    run_s += time.perf_counter() - t0
                    segments.append((wall0, time.time()))
                    done += updates
                    if prepared.data.val is not None and (done == end or (c.train.eval_every and done % c.train.eval_every == 0)):
                        weights = executor.state_dict()
                        notify(callbacks, "on_weights", done, weights)
                        evals = evaluate(prepared.model, weights, prepared.data.val, c.train.eval_batch_size)
                        scored = {}
                        if scoring:
                            scored_stats = executor.stage_stats()
                            scored, last_scored = prediction_window(scored_stats, last_scored), scored_stats
                        progress.write({"step": done, **evals, **scored})
                        echo(f"eval  {done:>6}  val_loss {evals['val_loss']:.4f}  val_accuracy {evals['val_accuracy']:.4f}")
                    if done == end or (ck.every and done % ck.every == 0):
                        store.save(done, payload(c, prepared.balance, executor.checkpoint_states(), run_s, evals,
                                                         changes))
                progress.flush()
                state = executor.state_dict()
                stats = executor.stage_stats()
                timeline = executor.timeline() if c.trace else None
                nodes = executor.node_ids()
            except Exception as err:
                reraise(err, progress.updates, _last(store, prepared))
        except StageDied:
            if not executor.can_revive:
                executor.close()
                live.clear()
            raise  # the executor stays in ``live`` for run() to revive
        except BaseException:
            executor.close()
            live.clear()
            raise
        executor.close()
        live.clear()
    torch.save(state, run_dir / "model.pt")
    # Idle share of stage time while the pipeline ran (evaluations excluded); exact action spans with a trace.
    # The stages' counters start afresh at a re-split: their share is of the time since.
    bubble = 1.0 - report_stages(stats, run_s - (changes[-1]["train_s"] if changes else 0.0), echo)
    if timeline is not None:
        bubble = bubble_fraction(timeline, segments)
        write_chrome_trace(timeline, run_dir / "trace.json", name=f"rayspec {p.method} {p.stages} stages")
        write_gantt(timeline, run_dir / "timeline.png", title=f"{p.method} on {p.stages} stages, {c.model_name}")
        echo(f"trace: {run_dir / 'trace.json'} (open in https://ui.perfetto.dev), {run_dir / 'timeline.png'}")
    sent = sum(sum(st["sent_bytes"].values()) for st in stats)
    summary = write_summary(prepared, run_dir, echo, transport=executor.transport, updates=done,
                            last_loss=progress.last_loss, evals=evals, train_s=run_s, wall_s=time.time() - wall_start,
                            bubble=bubble, bytes_per_update=sent / max(done, 1), stats=stats,
                            extra={"restarts": restarts, "checkpoint": str(_last(store, prepared)),
                                   **({"stage_nodes": nodes, "driver_node": _this_node()} if nodes else {}),
                                   "resumed_from": None if prepared.resume is None else prepared.resume["step"],
                                   "layout_changes": changes})
    return summary


def _executor(prepared: Prepared, stages: list[Stage], placement_group: Any, bundle_offset: int, live: list[Executor],
              restarts: list[dict[str, Any]], echo: Callable[[str], None], done: int) -> Executor:
    """The executor for ``stages``: after a stage actor died, the live one with only its dead actors replaced
    (``Executor.revive``); else, or when that fails, a new one. ``live`` holds it between attempts."""
    if live:
        old = live.pop()
        try:
            replaced = old.revive(stages)
            restarts[-1]["replaced_stages"] = replaced
            echo(f"replaced stage actor(s) {', '.join(map(str, replaced)) or 'none'}; the others were reloaded")
            live.append(old)
            return old
        except Exception as err:
            echo(f"could not revive the stage actors ({err}); starting new ones")
            old.close()
    try:
        executor = make_executor(prepared, stages, placement_group, bundle_offset)
    except Exception as err:
        reraise(err, done)
    live.append(executor)
    return executor


def _this_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
