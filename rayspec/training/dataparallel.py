"""``pipeline.method=dataparallel``: N whole-model replicas on Ray Train (DDP), the baseline the pipelines compete with.

Everything a user compares is shared with the pipeline methods: the model (``Prepared.model``, all
blocks as one ``nn.Sequential``), the batches (``train_batches(data.train, batch_size, seed)``; worker
``r`` of ``N`` takes the ``r``-th contiguous chunk of every global batch, as gpipe cuts micro-batches),
the optimizer (each worker runs its replica as a one-stage ``Stage`` with policy ``none``, so the update
is ``Stage.step``; the worker is ``rayspec.training.replica``: the same optimizer, ``LRSchedule``, clipping and precision as the pipeline's), and the run directory (``metrics.jsonl``, ``summary.json``, ``model.pt``). DDP averages the
replicas' gradients, and the mean of ``N`` equal chunks' mean losses is the global batch's mean loss,
so N workers follow SGD on the global batch up to floating-point rounding. ``pipeline.stages`` is
``N``; ``pipeline.cpus_per_stage`` / ``gpus_per_stage`` are per worker (the pipeline's defaults);
``pipeline.placement`` is Ray Train's placement strategy. The pipeline-only settings (``variant``,
``backward``, ``microbatches``, ``transport``, ``partition``, ``balance``, ``max_in_flight``) are not used.

[Note: metrics channel] Ray Train's own ``ray.train.report`` delivers metrics to its controller actor,
not to the driver that writes ``metrics.jsonl`` and calls the callbacks (W&B logs from the driver).
So the driver creates a ``ray.util.queue.Queue`` (an actor holding no CPU), passes its handle in
``train_loop_config``, runs ``TorchTrainer.fit()`` in a thread and drains the queue on its own thread
while training runs. At every logging or evaluation point and at the end, the workers all-reduce the
window's per-update losses (one small collective for the whole window) and rank 0 puts them on the
queue; at evaluation points rank 0 also puts its ``state_dict``, which the driver evaluates with
``trainer.evaluate``, as the pipeline does, and waits until the driver puts the step on a second queue
(``evaluated``; the other workers wait in the next all-reduce), so training pauses while the driver evaluates, as
the pipeline's does, and the evaluation takes no CPU from the workers; at the end every rank puts
its stats and rank 0 its final ``state_dict``. Items are plain values (weights as ``torch.save``
bytes) held by the queue actor, so they outlive the worker processes that Ray Train tears down after
``fit()``. Failures: a worker that raises puts its error on the queue first; ``fit()`` then raises
(``FailureConfig(max_failures=0)``: no retries) and the driver raises ``DataParallelError`` naming the
worker and its error (``FloatingPointError`` stays one, as in the pipeline). If the driver itself fails
or is interrupted, it shuts both queues down, so rank 0's next ``put`` or ``get`` fails and Ray Train ends the run
instead of training on.

[Note: training clock] Each evaluation record carries ``train_s``, the seconds trained up to the weights it
scores, as the pipeline's does (its clock stops while the driver evaluates between segments). Here it is rank 0's
own clock: seconds since its first update, less the time it spent handing weights and checkpoint pieces to the queue
and waiting for the driver's evaluations, read when it hands the weights over. ``summary.json``'s ``train_s`` is the
driver's: from the workers' "ready" to the final weights, less the time it spent evaluating before them.

[Note: Tune] A Ray Train run starts its own controller and worker group with their own placement
group; inside a Ray Tune trial whose placement group already holds the trial's resources it would wait
for resources forever. ``run_dataparallel`` therefore refuses a ``placement_group`` with a clear
``ConfigError``: dataparallel inside a Tune trial is not supported yet.

Ray Train's storage (``RunConfig(storage_path=...)``) is ``<run_dir>/ray_train``, run name ``dataparallel``;
nothing rayspec needs is kept there (no Ray Train checkpoints are written).
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from rayspec.config import Config
from rayspec.errors import ConfigError
from rayspec.training.checkpoint import payload
from rayspec.training.context import RunContext
from rayspec.training.progress import Progress, keep_metrics
from rayspec.training.replica import worker_loop
from rayspec.training.report import evaluate, report_stages, write_summary

__all__ = ["DataParallelError", "run_dataparallel"]

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often the driver looks for queue items and checks that fit() still runs
_RUN_NAME = "dataparallel"


class DataParallelError(RuntimeError):
    """A Ray Train worker of a ``pipeline.method=dataparallel`` run failed; the message names it and its error."""


def run_dataparallel(ctx: RunContext) -> dict[str, Any]:
    """Train ``ctx.prepared`` with ``pipeline.stages`` data-parallel Ray Train workers and write the run directory.

    Args:
        ctx: the run (``ctx.prepared`` holds the validated config, data and model; ``ctx.run_dir`` exists and
            gets ``metrics.jsonl``, ``summary.json`` and ``model.pt``; ``ctx.callbacks`` get
            ``on_metrics(record)`` for every record written to ``metrics.jsonl``). ``ctx.placement_group`` must
            be ``None`` (see the module's note on Tune).

    Returns:
        The run summary (also written to ``summary.json``), with the pipeline summary's keys.

    Raises:
        ConfigError: inside a Tune placement group, or when the workers do not fit the Ray cluster.
        DataParallelError: a worker failed (``FloatingPointError`` when the loss became non-finite).
    """
    c, p = ctx.config, ctx.config.pipeline
    if ctx.placement_group is not None:
        raise ConfigError(
            "pipeline.method=dataparallel cannot run inside a Ray Tune trial's placement group yet (Ray Train "
            "starts its own worker group and needs resources outside the trial's bundles); run it with "
            "python -m rayspec.train, or tune one of the pipeline methods"
        )
    import ray
    from ray.util.queue import Queue

    from rayspec.exec.ray.connect import ensure_ray

    ensure_ray(c.ray)
    cpus, gpus = _worker_resources(c, ray.cluster_resources())
    backend = "nccl" if gpus > 0 else "gloo"
    log.info("dataparallel: %d Ray Train workers (DDP over %s), %d samples each per update, %g CPU%s per worker",
             p.stages, backend, c.train.batch_size // p.stages, cpus, f" and {gpus:g} GPU" if gpus else "")
    queue, evaluated = Queue(actor_options={"num_cpus": 0}), Queue(actor_options={"num_cpus": 0})
    trainer = _trainer(ctx, queue, evaluated, cpus, gpus)
    return _report(ctx, _train(ctx, trainer, queue, evaluated), backend)


# ------------------------------------------------------------------------ driver side
def _trainer(ctx: RunContext, queue: Any, evaluated: Any, cpus: float, gpus: float) -> Any:
    """Ray Train's ``TorchTrainer`` of ``pipeline.stages`` workers running ``worker_loop``, which report on ``queue``
    (rank 0 waits on ``evaluated`` at evaluation points)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    c, prepared = ctx.config, ctx.prepared
    refs = {"data": ray.put(prepared.data.train), "model": ray.put(prepared.model),
            "resume": None if prepared.resume is None else ray.put(prepared.resume)}
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return TorchTrainer(
        worker_loop,
        train_loop_config={"config": c, "queue": queue, "evaluated": evaluated, "threads": max(1, int(cpus)),
                           "has_val": prepared.data.val is not None, **refs},
        scaling_config=ScalingConfig(num_workers=c.pipeline.stages, use_gpu=gpus > 0, resources_per_worker=resources,
                                     placement_strategy=c.pipeline.placement.upper()),
        run_config=RunConfig(name=_RUN_NAME, storage_path=str((ctx.run_dir / "ray_train").resolve()),
                             failure_config=FailureConfig(max_failures=0)),
    )


class _Collector:
    """The driver's side of the queue: progress and ``metrics.jsonl``, evaluations, checkpoints (once every rank's
    piece is in), the workers' stats and errors, rank 0's final weights, and the training clock."""

    def __init__(self, ctx: RunContext, progress: Progress, evaluated: Any) -> None:
        resume = ctx.prepared.resume
        self.ctx, self.progress, self.evaluated = ctx, progress, evaluated
        self.evals: dict[str, float] = {} if resume is None else json.loads(resume["evals"])
        self.resumed_s = 0.0 if resume is None else float(resume["train_s"])
        self.parts: dict[int, dict[int, dict]] = {}  # step -> rank -> that rank's checkpoint piece
        self.stats: dict[int, dict] = {}
        self.errors: list[tuple[int, str, str]] = []
        self.final: dict[str, torch.Tensor] | None = None
        self.t_start = time.perf_counter()
        self.t_ready: float | None = None
        self.t_end: float | None = None
        self.eval_s = 0.0  # seconds spent evaluating while the workers waited

    def take(self, msg: tuple) -> None:
        """Act on one queue item."""
        kind = msg[0]
        if kind == "ready":
            self.t_ready = self.progress.t0 = time.perf_counter()
        elif kind == "losses":
            for value in msg[1]:
                self.progress.loss(0, value)
        elif kind in ("eval", "final"):
            self._weights(kind, msg[1], _load_state(msg[2]), self.resumed_s + msg[3])
        elif kind == "checkpoint":
            self._checkpoint_piece(msg[1], msg[2], torch.load(io.BytesIO(msg[3]), weights_only=True))
        elif kind == "stats":
            self.stats[msg[1]] = msg[2]
        elif kind == "error":
            self.errors.append(msg[1:])

    def train_s(self) -> float:
        """Seconds trained: the resumed run's, and since the workers were ready (to the final weights, if in) less
        the evaluations the workers waited for."""
        return self.resumed_s + (self.t_end or time.perf_counter()) - (self.t_ready or self.t_start) - self.eval_s

    def _weights(self, kind: str, step: int, state: dict[str, torch.Tensor], trained_s: float) -> None:
        """Rank 0's weights at an evaluation point or the end: evaluated on the driver, as the pipeline does;
        ``trained_s``: rank 0's training seconds when it made them (see [Note: training clock])."""
        if kind == "final":
            self.final, self.t_end = state, time.perf_counter()
        t0 = time.perf_counter()
        val = self.ctx.prepared.data.val
        if val is not None:
            self.evals = evaluate(self.ctx.prepared.model, state, val, self.ctx.config.train.eval_batch_size)
            self.progress.write({"step": step, "train_s": trained_s, **self.evals})
            log.info("eval  %6d  val_loss %.4f  val_accuracy %.4f", step, self.evals["val_loss"],
                     self.evals["val_accuracy"])
        if kind == "eval":  # rank 0 waits for this before it trains on
            self.evaluated.put(step)
            self.eval_s += time.perf_counter() - t0

    def _checkpoint_piece(self, step: int, rank: int, piece: dict) -> None:
        """Every rank's piece of one step; the checkpoint is written once all are in."""
        self.parts.setdefault(step, {})[rank] = piece
        n = self.ctx.config.pipeline.stages
        if len(self.parts[step]) == n:
            pieces = self.parts.pop(step)
            self.ctx.store.save(step, payload(self.ctx.config, self.ctx.prepared.balance,
                                              [pieces[r] for r in range(n)], self.train_s(), self.evals))


def _train(ctx: RunContext, trainer: Any, queue: Any, evaluated: Any) -> _Collector:
    """Run ``trainer.fit()`` in a thread and take the queue's items on this one until it ends; see the module's
    note on the metrics channel."""
    resume = ctx.prepared.resume
    start = 0 if resume is None else resume["step"]
    outcome: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as err:  # handed to the driver's thread
            outcome["error"] = err

    keep_metrics(ctx.run_dir / "metrics.jsonl", start)
    with open(ctx.run_dir / "metrics.jsonl", "a") as metrics:
        progress = Progress(ctx.config, metrics, ctx.callbacks)
        progress.updates = start
        got = _Collector(ctx, progress, evaluated)
        thread = threading.Thread(target=fit, name="rayspec-dataparallel-fit", daemon=True)
        thread.start()
        try:
            for msg in _messages(queue, thread):
                got.take(msg)
        except BaseException:
            queue.shutdown(force=True)  # rank 0's next put (or wait) fails, which ends the Ray Train run
            evaluated.shutdown(force=True)
            thread.join(timeout=60)
            raise
        thread.join()
        queue.shutdown(force=True)
        evaluated.shutdown(force=True)
        if "error" in outcome:
            raise _worker_error(got.errors, outcome["error"])
        if got.final is None:
            raise DataParallelError("the Ray Train run ended without rank 0's final weights; see the worker logs")
        progress.flush()
    return got


def _report(ctx: RunContext, got: _Collector, backend: str) -> dict[str, Any]:
    """Write ``model.pt`` and ``summary.json``; log the workers' lines."""
    assert got.final is not None  # _train() checked it
    prepared, done = ctx.prepared, ctx.config.train.max_steps
    train_s = got.train_s()
    torch.save(got.final, ctx.run_dir / "model.pt")
    stats = [got.stats[r] for r in sorted(got.stats)]
    # Idle share of worker time (waiting on all-reduce and the driver), as the pipeline's bubble fraction.
    bubble = 1.0 - report_stages(stats, train_s, who="worker", sent="all-reduced")
    allreduced = stats[0]["sent_bytes"]["allreduce"] / max(done, 1) if stats else 0.0
    resumed = None if prepared.resume is None else prepared.resume["step"]
    return write_summary(prepared, ctx.run_dir, transport=backend, updates=done, last_loss=got.progress.last_loss,
                         evals=got.evals, train_s=train_s, wall_s=time.perf_counter() - got.t_start, bubble=bubble,
                         bytes_per_update=allreduced, stats=stats,
                         extra={"restarts": [], "checkpoint": str(ctx.last_checkpoint()), "resumed_from": resumed,
                                "layout_changes": []})


def _worker_resources(config: Config, cluster: dict[str, float]) -> tuple[float, float]:
    """CPUs and GPUs per worker: the pipeline's defaults, checked against the cluster so Ray Train cannot wait forever."""
    from rayspec.exec.ray.cluster import stage_resources

    p = config.pipeline
    n = p.stages
    total_cpus = cluster.get("CPU", 0.0)
    cpus, gpus = stage_resources(p.cpus_per_stage, p.gpus_per_stage, n)
    if n * cpus > total_cpus + 1e-9:
        raise ConfigError(
            f"pipeline.stages={n} workers with pipeline.cpus_per_stage={cpus:g} need {n * cpus:g} CPUs but the "
            f"Ray cluster has {total_cpus:g}; lower pipeline.cpus_per_stage (null shares the cluster's CPUs) "
            "or pipeline.stages"
        )
    if n * gpus > cluster.get("GPU", 0.0) + 1e-9:
        raise ConfigError(
            f"pipeline.stages={n} workers with pipeline.gpus_per_stage={gpus:g} need {n * gpus:g} GPUs but the "
            f"Ray cluster has {cluster.get('GPU', 0.0):g}; lower pipeline.gpus_per_stage or pipeline.stages"
        )
    return cpus, gpus


def _messages(queue: Any, thread: threading.Thread) -> Iterator[tuple]:
    """The queue's items while ``thread`` (``fit()``) runs, then whatever the workers put before they exited."""
    from ray.util.queue import Empty

    while thread.is_alive():
        try:
            yield queue.get(timeout=_POLL_S)
        except Empty:
            continue
    while True:  # every put happened before fit() returned: drain what is left
        try:
            yield queue.get_nowait()
        except Empty:
            return


def _worker_error(errors: list[tuple[int, str, str]], cause: BaseException) -> BaseException:
    if not errors:
        err: BaseException = DataParallelError(f"the Ray Train run of pipeline.method=dataparallel failed: {cause}")
    else:
        rank, kind, message = errors[0]
        if kind == "FloatingPointError":
            err = FloatingPointError(message)
        else:
            err = DataParallelError(f"Ray Train worker {rank} of pipeline.method=dataparallel failed: {kind}: {message}")
    err.__cause__ = cause
    return err


def _load_state(blob: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(blob), weights_only=True)
