"""``pipeline.method=dataparallel``: N whole-model replicas on Ray Train (DDP), the baseline the pipelines compete with.

Everything a user compares is shared with the pipeline methods: the model (``Prepared.model``, all
blocks as one ``nn.Sequential``), the batches (``train_batches(data.train, batch_size, seed)``; worker
``r`` of ``N`` takes the ``r``-th contiguous chunk of every global batch, as gpipe cuts micro-batches),
the optimizer (each worker runs its replica as a one-stage ``Stage`` with policy ``none``, so the update
is ``Stage.step``: the same optimizer, ``LRSchedule``, clipping and precision as the pipeline's), and the run directory (``metrics.jsonl``, ``summary.json``, ``model.pt``). DDP averages the
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
``trainer.evaluate``, as the pipeline does, while the workers keep training; at the end every rank puts
its stats and rank 0 its final ``state_dict``. Items are plain values (weights as ``torch.save``
bytes) held by the queue actor, so they outlive the worker processes that Ray Train tears down after
``fit()``. Failures: a worker that raises puts its error on the queue first; ``fit()`` then raises
(``FailureConfig(max_failures=0)``: no retries) and the driver raises ``DataParallelError`` naming the
worker and its error (``FloatingPointError`` stays one, as in the pipeline). If the driver itself fails
or is interrupted, it shuts the queue down, so rank 0's next ``put`` fails and Ray Train ends the run
instead of training on.

[Note: Tune] A Ray Train run starts its own controller and worker group with their own placement
group; inside a Ray Tune trial whose placement group already holds the trial's resources it would wait
for resources forever. ``run_dataparallel`` therefore refuses a ``placement_group`` with a clear
``ConfigError``: dataparallel inside a Tune trial is not supported yet.

[Note: bytes] Each worker counts the bytes of the gradient buckets DDP hands to all-reduce (a DDP
communication hook around torch's default ``allreduce_hook``, so the numbers are unchanged): the sum of
``bucket.buffer()`` sizes, which is ``P * 4`` bytes per update for ``P`` float32 parameters, since the
buckets hold every gradient once. The worker's ``stage_stats`` entry reports the total as
``sent_bytes = {"allreduce": bytes}``, and ``summary["bytes_per_update"]`` is rank 0's total over the
updates: **bytes all-reduced per worker per update**, not the bytes a ring all-reduce puts on the wire
(``2 (N-1)/N`` times that per worker). Not counted: DDP's broadcast of buffers (BatchNorm statistics)
from rank 0 at each forward, and the small loss all-reduce at logging points. A single worker (no
DDP) all-reduces nothing: 0.

Ray Train's storage (``RunConfig(storage_path=...)``) is ``<run_dir>/ray_train``, run name ``dataparallel``;
nothing rayspec needs is kept there (no Ray Train checkpoints are written).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayspec.config import Config
from rayspec.core.stage import Stage
from rayspec.data.loader import train_batches
from rayspec.errors import ConfigError
from rayspec.exec.base import stage_stats
from rayspec.training.checkpoint import CheckpointStore, payload
from rayspec.training.prepare import Prepared, stage_spec
from rayspec.training.progress import Progress, keep_metrics
from rayspec.training.report import evaluate, report_stages, write_summary

__all__ = ["DataParallelError", "run_dataparallel"]

_POLL_S = 0.5  # how often the driver looks for queue items and checks that fit() still runs
_RUN_NAME = "dataparallel"


class DataParallelError(RuntimeError):
    """A Ray Train worker of a ``pipeline.method=dataparallel`` run failed; the message names it and its error."""


def run_dataparallel(prepared: Prepared, run_dir: Path, echo: Callable[[str], None], callbacks: Sequence[Any] = (),
                     placement_group: Any = None) -> dict[str, Any]:
    """Train ``prepared`` with ``pipeline.stages`` data-parallel Ray Train workers and write the run directory.

    Args:
        prepared: ``rayspec.training.prepare.Prepared`` (validated config, data, model).
        run_dir: the run directory (exists); ``metrics.jsonl``, ``summary.json`` and ``model.pt`` go there.
        echo: prints one console line.
        callbacks: get ``on_metrics(record)`` for every record written to ``metrics.jsonl``.
        placement_group: must be ``None`` (see the module's note on Tune).

    Returns:
        The run summary (also written to ``summary.json``), with the pipeline summary's keys.

    Raises:
        ConfigError: inside a Tune placement group, or when the workers do not fit the Ray cluster.
        DataParallelError: a worker failed (``FloatingPointError`` when the loss became non-finite).
    """

    c, p = prepared.config, prepared.config.pipeline
    if placement_group is not None:
        raise ConfigError(
            "pipeline.method=dataparallel cannot run inside a Ray Tune trial's placement group yet (Ray Train "
            "starts its own worker group and needs resources outside the trial's bundles); run it with "
            "python -m rayspec.train, or tune one of the pipeline methods"
        )
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Queue

    from rayspec.exec.ray.connect import ensure_ray

    ensure_ray(c.ray, echo)
    n = p.stages
    cpus, gpus = _worker_resources(c, ray.cluster_resources())
    backend = "nccl" if gpus > 0 else "gloo"
    echo(f"dataparallel: {n} Ray Train workers (DDP over {backend}), {c.train.batch_size // n} samples each per "
         f"update, {cpus:g} CPU{f' and {gpus:g} GPU' if gpus else ''} per worker")
    queue = Queue(actor_options={"num_cpus": 0})
    refs = {"data": ray.put(prepared.data.train), "model": ray.put(prepared.model),
            "resume": None if prepared.resume is None else ray.put(prepared.resume)}
    start = 0 if prepared.resume is None else prepared.resume["step"]
    assert prepared.checkpoints is not None  # train() always gives prepare() the run directory
    store = CheckpointStore(prepared.checkpoints, c.checkpoint.keep)
    parts: dict[int, dict[int, dict]] = {}  # step -> rank -> that rank's checkpoint piece
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config={"config": c, "queue": queue, "threads": max(1, int(cpus)),
                           "has_val": prepared.data.val is not None, **refs},
        scaling_config=ScalingConfig(num_workers=n, use_gpu=gpus > 0, resources_per_worker=resources,
                                     placement_strategy=p.placement.upper()),
        run_config=RunConfig(name=_RUN_NAME, storage_path=str((run_dir / "ray_train").resolve()),
                             failure_config=FailureConfig(max_failures=0)),
    )
    outcome: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as err:  # handed to the driver's thread
            outcome["error"] = err

    t_start = time.perf_counter()
    thread = threading.Thread(target=fit, name="rayspec-dataparallel-fit", daemon=True)
    evals: dict[str, float] = {} if prepared.resume is None else json.loads(prepared.resume["evals"])
    resumed_s = 0.0 if prepared.resume is None else float(prepared.resume["train_s"])
    errors: list[tuple[int, str, str]] = []
    stats: dict[int, dict] = {}
    final: dict[str, torch.Tensor] | None = None
    t_ready: float | None = None
    t_end: float | None = None
    keep_metrics(run_dir / "metrics.jsonl", start)
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        progress = Progress(c, metrics, echo, callbacks)
        progress.updates = start
        thread.start()
        try:
            for msg in _messages(queue, thread):
                kind = msg[0]
                if kind == "ready":
                    t_ready = progress.t0 = time.perf_counter()
                elif kind == "losses":
                    for value in msg[1]:
                        progress.loss(0, value)
                elif kind in ("eval", "final"):
                    step, state = msg[1], _load_state(msg[2])
                    if kind == "final":
                        final, t_end = state, time.perf_counter()
                    if prepared.data.val is not None:
                        evals = evaluate(prepared.model, state, prepared.data.val, c.train.eval_batch_size)
                        progress.write({"step": step, **evals})
                        echo(f"eval  {step:>6}  val_loss {evals['val_loss']:.4f}  "
                             f"val_accuracy {evals['val_accuracy']:.4f}")
                elif kind == "checkpoint":  # every rank's piece of one step; written once all are in
                    step, rank = msg[1], msg[2]
                    parts.setdefault(step, {})[rank] = torch.load(io.BytesIO(msg[3]), weights_only=True)
                    if len(parts[step]) == n:
                        pieces = parts.pop(step)
                        elapsed = resumed_s + time.perf_counter() - (t_ready or t_start)
                        store.save(step, payload(c, prepared.balance, [pieces[r] for r in range(n)], elapsed, evals))
                elif kind == "stats":
                    stats[msg[1]] = msg[2]
                elif kind == "error":
                    errors.append(msg[1:])
        except BaseException:
            queue.shutdown(force=True)  # rank 0's next put fails, which ends the Ray Train run
            thread.join(timeout=60)
            raise
        thread.join()
        queue.shutdown(force=True)
        if "error" in outcome:
            raise _worker_error(errors, outcome["error"])
        if final is None:
            raise DataParallelError("the Ray Train run ended without rank 0's final weights; see the worker logs")
        progress.flush()
    train_s = resumed_s + (t_end or time.perf_counter()) - (t_ready or t_start)
    done = c.train.max_steps
    torch.save(final, run_dir / "model.pt")
    stage_stats = [stats[r] for r in sorted(stats)]
    # Idle share of worker time (waiting on all-reduce and the driver), as the pipeline's bubble fraction.
    bubble = 1.0 - report_stages(stage_stats, train_s, echo, who="worker", sent="all-reduced")
    allreduced = stage_stats[0]["sent_bytes"]["allreduce"] / max(done, 1) if stage_stats else 0.0
    summary = write_summary(prepared, run_dir, echo, transport=backend, updates=done, last_loss=progress.last_loss,
                            evals=evals, train_s=train_s, wall_s=time.perf_counter() - t_start, bubble=bubble,
                            bytes_per_update=allreduced, stats=stage_stats,
                            extra={"restarts": [], "checkpoint": str(store.last_saved or prepared.resume_path),
                                   "resumed_from": None if prepared.resume is None else start, "layout_changes": []})
    return summary


# ------------------------------------------------------------------------ driver side
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


# ------------------------------------------------------------------------ worker side
def _worker_loop(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: its chunk of every global batch, DDP gradients, ``Stage.step`` updates."""
    import ray
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    c: Config = loop_config["config"]
    queue = loop_config["queue"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    try:
        torch.set_num_threads(loop_config["threads"])
        dataset, model = ray.get(loop_config["data"]), ray.get(loop_config["model"])
        device = ray.train.torch.get_device()
        replica = ray.train.torch.prepare_model(model, move_to_device=device)  # DDP when world > 1
        allreduced = _count_allreduce(replica)
        t = c.train
        # One stage holding the whole model: the update is the pipeline stages' own Stage.step (its clipping
        # norm is the whole model's: DDP averaged the gradients). Its own random stream per rank (dropout):
        # ranks see different samples.
        spec = dataclasses.replace(stage_spec(c), policy="none", group=1, backward="mixed", trace=False,
                                   seed=c.seed + 1_000_003 * rank, device=device)
        stage = Stage(replica, spec, 0, 1)
        start = 0
        if loop_config["resume"] is not None:  # the replicas' weights and momentum from rank 0, each rank's own stream
            resume = ray.get(loop_config["resume"])
            own = resume["stages"][rank]
            stage.load_checkpoint_state({**resume["stages"][0], "rng": own["rng"], "stats": own["stats"]})
            start = resume["step"]
        if rank == 0:
            queue.put(("ready",))
        batches = train_batches(dataset, t.batch_size, c.seed, start=start)
        window: list[torch.Tensor] = []
        every = c.checkpoint.every
        for step in range(start + 1, t.max_steps + 1):
            x, y = next(batches)
            window.append(stage.forward(step - 1, x.chunk(world)[rank], y.chunk(world)[rank]))
            stage.backward(step - 1, update=True)
            evaluating = bool(t.eval_every) and step % t.eval_every == 0 and step < t.max_steps
            checkpointing = bool(every) and step % every == 0
            if step % t.log_every and not evaluating and not checkpointing and step < t.max_steps:
                continue
            losses = torch.stack(window).double()  # (updates in the window,)
            window = []
            if world > 1:
                dist.all_reduce(losses)
                losses /= world  # equal chunks: the mean of chunk means is the global batch's mean
            values = losses.tolist()
            if not all(math.isfinite(v) for v in values):
                raise FloatingPointError(f"the loss became non-finite by update {step}; lower optim.lr")
            if rank == 0:
                queue.put(("losses", values))
                if evaluating and loop_config["has_val"]:
                    queue.put(("eval", step, _cpu_state(model)))
            if (every and step % every == 0) or step == t.max_steps:  # rank 0: the replica; every rank: its stream
                piece = stage.checkpoint_state()
                if rank:
                    piece = {"version": piece["version"], "rng": piece["rng"], "stats": piece["stats"]}
                queue.put(("checkpoint", step, rank, _to_bytes(piece)))
        st = stage_stats(stage)
        st["stage"] = rank
        st["sent_bytes"] = {"allreduce": allreduced[0]}  # the one-stage replica hands nothing to other stages
        queue.put(("stats", rank, st))
        if rank == 0:
            queue.put(("final", t.max_steps, _cpu_state(model)))
    except BaseException as err:
        try:
            queue.put(("error", rank, type(err).__name__, str(err)), timeout=5)
        except Exception:  # the queue is gone: the driver ended the run
            pass
        raise


def _count_allreduce(replica: nn.Module) -> list[int]:
    """Count the bytes of every gradient bucket ``replica`` (DDP) all-reduces; see the module's note on bytes.

    Returns:
        A one-element list whose value grows by each bucket's ``bucket.buffer()`` bytes; stays 0 when
        ``replica`` is not DDP (one worker).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    total = [0]
    if not isinstance(replica, DistributedDataParallel):
        return total

    # No annotations: DDP checks them at run time against dist.GradBucket, and ours are strings here.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        total[0] += buffer.numel() * buffer.element_size()
        return allreduce_hook(state, bucket)

    replica.register_comm_hook(None, hook)  # state None: the default process group, as DDP uses
    return total


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _cpu_state(model: nn.Module) -> bytes:
    """The replica's state_dict under the model's own names (not DDP's ``module.`` ones), as ``torch.save`` bytes.

    Bytes, not tensors: the queue actor then never unpickles tensors, so it need not import torch
    (seconds on a small machine) before it can hand the final weights on.
    """
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
    return buf.getvalue()


def _load_state(blob: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(blob), weights_only=True)
