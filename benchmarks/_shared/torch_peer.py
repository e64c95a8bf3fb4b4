"""``torch.distributed.pipelining`` on the peer benchmark's 2 stages (or 4 chunks, 2 per rank, for
``ScheduleInterleaved1F1B``): two ranks in their own processes, driven by commands (``TorchPeer``)."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from benchmarks._shared.one_hop import gloo_pingpong_s
from benchmarks._shared.peer_setup import CHUNKS_PER_RANK, NOT_ON_RAY, TORCH_SCHEDULES, PeerConfig, make_batches
from benchmarks._shared.processes import free_port, self_cpu_s

__all__ = ["RUN_HERE", "TorchPeer"]

RUN_HERE = tuple(name for name in TORCH_SCHEDULES if name not in NOT_ON_RAY)
"""The torch schedules the workers keep ready: those a rayspec runner on Ray is paired with."""


def _prepare(name: str, rank: int, parts: Sequence[nn.Module], cfg: PeerConfig) -> dict[str, Any]:
    """Schedule ``name`` on this rank's ``parts`` (one stage, or its chunks ``rank, rank + 2, ...``): its modules,
    their initial weights, the schedule, its optimizer and the per-stage action timers."""
    from torch.distributed.pipelining import PipelineStage, schedules

    modules = [copy.deepcopy(p) for p in parts]
    stages = [PipelineStage(mod, rank + 2 * j, 2 * len(parts), torch.device("cpu")) for j, mod in enumerate(modules)]
    busy: dict[tuple[int, str], list] = {}
    for stage in stages:
        _time_actions(stage, busy)
    cls = getattr(schedules, TORCH_SCHEDULES[name])
    multi = issubclass(cls, schedules.PipelineScheduleMulti)  # takes this rank's stages as a list
    sched = cls(stages if multi else stages[0], cfg.microbatches, loss_fn=nn.functional.cross_entropy)
    params = [p for mod in modules for p in mod.parameters()]
    return {"modules": modules, "init": [copy.deepcopy(mod.state_dict()) for mod in modules], "schedule": sched,
            "step": 0, "busy": busy, "opt": torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)}


def _torch_worker(rank: int, port: int, part: nn.Module, cfg: PeerConfig, commands: Any, results: Any,
                  chunks: Sequence[nn.Module] = ()) -> None:
    """One torch pipeline rank: runs the commands it is sent until ``stop``. ``chunks``: this rank's model chunks
    for the schedules of several per rank (``CHUNKS_PER_RANK``; none: those are not prepared)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        data = make_batches(cfg)
        runs = {name: _prepare(name, rank, chunks if name in CHUNKS_PER_RANK else [part], cfg)
                for name in RUN_HERE if chunks or name not in CHUNKS_PER_RANK}
        results.put((rank, "ready", None))
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                break
            if cmd[0] == "reset":  # back to the initial weights, fresh momentum, batch 0
                run = runs[cmd[1]]
                for mod, init in zip(run["modules"], run["init"]):
                    mod.load_state_dict(init)
                params = [p for mod in run["modules"] for p in mod.parameters()]
                run["opt"] = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
                run["step"] = 0
                results.put((rank, "reset", None))
            elif cmd[0] == "steps":
                run = runs[cmd[1]]
                losses: list[float] = []
                for v in run["busy"].values():
                    v[:] = [0.0, 0]
                dist.barrier()
                cpu0 = self_cpu_s()
                t0 = time.perf_counter()
                for _ in range(cmd[2]):
                    x, y = data[run["step"] % len(data)]
                    run["opt"].zero_grad()
                    if rank == 0:
                        run["schedule"].step(x)
                    else:
                        mb: list[torch.Tensor] = []
                        run["schedule"].step(target=y, losses=mb, return_outputs=False)
                        losses.append(float(torch.stack(mb).mean().detach()))
                    run["opt"].step()
                    run["step"] += 1
                dist.barrier()
                elapsed, cpu = time.perf_counter() - t0, self_cpu_s() - cpu0
                busy_s = {key: t / max(1, n) for key, (t, n) in run["busy"].items()}
                results.put((rank, "steps", (elapsed, losses, cpu, busy_s)))
            elif cmd[0] == "pingpong":  # one-way seconds of a tensor hop over gloo send/recv
                shape, count = cmd[1], cmd[2]
                buf = torch.randn(shape)
                dist.barrier()
                results.put((rank, "pingpong", gloo_pingpong_s(buf, rank, count) / (2 * count)))
    finally:
        dist.destroy_process_group()


def _time_actions(stage: Any, busy: dict[tuple[int, str], list]) -> None:
    """Wrap a ``PipelineStage``'s ``forward_one_chunk``/``backward_one_chunk``/``backward_weight_one_chunk`` to sum
    their seconds into ``busy[(stage index, kind)] = [s, n]``, a backward without its weight gradient
    (``full_backward=False``) as ``I``."""
    k = stage.stage_index
    busy.update({(k, kind): [0.0, 0] for kind in "FBIW"})
    for kind, attr in (("F", "forward_one_chunk"), ("B", "backward_one_chunk"), ("W", "backward_weight_one_chunk")):
        inner = getattr(stage, attr)

        def timed(*a: Any, _inner: Any = inner, _kind: str = kind, **kw: Any) -> Any:
            key = (k, "I" if _kind == "B" and not kw.get("full_backward", True) else _kind)
            t0 = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                busy[key][0] += time.perf_counter() - t0
                busy[key][1] += 1

        setattr(stage, attr, timed)


class TorchPeer:
    """Two live torch pipeline ranks (spawned processes, gloo) driven by commands; use as a context manager.
    ``chunks``: the model in 4 chunks (``build_parts(cfg, 4)``) for the schedules of 2 chunks per rank; none: those
    are not run."""

    def __init__(self, parts: Sequence[nn.Module], cfg: PeerConfig, timeout_s: float = 600.0,
                 chunks: Sequence[nn.Module] = ()) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.results = ctx.Queue()
        self.commands = [ctx.Queue(), ctx.Queue()]
        port = free_port()
        self.procs = [ctx.Process(target=_torch_worker, daemon=True,
                                  args=(r, port, parts[r], cfg, self.commands[r], self.results, list(chunks[r::2])))
                      for r in range(2)]
        for p in self.procs:
            p.start()
        self._collect("ready")

    def _collect(self, kind: str) -> list[Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(got) < 2:
            try:
                rank, k, payload = self.results.get(timeout=5.0)
            except Exception:  # queue.Empty: check the workers are alive
                dead = [p.exitcode for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"torch pipeline workers failed (exit codes {dead}) waiting for {kind}") from None
                continue
            if k != kind:
                raise RuntimeError(f"torch worker {rank} answered {k!r}, expected {kind!r}")
            got[rank] = payload
        return [got[0], got[1]]

    def _send(self, *cmd: Any) -> None:
        for q in self.commands:
            q.put(cmd)

    def reset(self, schedule: str) -> None:
        """Put ``schedule``'s weights back to the start and its batch counter to 0."""
        self._send("reset", schedule)
        self._collect("reset")

    def steps(self, schedule: str, count: int) -> tuple[float, list[float]]:
        """Train ``count`` batches with ``schedule``: seconds (slower rank, between barriers) and per-batch losses.

        ``last_cpu_s`` then holds the CPU seconds of both ranks and ``last_busy_s`` the mean seconds
        per F, B, I and W inside each ``PipelineStage`` (``{(stage, kind): s}``; stage = rank with one per rank).
        """
        self._send("steps", schedule, count)
        (t0, _, c0, b0), (t1, losses, c1, b1) = self._collect("steps")
        self.last_cpu_s = {"ranks": c0 + c1}
        self.last_busy_s = {**b0, **b1}
        return max(t0, t1), losses

    def hop_s(self, shape: tuple[int, ...], count: int = 50) -> float:
        """One-way seconds of a tensor of ``shape`` from one rank to the other (gloo ``send``/``recv``)."""
        self._send("pingpong", shape, count)
        return max(self._collect("pingpong"))

    def close(self) -> None:
        for p, q in zip(self.procs, self.commands):
            if p.is_alive():
                q.put(("stop",))
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> TorchPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
