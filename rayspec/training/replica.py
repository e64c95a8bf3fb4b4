"""A Ray Train worker of ``pipeline.method=dataparallel``: one whole-model replica trained as a one-stage
``Stage`` under DDP, reporting to the driver on its queue (``rayspec.training.dataparallel``).

[Note: bytes] Each worker counts the bytes of the gradient buckets DDP hands to all-reduce (a DDP
communication hook around torch's default ``allreduce_hook``, so the numbers are unchanged): the sum of
``bucket.buffer()`` sizes, which is ``P * 4`` bytes per update for ``P`` float32 parameters, since the
buckets hold every gradient once. The worker's ``stage_stats`` entry reports the total as
``sent_bytes = {"allreduce": bytes}``, and ``summary["bytes_per_update"]`` is rank 0's total over the
updates: **bytes all-reduced per worker per update**, not the bytes a ring all-reduce puts on the wire
(``2 (N-1)/N`` times that per worker). Not counted: DDP's broadcast of buffers (BatchNorm statistics)
from rank 0 at each forward, and the small loss all-reduce at logging points. A single worker (no
DDP) all-reduces nothing: 0.
"""

from __future__ import annotations

import dataclasses
import io
import math
import time
from typing import Any

import torch
from torch import nn

from rayspec.config import Config
from rayspec.core.stage import Stage
from rayspec.data.loader import train_batches
from rayspec.exec.base import stage_stats
from rayspec.training.prepare import stage_spec

__all__ = ["worker_loop"]


def worker_loop(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: its chunk of every global batch, DDP gradients, ``Stage.step`` updates."""
    import ray.train

    queue = loop_config["queue"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    try:
        torch.set_num_threads(loop_config["threads"])
        model, stage, allreduced, start = _replica(loop_config, rank)
        if rank == 0:
            queue.put(("ready",))
        trained_s = _train_replica(loop_config, model, stage, rank, world, start)
        st = stage_stats(stage)
        st["stage"] = rank
        st["sent_bytes"] = {"allreduce": allreduced[0]}  # the one-stage replica hands nothing to other stages
        queue.put(("stats", rank, st))
        if rank == 0:
            queue.put(("final", loop_config["config"].train.max_steps, _cpu_state(model), trained_s))
    except BaseException as err:
        try:
            queue.put(("error", rank, type(err).__name__, str(err)), timeout=5)
        except Exception:  # the queue is gone: the driver ended the run
            pass
        raise


def _replica(loop_config: dict[str, Any], rank: int) -> tuple[nn.Module, Stage, list[int], int]:
    """This worker's model, the one stage that trains it (DDP when more than one worker), its all-reduce byte
    counter, and the update it starts after (a resumed checkpoint's)."""
    import ray
    import ray.train.torch

    c: Config = loop_config["config"]
    model = ray.get(loop_config["model"])
    device = ray.train.torch.get_device()
    replica = ray.train.torch.prepare_model(model, move_to_device=device)  # DDP when world > 1
    allreduced = _count_allreduce(replica)
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
    return model, stage, allreduced, start


def _train_replica(loop_config: dict[str, Any], model: nn.Module, stage: Stage, rank: int, world: int,
                   start: int) -> float:
    """Train to ``train.max_steps`` on this rank's chunk of every global batch; at every logging, evaluation or
    checkpoint point and at the end, hand the window's losses, the weights and checkpoint pieces to the queue.

    Returns:
        Seconds this rank trained (since its first update), without the time it spent handing weights and
        checkpoint pieces over and waiting for the driver's evaluations, as the pipeline's clock leaves evaluations
        and checkpoints out.
    """
    import ray

    c: Config = loop_config["config"]
    queue, t, every = loop_config["queue"], c.train, c.checkpoint.every
    batches = train_batches(ray.get(loop_config["data"]), t.batch_size, c.seed, start=start)
    window: list[torch.Tensor] = []
    t0, handing = time.perf_counter(), 0.0  # handing: seconds spent putting weights and pieces on the queue
    for step in range(start + 1, t.max_steps + 1):
        x, y = next(batches)
        window.append(stage.forward(step - 1, x.chunk(world)[rank], y.chunk(world)[rank]))
        stage.backward(step - 1, update=True)
        evaluating = bool(t.eval_every) and step % t.eval_every == 0 and step < t.max_steps
        checkpointing = bool(every) and step % every == 0
        if step % t.log_every and not evaluating and not checkpointing and step < t.max_steps:
            continue
        values, window = _window_losses(window, world, step), []
        if rank == 0:
            queue.put(("losses", values))
            if evaluating and loop_config["has_val"]:
                t_put = time.perf_counter()
                queue.put(("eval", step, _cpu_state(model), t_put - t0 - handing))
                loop_config["evaluated"].get()  # the driver evaluated them: train on (dataparallel's note)
                handing += time.perf_counter() - t_put
        if (every and step % every == 0) or step == t.max_steps:  # rank 0: the replica; every rank: its stream
            t_put = time.perf_counter()
            piece = stage.checkpoint_state()
            if rank:
                piece = {"version": piece["version"], "rng": piece["rng"], "stats": piece["stats"]}
            queue.put(("checkpoint", step, rank, _to_bytes(piece)))
            handing += time.perf_counter() - t_put
    return time.perf_counter() - t0 - handing


def _window_losses(window: list[torch.Tensor], world: int, step: int) -> list[float]:
    """The global batch's loss of every update in the window (one all-reduce for all); raises on a non-finite one."""
    import torch.distributed as dist

    losses = torch.stack(window).double()  # (updates in the window,)
    if world > 1:
        dist.all_reduce(losses)
        losses /= world  # equal chunks: the mean of chunk means is the global batch's mean
    values = losses.tolist()
    if not all(math.isfinite(v) for v in values):
        raise FloatingPointError(f"the loss became non-finite by update {step}; lower optim.lr")
    return values


def _count_allreduce(replica: nn.Module) -> list[int]:
    """Count the bytes of every gradient bucket ``replica`` (DDP) all-reduces; see [Note: bytes].

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
