"""Samples/s of ``torch.distributed.pipelining`` (GPipe) on the same stages as a rayspec run: one process per
stage, NCCL between GPUs (``device="cuda"``: stage ``k`` on GPU ``k``) or gloo between CPU processes (a dry run)."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from benchmarks._shared.processes import free_port

__all__ = ["torch_gpipe_samples_per_s"]


def _rank(rank: int, world: int, port: int, part: nn.Module, batches: list, microbatches: int, warmup: int,
          device: str, results: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device == "cuda"
    dev = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        module = copy.deepcopy(part).to(dev)
        stage = PipelineStage(module, rank, world, dev)
        schedule = ScheduleGPipe(stage, microbatches, loss_fn=nn.functional.cross_entropy)
        opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            if rank == 0:
                schedule.step(x.to(dev))
            elif rank == world - 1:
                schedule.step(target=y.to(dev), losses=[])
            else:
                schedule.step()
            opt.step()

        for x, y in batches[:warmup]:
            step(x, y)
        if cuda:
            torch.cuda.synchronize(dev)
        dist.barrier()
        t0 = time.perf_counter()
        for x, y in batches[warmup:]:
            step(x, y)
        if cuda:
            torch.cuda.synchronize(dev)
        dist.barrier()
        results.put((rank, time.perf_counter() - t0, torch.cuda.max_memory_allocated(dev) if cuda else 0))
    finally:
        dist.destroy_process_group()


def torch_gpipe_samples_per_s(parts: Sequence[nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor]],
                              microbatches: int, warmup: int = 2, device: str = "cuda",
                              timeout_s: float = 300.0) -> dict[str, Any]:
    """Train ``batches`` (the first ``warmup`` untimed) with torch's GPipe over ``len(parts)`` processes; samples/s
    of the timed ones and each stage's peak GPU memory (bytes; 0 on CPU)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(k, len(parts), port, part, batches, microbatches, warmup, device, results),
                         daemon=True) for k, part in enumerate(parts)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    seconds = max(s for _, s, _ in got)
    samples = sum(len(y) for _, y in batches[warmup:])
    return {"samples_per_s": samples / seconds, "peak_bytes": [b for _, _, b in got]}
