"""``train``: validate and prepare a run, then run it where its method and executor say (docs/design.md §3)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from rayspec.config import Config
from rayspec.core.methods import METHODS
from rayspec.data import DataBundle
from rayspec.training.loggers import with_wandb_id
from rayspec.training.prepare import prepare
from rayspec.training.progress import notify
from rayspec.training.report import model_size

__all__ = ["train"]


def train(
    config: Config,
    run_dir: str | os.PathLike,
    echo: Callable[[str], None] = print,
    callbacks: Sequence[Any] = (),
    placement_group: Any = None,
    bundle_offset: int = 0,
    model: nn.Sequential | None = None,
    data: DataBundle | None = None,
) -> dict[str, Any]:
    """Train as configured and write ``metrics.jsonl``, ``summary.json`` and ``model.pt`` into ``run_dir``.

    Args:
        config: a validated ``Config``.
        run_dir: where the run's files go (created).
        echo: prints one console line.
        callbacks: objects with any of ``on_resume(step, checkpoint_path)`` (before ``on_start`` when the run
            resumes from a checkpoint), ``on_start(config)`` (the config as run: with ``logger.id`` set for W&B),
            ``on_metrics(record)`` (every record written
            to ``metrics.jsonl``: per-step ``loss`` records and per-evaluation ``val_*`` records) and
            ``on_end(summary)``; ``on_end`` is also called, with ``None``, when training fails. Pipeline methods
            also call ``on_weights(step, state_dict)`` at every evaluation with the merged weights evaluated,
            and ``on_restart(index, record)`` when a restart after a failure is done (the record is
            ``summary.json``'s ``restarts[index]``). With ``pipeline.executor=ray`` the run loop runs in a
            driver actor and callbacks run here, on what it streams back (``rayspec.training.driver``).
        placement_group: a Ray placement group to create the stage actors in (a Tune trial's), stage ``k``
            in bundle ``bundle_offset + k``; by default the Ray executor creates its own.
        bundle_offset: the first stage bundle in ``placement_group``.
        model: blocks to train instead of building ``config.model`` (``rayspec.fit``).
        data: data to train on instead of building ``config.data`` (``rayspec.fit``).

    Returns:
        The run summary (also written to ``summary.json``).
    """
    prepared = prepare(config, run_dir, model, data)
    config = prepared.config = with_wandb_id(config, prepared.resume)  # [Note: W&B resume]
    c, p = config, config.pipeline
    if p.executor == "ray" or not METHODS[p.method].pipelined:  # join the cluster before writing anything
        from rayspec.exec.ray.connect import ensure_ray

        ensure_ray(c.ray, echo)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    n_blocks = ", ".join(str(b) for b in prepared.balance)
    size = model_size(c)
    echo(f"rayspec: {p.method} ({p.variant}) on {p.stages} stages [{n_blocks} blocks], model={c.model_name}"
         f"{'/' + size if size else ''}, data={c.data_name}, executor={p.executor}, optim={c.optim.name}"
         + (f", precision={c.train.precision}" if c.train.precision != "fp32" else "")
         + (f", {p.group} micro-batches per update" if p.group > 1 else ""))
    if prepared.plan is not None:
        echo(f"partition ({prepared.plan.partition}, times per micro-batch on this machine's CPU):")
        for line in prepared.plan.table().splitlines():
            echo("  " + line)
    if c.optim.clip_grad_norm is not None and METHODS[p.method].pipelined and not METHODS[p.method].flushes:
        echo(f"optim.clip_grad_norm={c.optim.clip_grad_norm:g}: {p.method} does not flush the pipeline, so each stage "
             "clips its gradient by its own norm (vanilla and gpipe clip by the norm over all stages)")
    if prepared.resume is not None:
        echo(f"resuming from {prepared.resume_path} (update {prepared.resume['step']})")
        notify(callbacks, "on_resume", prepared.resume["step"], prepared.resume_path)
        if METHODS[p.method].pipelined and list(prepared.resume["balance"]) != prepared.balance:
            echo(f"re-splitting its partition {list(prepared.resume['balance'])} onto {prepared.balance}: weights and "
                 "optimizer state by parameter name; new random streams, stage counters and prediction probes")
    notify(callbacks, "on_start", config)
    try:
        if not METHODS[p.method].pipelined:  # whole-model replicas on Ray Train (rayspec.training.dataparallel)
            from rayspec.training.dataparallel import run_dataparallel

            summary = run_dataparallel(prepared, run_dir, echo, callbacks, placement_group)
        elif p.executor == "ray":  # the run loop in a driver actor
            from rayspec.training.driver import run_in_driver

            summary = run_in_driver(prepared, run_dir, echo, callbacks, placement_group, bundle_offset)
        else:
            from rayspec.training.loop import run

            summary = run(prepared, run_dir, echo, callbacks, placement_group, bundle_offset)
    except BaseException:
        notify(callbacks, "on_end", None)
        raise
    notify(callbacks, "on_end", summary)
    return summary
