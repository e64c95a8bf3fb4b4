"""The training loop behind ``python -m rayspec.train``: build, validate, run segments, write the run directory."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Subset, TensorDataset

from rayspec.config import Config, ConfigError
from rayspec.data import DataBundle, build_data
from rayspec.data.loader import eval_batches, train_batches
from rayspec.executor import Executor, LocalExecutor
from rayspec.models import build_model, model_options
from rayspec.optim import LRSchedule
from rayspec.partition import Plan, check_balance, human_bytes, plan, split, uniform
from rayspec.profile import profile_blocks
from rayspec.schedule import METHOD_SCHEDULE, build_schedule
from rayspec.stage import METHOD_POLICY, Stage
from rayspec.trace import bubble_fraction, write_chrome_trace, write_gantt

__all__ = ["Prepared", "prepare", "build_stages", "train"]

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """Everything a run needs that can be built and checked before Ray starts."""

    config: Config
    data: DataBundle
    model: nn.Sequential
    balance: list[int]
    plan: Plan | None = None


def prepare(config: Config) -> Prepared:
    """Validate the config, build data and model, and choose the partition; raises before any Ray work."""
    config.validate()
    torch.manual_seed(config.seed)
    data_opts = {k: v for k, v in config.data.items() if k not in ("name", "root")}
    data = build_data(config.data["name"], root=config.data.get("root"), seed=config.seed, **data_opts)
    data = DataBundle(_first(data.train, config.train.train_samples), _first(data.val, config.train.val_samples),
                      data.info)
    torch.manual_seed(config.seed)  # the model's initial weights depend on the seed only
    model = build_model(config.model["name"], data.info, config.model.get("size", "full"), **model_options(config.model))
    n_train = len(data.train)  # type: ignore[arg-type]
    if config.train.batch_size > n_train:
        raise ConfigError(
            f"train.batch_size={config.train.batch_size} exceeds the training set ({n_train} samples); lower it"
        )
    if config.pipeline.method == "dataparallel":  # whole-model replicas: nothing to partition
        return Prepared(config, data, model, [len(model)], None)
    planned = _plan(model, data, config)
    return Prepared(config, data, model, list(planned.balance), planned)


def _first(dataset: Any, count: int | None) -> Any:
    """The first ``count`` samples of ``dataset`` (all of it for None)."""
    if dataset is None or count is None or count >= len(dataset):
        return dataset
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(t[:count] for t in dataset.tensors))
    return Subset(dataset, range(count))


def _plan(model: nn.Sequential, data: DataBundle, config: Config) -> Plan:
    """Choose the partition and profile each block once on a micro-batch, for the per-stage table.

    ``profile`` times every block (a warm-up and the median of three runs); the other partitions
    time one run after a warm-up, enough for the table's time and activation columns.
    """
    p = config.pipeline
    uniform(len(model), p.stages)  # the same clear error for too many stages, whatever the partition
    if p.balance is not None:
        check_balance(p.balance, len(model), p.stages)
    size = max(1, min(config.train.batch_size // p.group, len(data.train)))  # type: ignore[arg-type]
    sample = next(iter(eval_batches(data.train, size)))[0]
    profiled = p.partition == "profile" and p.balance is None
    profiles = profile_blocks(model, sample, warmup=1, repeats=3 if profiled else 1)
    return plan(model, p.stages, partition=p.partition, balance=p.balance, profiles=profiles)


def lr_schedule(config: Config) -> LRSchedule:
    o = config.optim
    return LRSchedule(o.lr, o.schedule, config.train.max_steps, o.warmup, o.power, o.min_lr)


def build_stages(prepared: Prepared, device: str = "cpu", record: bool = False) -> list[Stage]:
    """Cut the model along the balance into stages with the method's policy and the optimizer settings."""
    c, o = prepared.config, prepared.config.optim
    model = copy.deepcopy(prepared.model)
    n = c.pipeline.stages
    group = c.pipeline.group
    return [
        Stage(
            part, k, n, policy=METHOD_POLICY[c.pipeline.method], lr=lr_schedule(c), momentum=o.momentum,
            weight_decay=o.weight_decay, dampening=o.dampening, nesterov=o.nesterov, group=group,
            backward=c.pipeline.backward, device=device, record=record, seed=c.seed, trace=c.trace,
        )
        for k, part in enumerate(split(model, prepared.balance))
    ]


def _microbatches(batches: Iterator[tuple[torch.Tensor, ...]], chunks: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for x, y in batches:
        if chunks == 1:
            yield x, y
        else:
            yield from zip(x.chunk(chunks), y.chunk(chunks))


def make_executor(prepared: Prepared, stages: list[Stage], placement_group: Any = None, bundle_offset: int = 0) -> Executor:
    """The configured executor; on Ray, starts Ray when needed, and places stage ``k`` in bundle
    ``bundle_offset + k`` of ``placement_group`` if given."""
    p = prepared.config.pipeline
    if p.executor == "local":
        return LocalExecutor(stages, p.method, p.variant)
    from rayspec.ray_executor import RayExecutor, ensure_ray, stage_resources

    ensure_ray(prepared.config.ray)
    cpus, gpus = stage_resources(p.cpus_per_stage, p.gpus_per_stage, p.stages)
    return RayExecutor(
        stages, p.method, p.variant, transport=p.transport, cpus_per_stage=cpus, gpus_per_stage=gpus,
        max_in_flight=p.max_in_flight, placement_strategy=p.placement.upper(), placement_group=placement_group,
        bundle_offset=bundle_offset,
    )


@torch.no_grad()
def evaluate(model: nn.Module, state: dict[str, torch.Tensor], dataset: Any, batch_size: int) -> dict[str, float]:
    """Loss and accuracy of the merged weights on a split, on the driver."""
    model = copy.deepcopy(model).eval()
    model.load_state_dict(state)
    total, loss, correct = 0, 0.0, 0
    for x, y in eval_batches(dataset, batch_size):
        out = model(x)
        loss += nn.functional.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(-1) == y).sum().item()
        total += len(y)
    return {"val_loss": loss / total, "val_accuracy": correct / total}


def notify(callbacks: Sequence[Any], hook: str, *args: Any) -> None:
    """Call ``hook`` on every callback that has it (callbacks implement any of ``on_start``, ``on_metrics``, ``on_end``)."""
    for cb in callbacks:
        fn = getattr(cb, hook, None)
        if fn is not None:
            fn(*args)


def _duration(seconds: float) -> str:
    """``3725`` -> ``1:02:05``; ``65`` -> ``1:05``."""
    m, sec = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class _Progress:
    """Turns per-micro-batch losses into per-update records, console lines and ``metrics.jsonl``."""

    def __init__(self, config: Config, metrics: Any, echo: Callable[[str], None], callbacks: Sequence[Any] = ()) -> None:
        self.c, self.metrics, self.echo, self.callbacks = config, metrics, echo, list(callbacks)
        self.group = config.pipeline.group
        self.lr = lr_schedule(config)
        self.t0 = time.perf_counter()
        self.updates = 0
        self.window: list[float] = []
        self.partial: list[float] = []
        self.last_loss = float("nan")

    def loss(self, _m: int, value: float) -> None:
        self.partial.append(value)
        if len(self.partial) < self.group:
            return
        update_loss, self.partial = sum(self.partial), []  # gpipe losses are scaled by 1/group already
        self.updates += 1
        self.window.append(update_loss)
        if self.updates % self.c.train.log_every == 0 or self.updates == self.c.train.max_steps:
            self.flush()

    def flush(self) -> None:
        if not self.window:
            return
        elapsed = time.perf_counter() - self.t0
        rate = self.updates * self.c.train.batch_size / max(elapsed, 1e-9)
        self.last_loss = sum(self.window) / len(self.window)
        eta = (self.c.train.max_steps - self.updates) * self.c.train.batch_size / max(rate, 1e-9)
        rec = {"step": self.updates, "loss": self.last_loss, "lr": self.lr(self.updates - 1), "samples_per_s": rate,
               "elapsed_s": elapsed}
        self.write(rec)
        total = self.c.train.max_steps
        filled = int(20 * self.updates / total)
        self.echo(f"step {self.updates:>6}/{total} [{'#' * filled}{'.' * (20 - filled)}] {self.updates / total:4.0%}  "
                  f"loss {self.last_loss:.4f}  {rate:8.1f} samples/s  eta {_duration(eta)}")
        self.window = []

    def write(self, rec: dict) -> None:
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        notify(self.callbacks, "on_metrics", rec)


def train(
    config: Config,
    run_dir: str | os.PathLike,
    echo: Callable[[str], None] = print,
    callbacks: Sequence[Any] = (),
    placement_group: Any = None,
    bundle_offset: int = 0,
) -> dict[str, Any]:
    """Train as configured and write ``metrics.jsonl``, ``summary.json`` and ``model.pt`` into ``run_dir``.

    Args:
        config: a validated ``Config``.
        run_dir: where the run's files go (created).
        echo: prints one console line.
        callbacks: objects with any of ``on_start(config)``, ``on_metrics(record)`` (every record written
            to ``metrics.jsonl``: per-step ``loss`` records and per-evaluation ``val_*`` records) and
            ``on_end(summary)``; ``on_end`` is also called, with ``None``, when training fails. Pipeline methods
            also call ``on_weights(step, state_dict)`` at every evaluation with the merged weights evaluated.
        placement_group: a Ray placement group to create the stage actors in (a Tune trial's), stage ``k``
            in bundle ``bundle_offset + k``; by default the Ray executor creates its own.
        bundle_offset: the first stage bundle in ``placement_group``.

    Returns:
        The run summary (also written to ``summary.json``).
    """
    prepared = prepare(config)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    c, p = config, config.pipeline
    stages = [] if p.method == "dataparallel" else build_stages(  # dataparallel: Ray Train replicas, no stages
        prepared, device="cuda" if torch.cuda.is_available() and p.executor == "ray" and (p.gpus_per_stage or 0) > 0
        else "cpu")
    n_blocks = ", ".join(str(b) for b in prepared.balance)
    echo(f"rayspec: {p.method} ({p.variant}) on {p.stages} stages [{n_blocks} blocks], model={c.model['name']}"
         f"/{c.model.get('size', 'full')}, data={c.data['name']}, executor={p.executor}")
    if prepared.plan is not None:
        echo(f"partition ({prepared.plan.partition}, times per micro-batch on this machine's CPU):")
        for line in prepared.plan.table().splitlines():
            echo("  " + line)
    notify(callbacks, "on_start", config)
    try:
        summary = _run(prepared, stages, run_dir, echo, callbacks, placement_group, bundle_offset)
    except BaseException:
        notify(callbacks, "on_end", None)
        raise
    notify(callbacks, "on_end", summary)
    return summary


def report_stages(stats: list[dict], seconds: float, echo: Callable[[str], None], who: str = "stage",
                  sent: str = "sent") -> float:
    """Add ``busy_fraction`` (busy share of ``seconds``) to each stage's stats, print one line per stage,
    and return the mean busy fraction."""
    fractions = []
    for st in stats:
        busy = st["busy_s"]["F"] + st["busy_s"]["B"]
        per = busy / max(1, st["actions"]["F"] + st["actions"]["B"]) * 1e3
        st["busy_fraction"] = busy / max(seconds, 1e-9)
        fractions.append(st["busy_fraction"])
        echo(f"{who} {st['stage']}: busy {st['busy_fraction']:.0%}  {per:.2f} ms/action  version {st['version']}  "
             f"{sent} {human_bytes(sum(st['sent_bytes'].values()))}")
    return max(0.0, min(1.0, sum(fractions) / max(len(fractions), 1)))


def write_summary(prepared: Prepared, run_dir: Path, echo: Callable[[str], None], *, transport: str, updates: int,
                  last_loss: float, evals: dict[str, float], train_s: float, wall_s: float, bubble: float,
                  bytes_per_update: float, stats: list[dict]) -> dict[str, Any]:
    """The run's ``summary.json`` (DESIGN §4), the same keys for every method; written, echoed and returned."""
    c, p = prepared.config, prepared.config.pipeline
    summary = {
        "method": p.method, "variant": p.variant, "stages": p.stages, "model": c.model["name"],
        "model_size": c.model.get("size", "full"), "dataset": c.data["name"], "executor": p.executor,
        "transport": transport, "balance": prepared.balance, "updates": updates,
        "final_train_loss": last_loss, "val_loss": evals.get("val_loss"), "val_accuracy": evals.get("val_accuracy"),
        "samples_per_s": updates * c.train.batch_size / max(train_s, 1e-9), "train_s": train_s,
        "wall_s": wall_s, "bubble_fraction": max(0.0, bubble), "bytes_per_update": bytes_per_update,
        "seed": c.seed, "stage_stats": stats, "config": asdict(c),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    echo(f"done: {updates} updates, final loss {last_loss:.4f}, val_accuracy {summary['val_accuracy']}, "
         f"{summary['samples_per_s']:.1f} samples/s; wrote {run_dir}")
    return summary


def _run(prepared: Prepared, stages: list[Stage], run_dir: Path, echo: Callable[[str], None],
         callbacks: Sequence[Any], placement_group: Any, bundle_offset: int) -> dict[str, Any]:
    c = prepared.config
    p = c.pipeline
    if p.method == "dataparallel":  # no schedule or stage actors: Ray Train workers (rayspec.dataparallel)
        from rayspec.dataparallel import run_dataparallel

        return run_dataparallel(prepared, run_dir, echo, callbacks, placement_group)
    group = p.group
    schedule_name = METHOD_SCHEDULE[p.method]
    stream = _microbatches(train_batches(prepared.data.train, c.train.batch_size, c.seed), group)
    segment = c.train.eval_every or c.train.max_steps
    evals: dict[str, float] = {}
    t_start = time.perf_counter()
    with open(run_dir / "metrics.jsonl", "w") as metrics, make_executor(prepared, stages, placement_group, bundle_offset) as executor:
        progress = _Progress(c, metrics, echo, callbacks)
        progress.t0 = time.perf_counter()
        done, run_s, segments = 0, 0.0, []
        while done < c.train.max_steps:
            updates = min(segment, c.train.max_steps - done)
            schedule = build_schedule(schedule_name, p.stages, updates * group, group=group)
            t0, wall0 = time.perf_counter(), time.time()
            losses = executor.run(schedule, stream, on_loss=progress.loss)
            run_s += time.perf_counter() - t0
            segments.append((wall0, time.time()))
            if not all(math.isfinite(x) for x in losses):
                raise FloatingPointError(f"the loss became non-finite by update {done + updates}; lower optim.lr")
            done += updates
            if prepared.data.val is not None:
                weights = executor.state_dict()
                notify(callbacks, "on_weights", done, weights)
                evals = evaluate(prepared.model, weights, prepared.data.val, c.train.eval_batch_size)
                progress.write({"step": done, **evals})
                echo(f"eval  {done:>6}  val_loss {evals['val_loss']:.4f}  val_accuracy {evals['val_accuracy']:.4f}")
        progress.flush()
        state = executor.state_dict()
        stats = executor.stage_stats()
        timeline = executor.timeline() if c.trace else None
    torch.save(state, run_dir / "model.pt")
    # Idle share of stage time while the pipeline ran (evaluations excluded); exact action spans with a trace.
    bubble = 1.0 - report_stages(stats, run_s, echo)
    if timeline is not None:
        bubble = bubble_fraction(timeline, segments)
        write_chrome_trace(timeline, run_dir / "trace.json", name=f"rayspec {p.method} {p.stages} stages")
        write_gantt(timeline, run_dir / "timeline.png", title=f"{p.method} on {p.stages} stages, {c.model['name']}")
        echo(f"trace: {run_dir / 'trace.json'} (open in https://ui.perfetto.dev), {run_dir / 'timeline.png'}")
    sent = sum(sum(st["sent_bytes"].values()) for st in stats)
    summary = write_summary(prepared, run_dir, echo, transport=p.transport, updates=done, last_loss=progress.last_loss,
                            evals=evals, train_s=run_s, wall_s=time.perf_counter() - t_start, bubble=bubble,
                            bytes_per_update=sent / max(done, 1), stats=stats)
    return summary
