"""The run loop of a pipeline method: segments between evaluations and checkpoints, restarts after a stage
actor died, and the run directory's files (docs/design.md §5)."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rayspec.core.methods import METHODS
from rayspec.core.predict import window as prediction_window
from rayspec.core.schedule import build_schedule
from rayspec.core.schedule_text import load_schedule
from rayspec.core.stage import Stage, make_stages
from rayspec.data.loader import train_batches
from rayspec.exec import Executor, LocalExecutor
from rayspec.partition import split
from rayspec.training.checkpoint import payload
from rayspec.training.context import RunContext
from rayspec.training.elastic import fit_cluster
from rayspec.training.failures import StageDied, reraise
from rayspec.training.prepare import Prepared, stage_spec
from rayspec.training.progress import Progress, keep_metrics
from rayspec.training.report import evaluate, report_stages, write_summary
from rayspec.training.resplit import RESUMED, layout_change, resumed_states
from rayspec.training.trace import bubble_fraction, write_chrome_trace, write_gantt

__all__ = ["run", "make_executor", "build_stages", "split_batches"]

log = logging.getLogger(__name__)


def run(ctx: RunContext) -> dict[str, Any]:
    """Run to the end from ``ctx.resume``; when a stage actor dies, restart from the last checkpoint, up to
    ``fault.max_restarts`` restarts in all (``ctx.restarts``, which may hold a lost driver's restarts already)."""
    return _RunLoop(ctx).run()


def build_stages(prepared: Prepared, device: str = "cpu", record: bool = False) -> list[Stage]:
    """Cut the model along the balance into stages with the method's policy and the optimizer settings."""
    c = prepared.config
    parts = split(copy.deepcopy(prepared.model), prepared.balance)
    return make_stages(parts, c.pipeline.method, dataclasses.replace(stage_spec(c), device=device, record=record))


def split_batches(batches: Iterator[tuple[torch.Tensor, ...]], group: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each batch as ``group`` equal micro-batches, in order."""
    for x, y in batches:
        if group == 1:
            yield x, y
        else:
            yield from zip(x.chunk(group), y.chunk(group))


def make_executor(ctx: RunContext, stages: list[Stage]) -> Executor:
    """The configured executor; on Ray, starts Ray when needed, and places stage ``k`` in bundle
    ``ctx.bundle_offset + k`` of ``ctx.placement_group`` if given."""
    p = ctx.config.pipeline
    if p.executor == "local":
        return LocalExecutor(stages, p.method, p.variant)
    from rayspec.exec.ray import RayExecutor  # Ray only for a Ray run
    from rayspec.exec.ray.cluster import bundle_resources, stage_resources
    from rayspec.exec.ray.connect import ensure_ray

    ensure_ray(ctx.config.ray)
    cpus, gpus = stage_resources(p.cpus_per_stage, p.gpus_per_stage, p.stages)
    if ctx.placement_group is not None:  # what the bundles hold, unless set
        held = bundle_resources(ctx.placement_group, ctx.bundle_offset)
        cpus = cpus if p.cpus_per_stage is not None else held[0]
        gpus = gpus if p.gpus_per_stage is not None else held[1]
    return RayExecutor(
        stages, p.method, p.variant, transport=p.transport, cpus_per_stage=cpus, gpus_per_stage=gpus,
        max_in_flight=p.max_in_flight, placement_strategy=p.placement.upper(), placement_group=ctx.placement_group,
        bundle_offset=ctx.bundle_offset, virtual=p.virtual_stages, bundles=ctx.bundles,
    )


def _boundary(done: int, end: int, *every: int) -> int:
    """The first update after ``done`` that is a multiple of a non-zero ``every``, or ``end``."""
    return min([end] + [(done // e + 1) * e for e in every if e])


@dataclass
class _Tally:
    """Where an attempt stands: updates done, seconds trained, the last evaluation and the re-splits so far."""

    done: int = 0
    train_s: float = 0.0
    evals: dict[str, float] = field(default_factory=dict)
    changes: list[dict[str, Any]] = field(default_factory=list)
    """Re-splits of the run's state onto another partition, oldest first."""
    segments: list[tuple[float, float]] = field(default_factory=list)
    """Wall-clock spans of the pipeline's runs, for the trace's bubble fraction."""


@dataclass
class _Outcome:
    """What the executor holds at the end of the run: weights, stage stats, the trace, where the stages ran."""

    state: dict[str, torch.Tensor]
    stats: list[dict]
    timeline: list | None
    nodes: list[str] | None
    transport: str


def _restored(stages: list[Stage], resume: dict[str, Any] | None, prepared: Prepared,
              shrunk: tuple[str, list[int]] | None = None) -> _Tally:
    """Load the checkpoint ``resume`` into ``stages`` (re-split when the partition changed); where it stood.
    ``shrunk``: why the stages are fewer than before this restart, and the partition before."""
    if resume is None:
        return _Tally(changes=[layout_change(0, shrunk[1], prepared.balance, shrunk[0], 0.0)] if shrunk else [])
    reason = shrunk[0] if shrunk else RESUMED
    states, changes = resumed_states(resume, prepared.model, prepared.balance, prepared.config.seed, reason)
    for stage, state in zip(stages, states):
        stage.load_checkpoint_state(state)
    return _Tally(resume["step"], float(resume["train_s"]), json.loads(resume["evals"]), changes)


class _RunLoop:
    """The attempts of one pipeline run, and the executor that outlives a failed one."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.executor: Executor | None = None
        """The live executor. After a stage actor died it is kept when it can revive, to replace only its dead
        actors; this loop closes it at the end or on a failure it does not restart from."""

    def run(self) -> dict[str, Any]:
        ctx, resume = self.ctx, self.ctx.resume
        try:
            # A new driver actor after a lost one: the node may have held stages too ([Note: elastic]).
            shrunk = self._fit(resume) if ctx.restarts.records else None
            while True:
                try:
                    return self._attempt(resume, shrunk)
                except StageDied as err:
                    if self.executor is not None and not self.executor.can_revive:
                        self._close()
                    resume = ctx.restarts.restart("stage", str(err), err.updates, ctx.last_checkpoint(),
                                                  err.__cause__ or err)
                    shrunk = self._fit(resume) or shrunk  # a run that shrank before still goes on from its change
        except BaseException:
            self._close()
            raise
        finally:
            if ctx.reserved is not None:  # an elastic run's own smaller group
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(ctx.reserved)
                ctx.reserved = None

    def _fit(self, resume: dict[str, Any] | None) -> tuple[str, list[int]] | None:
        """Before a restart: wait for the cluster to hold every stage, or go on with fewer (``fit_cluster``); when
        the stages change, the live executor goes, and this returns why and the partition before."""
        before = list(self.ctx.prepared.balance)
        reason = fit_cluster(self.ctx, resume)
        if reason is None:
            return None
        self._close()
        return reason, before

    def _attempt(self, resume: dict[str, Any] | None, shrunk: tuple[str, list[int]] | None = None) -> dict[str, Any]:
        """Train from ``resume`` to the end, then write ``model.pt``, the trace and ``summary.json``; ``shrunk``:
        why the stages are fewer than before this attempt, and the partition before."""
        ctx = self.ctx
        stages = build_stages(ctx.prepared)  # on CPU; a stage actor given a GPU moves its stage there
        tally = _restored(stages, resume, ctx.prepared, shrunk)
        keep_metrics(ctx.run_dir / "metrics.jsonl", tally.done)
        with open(ctx.run_dir / "metrics.jsonl", "a") as metrics:
            executor = self._open(stages, tally.done)
            self._note_recovery()
            progress = Progress(ctx.config, metrics, ctx.callbacks)
            progress.updates, progress.t0 = tally.done, time.perf_counter() - tally.train_s
            try:  # every executor call: a stage can die in any of them
                self._train(executor, progress, tally)
                progress.flush()
                outcome = _Outcome(executor.state_dict(), executor.stage_stats(),
                                   executor.timeline() if ctx.config.trace else None, executor.node_ids(),
                                   executor.transport)
            except Exception as err:
                reraise(err, progress.updates, ctx.last_checkpoint())
        self._close()
        return self._report(outcome, tally, progress.last_loss)

    def _open(self, stages: list[Stage], done: int) -> Executor:
        """The executor for ``stages``: after a stage actor died, the live one with only its dead actors replaced
        (``Executor.revive``); else, or when that fails, a new one."""
        if self.executor is not None:
            try:
                replaced = self.executor.revive(stages)
                self.ctx.restarts.records[-1]["replaced_stages"] = replaced
                log.info("replaced stage actor(s) %s; the others were reloaded", ", ".join(map(str, replaced)) or "none")
                return self.executor
            except Exception as err:
                log.info("could not revive the stage actors (%s); starting new ones", err)
                self._close()
        try:
            self.executor = make_executor(self.ctx, stages)
        except Exception as err:
            reraise(err, done)
        return self.executor

    def _close(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None

    def _note_recovery(self) -> None:
        """After a restart: its recovery time, now that the stages run again, and ``on_restart``."""
        records = self.ctx.restarts.records
        if records and "recovery_s" not in records[-1]:
            records[-1]["recovery_s"] = time.time() - records[-1]["failed_at"]
            self.ctx.callbacks.on_restart(len(records) - 1, dict(records[-1]))

    def _train(self, executor: Executor, progress: Progress, tally: _Tally) -> None:
        """Run the schedule segment by segment up to ``train.max_steps``, evaluating and checkpointing between."""
        ctx, c = self.ctx, self.ctx.config
        p, ck, end = c.pipeline, c.checkpoint, c.train.max_steps
        method = METHODS[p.method]
        assert method.schedule is not None  # prepare() sent the methods without a pipeline elsewhere
        stream = split_batches(train_batches(ctx.prepared.data.train, c.train.batch_size, c.seed, start=tally.done),
                               p.group)
        scoring = method.predicts and p.probe > 0
        # Stage stats at the last evaluation, for prediction scores per window; a resumed run's windows count
        # from here, as they would have without the restart.
        last_scored = executor.stage_stats() if scoring and tally.done else None
        while tally.done < end:
            updates = _boundary(tally.done, end, c.train.eval_every, ck.every) - tally.done
            schedule = (load_schedule(p.schedule_file, updates) if p.schedule_file else
                        build_schedule(method.schedule, p.stages, updates * p.group, group=p.group,
                                       virtual=p.virtual_stages))
            t0, wall0 = time.perf_counter(), time.time()
            executor.run(schedule, stream, on_loss=progress.loss)
            tally.train_s += time.perf_counter() - t0
            tally.segments.append((wall0, time.time()))
            tally.done += updates
            done = tally.done
            if ctx.prepared.data.val is not None and (done == end or (c.train.eval_every and done % c.train.eval_every == 0)):
                weights = executor.state_dict()
                ctx.callbacks.on_weights(done, weights)
                tally.evals = evaluate(ctx.prepared.model, weights, ctx.prepared.data.val, c.train.eval_batch_size)
                scored: dict[str, Any] = {}
                if scoring:
                    stats = executor.stage_stats()
                    scored, last_scored = prediction_window(stats, last_scored), stats
                progress.write({"step": done, "train_s": tally.train_s, **tally.evals, **scored})
                log.info("eval  %6d  val_loss %.4f  val_accuracy %.4f", done, tally.evals["val_loss"],
                         tally.evals["val_accuracy"])
            if done == end or (ck.every and done % ck.every == 0):
                ctx.store.save(done, payload(c, ctx.prepared.balance, executor.checkpoint_states(), tally.train_s,
                                             tally.evals, tally.changes))

    def _report(self, outcome: _Outcome, tally: _Tally, last_loss: float) -> dict[str, Any]:
        """Write ``model.pt``, the trace when asked for and ``summary.json``; log the stages' lines."""
        ctx, c = self.ctx, self.ctx.config
        p, run_dir = c.pipeline, ctx.run_dir
        torch.save(outcome.state, run_dir / "model.pt")
        # Idle share of stage time while the pipeline ran (evaluations excluded); exact action spans with a trace.
        # The stages' counters start afresh at a re-split: their share is of the time since.
        since = tally.train_s - (tally.changes[-1]["train_s"] if tally.changes else 0.0)
        bubble = 1.0 - report_stages(outcome.stats, since)
        if outcome.timeline is not None:
            bubble = bubble_fraction(outcome.timeline, tally.segments)
            write_chrome_trace(outcome.timeline, run_dir / "trace.json", name=f"rayspec {p.method} {p.stages} stages")
            write_gantt(outcome.timeline, run_dir / "timeline.png", title=f"{p.method} on {p.stages} stages, {c.model_name}")
            log.info("trace: %s (open in https://ui.perfetto.dev), %s", run_dir / "trace.json", run_dir / "timeline.png")
        sent = sum(sum(st["sent_bytes"].values()) for st in outcome.stats)
        nodes = {"stage_nodes": outcome.nodes, "driver_node": _this_node()} if outcome.nodes else {}
        resumed = ctx.prepared.resume
        return write_summary(
            ctx.prepared, run_dir, transport=outcome.transport, updates=tally.done, last_loss=last_loss,
            evals=tally.evals, train_s=tally.train_s, wall_s=time.time() - ctx.started, bubble=bubble,
            bytes_per_update=sent / max(tally.done, 1), stats=outcome.stats,
            extra={"restarts": ctx.restarts.records, "checkpoint": str(ctx.last_checkpoint()), **nodes,
                   "resumed_from": None if resumed is None else resumed["step"], "layout_changes": tally.changes})


def _this_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
