"""``run_training``: validate and prepare a run, then run it where its method and executor say (docs/design.md §3).

Named apart from ``rayspec.train`` (the ``python -m`` command) and the ``rayspec.training`` package: this is the
one function that ``rayspec.run``, ``rayspec.fit`` and every command call to train a ``Config``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from rayspec.config import Config
from rayspec.core.methods import METHODS
from rayspec.data import DataBundle
from rayspec.training.callbacks import Callbacks
from rayspec.training.context import RunContext
from rayspec.training.loggers import with_wandb_id
from rayspec.training.prepare import Prepared, prepare
from rayspec.training.report import model_size

__all__ = ["run_training"]

log = logging.getLogger(__name__)


def run_training(
    config: Config,
    run_dir: str | os.PathLike,
    callbacks: Sequence[Any] = (),
    placement_group: Any = None,
    bundle_offset: int = 0,
    model: nn.Sequential | None = None,
    data: DataBundle | None = None,
) -> dict[str, Any]:
    """Train as configured and write ``metrics.jsonl``, ``summary.json`` and ``model.pt`` into ``run_dir``.

    Lines go to the ``rayspec`` loggers ([Note: console] in ``rayspec.training.console``).

    Args:
        config: a validated ``Config``.
        run_dir: where the run's files go (created).
        callbacks: objects with any of the hooks of ``rayspec.training.callbacks.Callback`` (``on_resume``,
            ``on_start``, ``on_metrics``, ``on_weights``, ``on_restart``, ``on_end``); checked first: a public
            ``on_*`` method that is no hook raises ``ConfigError``. With ``pipeline.executor=ray`` the run loop runs
            in a driver actor and callbacks run here, on what it streams back (``rayspec.training.driver``).
        placement_group: a Ray placement group to create the stage actors in (a Tune trial's), stage ``k``
            in bundle ``bundle_offset + k``; by default the Ray executor creates its own.
        bundle_offset: the first stage bundle in ``placement_group``.
        model: blocks to train instead of building ``config.model`` (``rayspec.fit``).
        data: data to train on instead of building ``config.data`` (``rayspec.fit``).

    Returns:
        The run summary (also written to ``summary.json``).
    """
    callbacks = Callbacks.of(callbacks)  # checked before anything runs: a misspelt hook is an error
    prepared = prepare(config, run_dir, model, data)
    prepared.config = with_wandb_id(config, prepared.resume)  # [Note: W&B resume]
    p = prepared.config.pipeline
    if p.executor == "ray" or not METHODS[p.method].pipelined:  # join the cluster before writing anything
        from rayspec.exec.ray.connect import ensure_ray

        ensure_ray(prepared.config.ray)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    ctx = RunContext.create(prepared, Path(run_dir), callbacks, placement_group, bundle_offset)
    _introduce(prepared)
    if prepared.resume is not None:
        ctx.callbacks.on_resume(prepared.resume["step"], prepared.resume_path)
    ctx.callbacks.on_start(prepared.config)
    try:
        summary = _run(ctx)
    except BaseException:
        ctx.callbacks.on_end(None)
        raise
    ctx.callbacks.on_end(summary)
    return summary


def _run(ctx: RunContext) -> dict[str, Any]:
    """Run where the method and executor say: Ray Train replicas, a driver actor, or this process."""
    p = ctx.config.pipeline
    if not METHODS[p.method].pipelined:  # whole-model replicas on Ray Train (rayspec.training.dataparallel)
        from rayspec.training.dataparallel import run_dataparallel

        return run_dataparallel(ctx)
    if p.executor == "ray":  # the run loop in a driver actor
        from rayspec.training.driver import run_in_driver

        return run_in_driver(ctx)
    from rayspec.training.loop import run

    return run(ctx)


def _introduce(prepared: Prepared) -> None:
    """Log what is about to run: method, stages, model and data, the partition table, and what it resumes from."""
    c, p = prepared.config, prepared.config.pipeline
    size = model_size(c)
    log.info("rayspec: %s (%s) on %d stages [%s blocks], model=%s%s, data=%s, executor=%s, optim=%s%s%s",
             p.method, p.variant, p.stages, ", ".join(str(b) for b in prepared.balance), c.model_name,
             "/" + size if size else "", c.data_name, p.executor, c.optim.name,
             f", precision={c.train.precision}" if c.train.precision != "fp32" else "",
             f", {p.group} micro-batches per update" if p.group > 1 else "")
    if prepared.plan is not None:
        log.info("partition (%s, times per micro-batch on this machine's CPU):", prepared.plan.partition)
        for line in prepared.plan.table().splitlines():
            log.info("  %s", line)
    method = METHODS[p.method]
    if c.optim.clip_grad_norm is not None and method.pipelined and not method.flushes:
        log.info("optim.clip_grad_norm=%g: %s does not flush the pipeline, so each stage clips its gradient by its "
                 "own norm (vanilla and gpipe clip by the norm over all stages)", c.optim.clip_grad_norm, p.method)
    if prepared.resume is not None:
        log.info("resuming from %s (update %s)", prepared.resume_path, prepared.resume["step"])
        saved = list(prepared.resume["balance"])
        if method.pipelined and saved != prepared.balance:
            log.info("re-splitting its partition %s onto %s: weights and optimizer state by parameter name; new "
                     "random streams, stage counters and prediction probes", saved, prepared.balance)
