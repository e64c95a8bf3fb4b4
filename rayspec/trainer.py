"""The training loop behind ``python -m rayspec.train``: build, validate, run segments, write the run directory."""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils.data import Subset, TensorDataset

from rayspec.checkpoint import CheckpointStore, check_compatible, config_json, load_checkpoint, resolve_resume
from rayspec.config import Config, ConfigError
from rayspec.data import DataBundle, build_data
from rayspec.data.loader import eval_batches, train_batches
from rayspec.executor import Executor, LocalExecutor
from rayspec.models import build_model, model_options
from rayspec.optim import LRSchedule
from rayspec.partition import Plan, check_balance, human_bytes, plan, split, uniform
from rayspec.predict import window as prediction_window
from rayspec.profile import profile_blocks
from rayspec.schedule import METHOD_SCHEDULE, build_schedule
from rayspec.stage import METHOD_POLICY, Stage
from rayspec.trace import bubble_fraction, write_chrome_trace, write_gantt

__all__ = ["Prepared", "prepare", "build_stages", "train", "RunFailed"]

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """Everything a run needs that can be built and checked before Ray starts."""

    config: Config
    data: DataBundle
    model: nn.Sequential
    balance: list[int]
    plan: Plan | None = None
    checkpoints: Path | None = None
    """The run's checkpoint folder (``checkpoint.dir`` or ``RUN_DIR/checkpoints``); None without a run directory."""
    resume: dict[str, Any] | None = None
    """The checkpoint to continue from (``rayspec.checkpoint.load_checkpoint``), if any."""
    resume_path: Path | None = None


def prepare(config: Config, run_dir: str | os.PathLike | None = None) -> Prepared:
    """Validate the config, build data and model, read the checkpoint to resume from and choose the partition;
    raises before any Ray work.

    Args:
        config: the run's settings.
        run_dir: the run directory; ``checkpoint.resume=auto`` looks in its ``checkpoints/`` unless
            ``checkpoint.dir`` is set.
    """
    config.validate()
    ck = config.checkpoint
    folder = Path(os.path.expanduser(ck.dir)) if ck.dir else (Path(run_dir) / "checkpoints" if run_dir else None)
    resume_path = resolve_resume(ck.resume, folder)
    if ck.resume is None and folder is not None and (earlier := CheckpointStore(folder).latest()) is not None:
        raise ConfigError(
            f"{folder} already holds checkpoints of an earlier run ({earlier.name}); continue it with "
            "checkpoint.resume=auto, or start afresh in another hydra.run.dir or checkpoint.dir"
        )
    resume = None
    if resume_path is not None:
        resume = load_checkpoint(resume_path)
        check_compatible(json.loads(resume["config"]), config, resume_path)
        saved = list(resume["balance"])
        if config.pipeline.balance is not None and list(config.pipeline.balance) != saved:
            raise ConfigError(
                f"pipeline.balance={config.pipeline.balance} differs from the balance {saved} that {resume_path} "
                "was written with; drop pipeline.balance to resume with the checkpoint's"
            )
        if resume["step"] >= config.train.max_steps:
            raise ConfigError(
                f"checkpoint.resume: {resume_path} is at update {resume['step']}, which already reaches "
                f"train.max_steps={config.train.max_steps}; raise train.max_steps to train on"
            )
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
        return Prepared(config, data, model, [len(model)], None, folder, resume, resume_path)
    planned = _plan(model, data, config, balance=None if resume is None else list(resume["balance"]))
    return Prepared(config, data, model, list(planned.balance), planned, folder, resume, resume_path)


def _first(dataset: Any, count: int | None) -> Any:
    """The first ``count`` samples of ``dataset`` (all of it for None)."""
    if dataset is None or count is None or count >= len(dataset):
        return dataset
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(t[:count] for t in dataset.tensors))
    return Subset(dataset, range(count))


def _plan(model: nn.Sequential, data: DataBundle, config: Config, balance: list[int] | None = None) -> Plan:
    """Choose the partition and profile each block once on a micro-batch, for the per-stage table.

    ``profile`` times every block (a warm-up and the median of three runs); the other partitions
    time one run after a warm-up, enough for the table's time and activation columns. ``balance``
    (a resumed checkpoint's) wins over the config's.
    """
    p = config.pipeline
    uniform(len(model), p.stages)  # the same clear error for too many stages, whatever the partition
    balance = balance if balance is not None else p.balance
    if balance is not None:
        check_balance(balance, len(model), p.stages)
    size = max(1, min(config.train.batch_size // p.group, len(data.train)))  # type: ignore[arg-type]
    sample = next(iter(eval_batches(data.train, size)))[0]
    profiled = p.partition == "profile" and balance is None
    profiles = profile_blocks(model, sample, warmup=1, repeats=3 if profiled else 1)
    return plan(model, p.stages, partition=p.partition, balance=balance, profiles=profiles)


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
            predictor=c.pipeline.predictor, probe=c.pipeline.probe,
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
    from rayspec.ray_executor import RayExecutor, bundle_resources, ensure_ray, stage_resources

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
        update_loss, self.partial = sum(self.partial), []  # losses are scaled by 1/group already
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
            also call ``on_weights(step, state_dict)`` at every evaluation with the merged weights evaluated,
            and ``on_restart(index, record)`` when a restart after a failure is done (the record is
            ``summary.json``'s ``restarts[index]``). With ``pipeline.executor=ray`` the run loop runs in a
            driver actor and callbacks run here, on what it streams back (``rayspec.driver``).
        placement_group: a Ray placement group to create the stage actors in (a Tune trial's), stage ``k``
            in bundle ``bundle_offset + k``; by default the Ray executor creates its own.
        bundle_offset: the first stage bundle in ``placement_group``.

    Returns:
        The run summary (also written to ``summary.json``).
    """
    prepared = prepare(config, run_dir)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    c, p = config, config.pipeline
    n_blocks = ", ".join(str(b) for b in prepared.balance)
    echo(f"rayspec: {p.method} ({p.variant}) on {p.stages} stages [{n_blocks} blocks], model={c.model['name']}"
         f"/{c.model.get('size', 'full')}, data={c.data['name']}, executor={p.executor}"
         + (f", {p.group} micro-batches per update" if p.group > 1 else ""))
    if prepared.plan is not None:
        echo(f"partition ({prepared.plan.partition}, times per micro-batch on this machine's CPU):")
        for line in prepared.plan.table().splitlines():
            echo("  " + line)
    if prepared.resume_path is not None:
        echo(f"resuming from {prepared.resume_path} (update {prepared.resume['step']})")  # type: ignore[index]
    notify(callbacks, "on_start", config)
    try:
        if p.executor == "ray" and p.method != "dataparallel":  # the run loop in a driver actor (rayspec.driver)
            from rayspec.driver import run_in_driver

            summary = run_in_driver(prepared, run_dir, echo, callbacks, placement_group, bundle_offset)
        else:
            summary = _run(prepared, run_dir, echo, callbacks, placement_group, bundle_offset)
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
        scored = st.get("prediction") or {}
        quality = (f"  prediction quality {scored['quality']:.3f} (best scale {scored['best_scale']:.2f}, "
                   f"{scored['actions']} scored)" if scored.get("quality") is not None else "")
        echo(f"{who} {st['stage']}: busy {st['busy_fraction']:.0%}  {per:.2f} ms/action  version {st['version']}  "
             f"{sent} {human_bytes(sum(st['sent_bytes'].values()))}{quality}")
    return max(0.0, min(1.0, sum(fractions) / max(len(fractions), 1)))


def write_summary(prepared: Prepared, run_dir: Path, echo: Callable[[str], None], *, transport: str, updates: int,
                  last_loss: float, evals: dict[str, float], train_s: float, wall_s: float, bubble: float,
                  bytes_per_update: float, stats: list[dict], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's ``summary.json`` (DESIGN §4), the same keys for every method; written, echoed and returned."""
    c, p = prepared.config, prepared.config.pipeline
    summary = {
        "method": p.method, "variant": p.variant, "stages": p.stages, "model": c.model["name"],
        "model_size": c.model.get("size", "full"), "dataset": c.data["name"], "executor": p.executor,
        "transport": transport, "balance": prepared.balance, "updates": updates,
        "final_train_loss": last_loss, "val_loss": evals.get("val_loss"), "val_accuracy": evals.get("val_accuracy"),
        "samples_per_s": updates * c.train.batch_size / max(train_s, 1e-9), "train_s": train_s,
        "wall_s": wall_s, "bubble_fraction": max(0.0, bubble), "bytes_per_update": bytes_per_update,
        "seed": c.seed, **(extra or {}), "stage_stats": stats, "config": asdict(c),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    echo(f"done: {updates} updates, final loss {last_loss:.4f}, val_accuracy {summary['val_accuracy']}, "
         f"{summary['samples_per_s']:.1f} samples/s; wrote {run_dir}")
    return summary


class RunFailed(RuntimeError):
    """A run stopped by a failure it could not recover from (``fault.max_restarts`` used up)."""


class StageDied(RuntimeError):
    """A stage actor died during a run (its process was killed, its node was lost) after ``updates`` updates."""

    def __init__(self, cause: BaseException, updates: int) -> None:
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        super().__init__(f"a stage actor died after update {updates} ({type(cause).__name__}: {first})")
        self.updates = updates


def _run(prepared: Prepared, run_dir: Path, echo: Callable[[str], None], callbacks: Sequence[Any],
         placement_group: Any, bundle_offset: int, *, resume: dict[str, Any] | None | str = "prepared",
         resume_path: Path | None = None, restarts: list[dict[str, Any]] | None = None,
         started: float | None = None) -> dict[str, Any]:
    """Run to the end; when a stage actor dies, restart from the last checkpoint up to ``fault.max_restarts`` times.

    ``resume`` (the loaded checkpoint at ``resume_path``), ``restarts`` (the restarts so far, which count
    towards ``fault.max_restarts``) and ``started`` (``time.time()`` of the run's start) continue a run
    whose driver was lost; by default the run starts from ``prepared.resume``.
    """
    c = prepared.config
    if c.pipeline.method == "dataparallel":  # no schedule or stage actors: Ray Train workers (rayspec.dataparallel)
        from rayspec.dataparallel import run_dataparallel

        return run_dataparallel(prepared, run_dir, echo, callbacks, placement_group)
    assert prepared.checkpoints is not None  # train() always gives prepare() the run directory
    store = CheckpointStore(prepared.checkpoints, c.checkpoint.keep)
    store.last_saved = resume_path  # a lost driver's newest checkpoint, which this run goes on from
    restarts = [] if restarts is None else restarts
    if isinstance(resume, str):
        resume = prepared.resume
    wall_start = time.time() if started is None else started
    live: list[Executor] = []  # the executor kept across a restart, to replace only its dead actors
    while True:
        try:
            return _run_pipeline(prepared, run_dir, echo, callbacks, placement_group, bundle_offset, store, resume,
                                 restarts, wall_start, live)
        except StageDied as err:
            failed_at = time.time()
            if len(restarts) >= c.fault.max_restarts:
                for executor in live:
                    executor.close()
                raise RunFailed(
                    f"{err}; stopping after {len(restarts)} restart(s) (fault.max_restarts={c.fault.max_restarts}); "
                    f"the last checkpoint is {_last(store, prepared) or 'none'}: rerun with checkpoint.resume=auto"
                ) from err.__cause__
            latest = _last(store, prepared)
            resume = load_checkpoint(latest) if latest is not None else None
            step = resume["step"] if resume is not None else 0
            restarts.append({"kind": "stage", "failed_at_update": err.updates, "resumed_from": step,
                             "lost_updates": err.updates - step, "error": str(err), "failed_at": failed_at})
            echo(f"restart {len(restarts)}/{c.fault.max_restarts}: {err}; resuming from update {step} "
                 f"({latest or 'the start'})")


def _last(store: CheckpointStore, prepared: Prepared) -> Path | None:
    """The checkpoint this run would continue from: its newest own one, else the one it resumed from."""
    return store.last_saved or prepared.resume_path


def _boundary(done: int, end: int, *every: int) -> int:
    """The first update after ``done`` that is a multiple of a non-zero ``every``, or ``end``."""
    return min([end] + [(done // e + 1) * e for e in every if e])


def _run_pipeline(prepared: Prepared, run_dir: Path, echo: Callable[[str], None], callbacks: Sequence[Any],
                  placement_group: Any, bundle_offset: int, store: CheckpointStore, resume: dict[str, Any] | None,
                  restarts: list[dict[str, Any]], wall_start: float, live: list[Executor]) -> dict[str, Any]:
    c, p, ck = prepared.config, prepared.config.pipeline, prepared.config.checkpoint
    stages = build_stages(prepared)  # on CPU; a stage actor given a GPU moves its stage there
    done, run_s, evals = 0, 0.0, {}
    if resume is not None:
        for stage, state in zip(stages, resume["stages"]):
            stage.load_checkpoint_state(state)
        done, run_s, evals = resume["step"], float(resume["train_s"]), json.loads(resume["evals"])
    group, end = p.group, c.train.max_steps
    schedule_name = METHOD_SCHEDULE[p.method]
    stream = _microbatches(train_batches(prepared.data.train, c.train.batch_size, c.seed, start=done), group)
    _keep_metrics(run_dir / "metrics.jsonl", done)
    segments: list[tuple[float, float]] = []
    scoring = p.method == "spectrain" and p.probe > 0
    last_scored: list[dict[str, Any]] | None = None  # stage stats at the last evaluation: prediction scores per window
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        executor = _executor(prepared, stages, placement_group, bundle_offset, live, restarts, echo, done)
        try:
            if restarts and "recovery_s" not in restarts[-1]:
                restarts[-1]["recovery_s"] = time.time() - restarts[-1]["failed_at"]
                notify(callbacks, "on_restart", len(restarts) - 1, dict(restarts[-1]))
            progress = _Progress(c, metrics, echo, callbacks)
            progress.updates, progress.t0 = done, time.perf_counter() - run_s
            if scoring and done:  # resumed: windows count from here, as they would have without the restart
                last_scored = executor.stage_stats()
            try:  # every executor call: a stage can die in any of them
                while done < end:
                    updates = _boundary(done, end, c.train.eval_every, ck.every) - done
                    schedule = build_schedule(schedule_name, p.stages, updates * group, group=group)
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
                        store.save(done, {"config": config_json(c), "balance": list(prepared.balance),
                                          "stages": executor.checkpoint_states(), "train_s": run_s,
                                          "evals": json.dumps(evals)})
                progress.flush()
                state = executor.state_dict()
                stats = executor.stage_stats()
                timeline = executor.timeline() if c.trace else None
                nodes = executor.node_ids() if hasattr(executor, "node_ids") else None
            except Exception as err:
                _reraise(err, progress.updates, _last(store, prepared))
        except StageDied:
            if not hasattr(executor, "revive"):
                executor.close()
                live.clear()
            raise  # the executor stays in ``live`` for _run to revive
        except BaseException:
            executor.close()
            live.clear()
            raise
        executor.close()
        live.clear()
    torch.save(state, run_dir / "model.pt")
    # Idle share of stage time while the pipeline ran (evaluations excluded); exact action spans with a trace.
    bubble = 1.0 - report_stages(stats, run_s, echo)
    if timeline is not None:
        bubble = bubble_fraction(timeline, segments)
        write_chrome_trace(timeline, run_dir / "trace.json", name=f"rayspec {p.method} {p.stages} stages")
        write_gantt(timeline, run_dir / "timeline.png", title=f"{p.method} on {p.stages} stages, {c.model['name']}")
        echo(f"trace: {run_dir / 'trace.json'} (open in https://ui.perfetto.dev), {run_dir / 'timeline.png'}")
    sent = sum(sum(st["sent_bytes"].values()) for st in stats)
    transport = getattr(executor, "transport", p.transport)  # what auto resolved to on Ray
    summary = write_summary(prepared, run_dir, echo, transport=transport, updates=done, last_loss=progress.last_loss,
                            evals=evals, train_s=run_s, wall_s=time.time() - wall_start, bubble=bubble,
                            bytes_per_update=sent / max(done, 1), stats=stats,
                            extra={"restarts": restarts, "checkpoint": str(_last(store, prepared)),
                                   **({"stage_nodes": nodes, "driver_node": _this_node()} if nodes else {}),
                                   "resumed_from": None if prepared.resume is None else prepared.resume["step"]})
    return summary


def _executor(prepared: Prepared, stages: list[Stage], placement_group: Any, bundle_offset: int, live: list[Executor],
              restarts: list[dict[str, Any]], echo: Callable[[str], None], done: int) -> Executor:
    """The executor for ``stages``: after a stage actor died, the live one with only its dead actors replaced
    (``RayExecutor.revive``); else, or when that fails, a new one. ``live`` holds it between attempts."""
    if live:
        old = live.pop()
        try:
            replaced = old.revive(stages)  # type: ignore[attr-defined]
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
        _reraise(err, done)
    live.append(executor)
    return executor


def _this_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _reraise(err: Exception, updates: int, last: Path | None = None) -> NoReturn:
    """Raise ``StageDied`` for a dead stage actor; a stage's non-finite loss or gradient as ``FloatingPointError``
    naming the last good checkpoint; anything else as it is."""
    from rayspec.ray_executor import actor_died, task_cause

    if actor_died(err):
        raise StageDied(err, updates) from err
    cause = task_cause(err)
    if isinstance(cause, FloatingPointError):
        raise FloatingPointError(
            f"{cause}; the last good checkpoint is {last or 'none (set checkpoint.every to write them)'}"
        ) from None
    raise err


def _keep_metrics(path: Path, step: int) -> None:
    """Keep only the records of ``metrics.jsonl`` up to update ``step`` (a resumed run rewrites what follows)."""
    if step == 0 or not path.exists():
        path.write_text("")
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))
