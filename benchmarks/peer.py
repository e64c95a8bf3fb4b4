"""Peer comparison: rayspec on Ray against ``torch.distributed.pipelining`` on the same 2-stage split.

    python -m benchmarks.peer [--quick] [--model mlp] [--size full] [--batch 256] [--microbatches 8]
                              [--steps 20] [--repeats 3] [--transports p2p,compiled,object_store]

The model (default: the ``full`` MLP, 8 hidden 1024-wide blocks, on ``(3, 32, 32)`` images) is cut
into 2 stages by parameters; both sides start from the same weights, see the same batches
(``--batch`` samples in ``--microbatches`` micro-batches) and use SGD with the same lr and
momentum, 1 torch thread per stage process and nothing else of theirs running.

* torch: 2 processes (``torch.multiprocessing``, spawn), gloo, ``PipelineStage`` +
  ``ScheduleGPipe`` or ``Schedule1F1B``, ``torch.optim.SGD``, one ``step`` + ``opt.step()`` per
  batch. Both torch schedules are *flushed*: every batch fills and drains the pipeline and
  applies one synchronous update.
* rayspec: ``RayExecutor`` with 2 stage actors (``cpus_per_stage=1``) after
  ``ray.init(num_cpus=2)``, on each of ``--transports`` (``p2p``, ``compiled``, ``object_store``, ``gloo``), one ``run`` over all timed
  batches (as the trainer runs a segment). Runners:

  - ``gpipe``: fill-drain, one update per batch: like-for-like with ``ScheduleGPipe``.
  - ``1f1b-flushed``: rayspec's 1F1B actions per batch with ``group = M``, batches
    concatenated (a ``Schedule`` built from ``build_schedule("1f1b", 2, M, group=M)``): exactly
    torch's ``Schedule1F1B`` order and semantics, so the like-for-like comparison for it.
  - ``spectrain``: asynchronous 1F1B with weight prediction, one update per micro-batch
    (``M`` updates per batch) and no flush between batches: rayspec's method, not
    like-for-like (different optimisation, no bubble between batches, prediction work).
  - ``spectrain-grouped``: the same with ``pipeline.accumulate = M``: one update per batch of ``M``
    micro-batches, as torch, and 1F1B streaming on across batches (no flush); only the actions that
    straddle an update run at a stale or predicted version. Same updates, samples per update and
    kernels as torch's ``Schedule1F1B``; not like-for-like in the numbers (staleness at the seams).

Start-up is excluded: ``--warmup`` batches run on each side first. Each measurement of a rayspec
runner is paired with one of the matching torch schedule right before it (torch weights reset
to the same start first), so load drifts on a shared machine hit both alike; the ratio is the
median over pairs of ``torch seconds / rayspec seconds`` (= throughput rayspec / torch). For the
synchronous runners the per-batch losses of both sides are compared too (same numbers, up to
float summation order).

To explain gaps, the benchmark also measures: the compute of each stage alone (F and B of one
micro-batch at 1 thread; the ideal makespan of each schedule from it), and one hop of the
activation between two processes: torch ``dist.send``/``recv`` over gloo (ping-pong), and each
transport's hop between two Ray actors (``p2p``: rayspec's message over their gloo group; the others:
a chain of dependent actor calls, or of compiled-graph ops).

Findings on the 2-core CPU box (x86_64, no GPU, torch 2.14.1, ray 2.60), full MLP split [3, 6],
batch 256, M = 8, 20 steps x 3 pairs, three full runs (``benchmarks/results/peer.json`` holds the
third, the first with ``p2p`` reusing its message buffers), ratios ``p2p`` / ``compiled`` / ``object_store``:

* Like-for-like, ``gpipe`` 1.05-1.13 / 0.95-1.04 / 0.72-0.73 and ``1f1b-flushed`` 1.01-1.14 /
  0.87-1.01 / 0.70-0.76, with the same per-batch losses (max difference 3.3e-7). ``spectrain-grouped``
  (one update per batch, no flush) 1.06-1.13 / 1.00-1.17 / 0.74-0.76; ``spectrain`` (an update and
  predictions per micro-batch) 0.71-0.99 / 0.85-0.99 / 0.63-0.67.
* CPU per batch (stage actors + driver + the rest of Ray against torch's two ranks), ``gpipe``, second
  run: ``p2p`` 360 + 4 + 8 ms against 385; the object store 437 + 42 + 56 against 375. ``p2p`` and torch pay the
  same on the data path; the object store pays Ray's task per action (submission, object-store
  round, result store) on every hop, about 3.3 ms a hop here against 0.55 for ``p2p`` and 0.17 for a
  torch gloo ``send``/``recv`` in the same run.
* Torch reaches only 0.64-0.86 of the ideal makespan computed from each stage's compute alone: two
  compute-bound processes on 2 cores slow each other's kernels down (the ms inside each F and B
  table), so beating a flushed torch schedule by much on the same kernels is not on offer here;
  not flushing (``spectrain-grouped``) removes the bubble instead.
* Ray starts its workers at ``nice 15``. That is not the gap: with ``--worker-niceness 0`` two runs on
  the object store gave ``gpipe`` 0.76 / 0.67 and ``1f1b-flushed`` 0.66 / 0.61, against 0.68 / 0.70 and
  0.71 / 0.73 at Ray's default (``benchmarks/results/peer_nice{15,0}[_b].json``). ``benchmarks.hops``
  shows where it does matter: a hop next to two nice-0 processes that keep both cores busy.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import socket
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from benchmarks._common import start_ray, table, write
from rayspec.data import DataInfo
from rayspec.models import build_model
from rayspec.partition import by_parameters, split
from rayspec.schedule import Action, Schedule, build_schedule
from rayspec.stage import METHOD_POLICY, Stage

IMAGE = DataInfo("image", 10, (3, 32, 32))
TORCH_SCHEDULES = ("gpipe", "1f1b")
RAYSPEC_RUNNERS = ("gpipe", "1f1b-flushed", "spectrain", "spectrain-grouped")
# rayspec runner -> torch schedule
PEER_OF = {"gpipe": "gpipe", "1f1b-flushed": "1f1b", "spectrain": "1f1b", "spectrain-grouped": "1f1b"}
LIKE_FOR_LIKE = {"gpipe": True, "1f1b-flushed": True, "spectrain": False, "spectrain-grouped": False}


@dataclass(frozen=True)
class PeerConfig:
    """What both sides train: the model, the batches and SGD.

    Attributes:
        model, size: ``rayspec.models`` name and size (image data, ``(3, 32, 32)``, 10 classes).
        batch: samples per batch (one update each for the flushed schedules).
        microbatches: ``M``, micro-batches per batch.
        lr, momentum: SGD settings of both sides.
        pool: distinct batches generated up front and cycled (no data loading in the timings).
        seed: seeds the weights and the batches.
    """

    model: str = "mlp"
    size: str = "full"
    batch: int = 256
    microbatches: int = 8
    lr: float = 0.01
    momentum: float = 0.9
    pool: int = 4
    seed: int = 0


# ----------------------------------------------------------------------------- shared set-up
def build_parts(cfg: PeerConfig) -> tuple[list[nn.Sequential], list[int]]:
    """The model of ``cfg`` cut into 2 stages by parameters, and the block counts."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, IMAGE, cfg.size)
    balance = by_parameters(model, 2)
    return split(model, balance), balance


def make_batches(cfg: PeerConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``cfg.pool`` deterministic ``(images, labels)`` batches of ``cfg.batch`` samples."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return [(torch.randn(cfg.batch, *IMAGE.input_shape, generator=g),
             torch.randint(0, IMAGE.num_classes, (cfg.batch,), generator=g)) for _ in range(cfg.pool)]


def microbatches(batches: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int, count: int,
                 m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches ``start .. start + count - 1`` (cycling the pool), each cut into ``m`` micro-batches in order."""
    out = []
    for i in range(start, start + count):
        x, y = batches[i % len(batches)]
        out += list(zip(x.tensor_split(m), y.tensor_split(m)))
    return out


def flushed_1f1b(stages: int, m: int, batches: int) -> Schedule:
    """``batches`` flushed 1F1B batches of ``m`` micro-batches, one update each: ``Schedule1F1B``'s order and semantics."""
    one = build_schedule("1f1b", stages, m, group=m)
    actions = tuple(
        tuple(Action(a.stage, a.kind, a.microbatch + b * m, a.update) for b in range(batches) for a in one.actions[k])
        for k in range(stages)
    )
    schedule = Schedule("1f1b", stages, m * batches, m, actions)
    schedule.validate()
    return schedule


def rayspec_schedule(runner: str, m: int, batches: int) -> Schedule:
    """The schedule a rayspec runner trains ``batches`` batches with."""
    if runner == "gpipe":
        return build_schedule("gpipe", 2, m * batches, group=m)
    if runner == "1f1b-flushed":
        return flushed_1f1b(2, m, batches)
    if runner == "spectrain":
        return build_schedule("1f1b", 2, m * batches)
    if runner == "spectrain-grouped":
        return build_schedule("1f1b", 2, m * batches, group=m)
    raise ValueError(f"runner={runner!r} is unknown; choose one of {', '.join(RAYSPEC_RUNNERS)}")


def profile_stages(parts: Sequence[nn.Module], cfg: PeerConfig, repeats: int = 10) -> dict[tuple[int, str], float]:
    """Median seconds of each stage's F and B on one micro-batch, alone, at 1 thread (loss included on the last)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        parts = [copy.deepcopy(p) for p in parts]
        x, y = make_batches(cfg)[0]
        x, y = x[: cfg.batch // cfg.microbatches], y[: cfg.batch // cfg.microbatches]
        out: dict[tuple[int, str], float] = {}
        inp = x
        for k, part in enumerate(parts):
            f, b = [], []
            for _ in range(repeats + 2):
                xi = inp.detach().requires_grad_(k > 0)
                t0 = time.perf_counter()
                o = part(xi)
                if k == len(parts) - 1:
                    o = nn.functional.cross_entropy(o, y)
                t1 = time.perf_counter()
                if k == len(parts) - 1:
                    o.backward()
                else:
                    o.backward(torch.ones_like(o))
                t2 = time.perf_counter()
                f.append(t1 - t0)
                b.append(t2 - t1)
            out[(k, "F")], out[(k, "B")] = statistics.median(f[2:]), statistics.median(b[2:])
            inp = part(inp).detach()
        return out
    finally:
        torch.set_num_threads(threads)


def ideal_step_s(runner: str, m: int, durations: dict[tuple[int, str], float], batches: int = 4) -> float:
    """Ideal seconds per batch of a runner's schedule (no communication cost) under ``durations``."""
    return rayspec_schedule(runner, m, batches).makespan(durations) / batches


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a live process has used (Linux ``/proc``); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(roots: Sequence[int]) -> list[int]:
    """``roots`` and all their live descendants (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def self_cpu_s() -> float:
    """CPU seconds of this process, all threads."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def ray_system_pids() -> list[int]:
    """Root processes of this driver's local Ray node (GCS, raylet, monitors); empty if Ray does not say."""
    try:
        import ray

        node = ray._private.worker._global_node  # not public API; used only for the CPU accounting
        return [p.process.pid for procs in node.all_processes.values() for p in procs]
    except Exception:  # noqa: BLE001 - the accounting is optional
        return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- torch side
def _torch_worker(rank: int, port: int, part: nn.Module, cfg: PeerConfig, commands: Any, results: Any) -> None:
    """One torch pipeline rank: runs the commands it is sent until ``stop``."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        data = make_batches(cfg)
        init = copy.deepcopy(part.state_dict())
        runs: dict[str, dict[str, Any]] = {}
        for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
            module = copy.deepcopy(part)
            stage = PipelineStage(module, rank, 2, torch.device("cpu"))
            busy = _time_actions(stage)
            sched = cls(stage, cfg.microbatches, loss_fn=nn.functional.cross_entropy)
            runs[name] = {"module": module, "schedule": sched, "step": 0, "busy": busy,
                          "opt": torch.optim.SGD(module.parameters(), lr=cfg.lr, momentum=cfg.momentum)}
        results.put((rank, "ready", None))
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                break
            if cmd[0] == "reset":  # back to the initial weights, fresh momentum, batch 0
                run = runs[cmd[1]]
                run["module"].load_state_dict(init)
                run["opt"] = torch.optim.SGD(run["module"].parameters(), lr=cfg.lr, momentum=cfg.momentum)
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
                busy_s = {kind: t / max(1, n) for kind, (t, n) in run["busy"].items()}
                results.put((rank, "steps", (elapsed, losses, cpu, busy_s)))
            elif cmd[0] == "pingpong":  # one-way seconds of a tensor hop over gloo send/recv
                shape, count = cmd[1], cmd[2]
                buf = torch.randn(shape)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(count):
                    if rank == 0:
                        dist.send(buf, 1)
                        dist.recv(buf, 1)
                    else:
                        dist.recv(buf, 0)
                        dist.send(buf, 0)
                elapsed = time.perf_counter() - t0
                results.put((rank, "pingpong", elapsed / (2 * count)))
    finally:
        dist.destroy_process_group()


def _time_actions(stage: Any) -> dict[str, list]:
    """Wrap a ``PipelineStage``'s ``forward_one_chunk``/``backward_one_chunk`` to sum their seconds: ``{kind: [s, n]}``."""
    busy: dict[str, list] = {"F": [0.0, 0], "B": [0.0, 0]}
    for kind, attr in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
        inner = getattr(stage, attr)

        def timed(*a: Any, _inner: Any = inner, _kind: str = kind, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                busy[_kind][0] += time.perf_counter() - t0
                busy[_kind][1] += 1

        setattr(stage, attr, timed)
    return busy


class TorchPeer:
    """Two live torch pipeline ranks (spawned processes, gloo) driven by commands; use as a context manager."""

    def __init__(self, parts: Sequence[nn.Module], cfg: PeerConfig, timeout_s: float = 600.0) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.results = ctx.Queue()
        self.commands = [ctx.Queue(), ctx.Queue()]
        port = free_port()
        self.procs = [ctx.Process(target=_torch_worker, args=(r, port, parts[r], cfg, self.commands[r], self.results),
                                  daemon=True) for r in range(2)]
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
        per F and B inside each rank's ``PipelineStage`` (``{(rank, kind): s}``).
        """
        self._send("steps", schedule, count)
        (t0, _, c0, b0), (t1, losses, c1, b1) = self._collect("steps")
        self.last_cpu_s = {"ranks": c0 + c1}
        self.last_busy_s = {(r, k): v for r, b in enumerate((b0, b1)) for k, v in b.items()}
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


# ----------------------------------------------------------------------------- rayspec side
class RayspecRunner:
    """One rayspec runner on a ``RayExecutor`` with 2 stage actors; needs ``ray.init()`` first."""

    def __init__(self, parts: Sequence[nn.Module], cfg: PeerConfig, runner: str, transport: str,
                 cpus_per_stage: float = 1.0) -> None:
        from rayspec.ray_executor import RayExecutor

        if runner not in RAYSPEC_RUNNERS:
            raise ValueError(f"runner={runner!r} is unknown; choose one of {', '.join(RAYSPEC_RUNNERS)}")
        self.runner, self.cfg = runner, cfg
        method = "spectrain" if runner.startswith("spectrain") else "gpipe"
        self.group = rayspec_schedule(runner, cfg.microbatches, 1).group
        stages = [Stage(copy.deepcopy(p), k, 2, policy=METHOD_POLICY[method], lr=cfg.lr, momentum=cfg.momentum,
                        group=self.group) for k, p in enumerate(parts)]
        self.batches = make_batches(cfg)
        self.done = 0
        self.executor = RayExecutor(stages, method, transport=transport, cpus_per_stage=cpus_per_stage)
        import ray

        self.stage_pids = ray.get([a.__ray_call__.remote(lambda _self: os.getpid()) for a in self.executor.actors])
        self.last_cpu_s: dict[str, float] = {}

    def _cpu(self) -> dict[str, float]:
        stages = sum(process_cpu_s(p) for p in self.stage_pids)
        tree = set(process_tree(ray_system_pids())) - set(self.stage_pids) - {os.getpid()}
        return {"stages": stages, "driver": self_cpu_s(), "ray_system": sum(process_cpu_s(p) for p in tree)}

    def steps(self, count: int) -> tuple[float, list[float]]:
        """Train ``count`` batches in one ``run``: seconds and per-batch losses (mean over the batch)."""
        m = self.cfg.microbatches
        schedule = rayspec_schedule(self.runner, m, count)
        mbs = microbatches(self.batches, self.done, count, m)
        cpu0 = self._cpu()
        t0 = time.perf_counter()
        losses = self.executor.run(schedule, mbs)
        elapsed = time.perf_counter() - t0
        self.last_cpu_s = {k: v - cpu0[k] for k, v in self._cpu().items()}
        self.done += count
        scale = self.group / m  # gpipe losses are scaled by 1/group: back to the batch mean
        return elapsed, [sum(losses[i * m:(i + 1) * m]) * scale for i in range(count)]

    def busy_per_action_s(self) -> dict[tuple[int, str], float]:
        """Mean seconds per F and B inside each stage (``StageStats.busy_s``) so far, fused last-stage calls included."""
        out = {}
        for st in self.executor.stage_stats():
            for kind in "FB":
                out[(st["stage"], kind)] = st["busy_s"][kind] / max(1, st["actions"][kind])
        return out

    def close(self) -> None:
        self.executor.close()


def ray_hop_s(transport: str, shape: tuple[int, ...], count: int = 50) -> float:
    """Seconds per hop of a chain of ``count`` dependent calls alternating between 2 actors, each returning a fresh tensor.

    Each call receives the previous call's tensor and returns a fresh one of the same shape,
    like an activation going from stage to stage (submitted by the driver, as ``RayExecutor`` does).
    """
    import ray

    @ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
    class Hop:
        def __init__(self) -> None:
            torch.set_num_threads(1)
            warnings.filterwarnings("ignore", message="Zero-copy tensor serialization is enabled")

        def echo(self, x: torch.Tensor) -> torch.Tensor:
            return x + 0.0

        def total(self, x: torch.Tensor) -> float:
            return float(x.sum())

    if transport == "p2p":
        return p2p_hop_s(shape, count)
    env = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}} if transport == "object_store" else None
    actors = [Hop.options(num_cpus=0.5, runtime_env=env).remote() for _ in range(2)]  # type: ignore[attr-defined]
    try:
        ray.get([a.total.remote(torch.zeros(1)) for a in actors])
        if transport == "compiled":
            return compiled_hop_s(actors, shape, count)
        if transport != "object_store":
            from ray.experimental.collective import create_collective_group

            create_collective_group(actors, backend=transport)

        def chain(n: int) -> float:
            x = torch.randn(shape)
            t0 = time.perf_counter()
            r: Any = x
            for i in range(n):
                call = actors[i % 2].echo
                r = (call.options(tensor_transport=transport) if transport != "object_store" else call).remote(r)
            ray.get(actors[n % 2].total.remote(r))
            return time.perf_counter() - t0

        chain(5)
        # The chain's fixed cost (first submission, last fetch) cancels in the difference of two lengths.
        per_hop = (chain(count) - chain(count // 5)) / (count - count // 5)
        ray.get([a.total.remote(torch.zeros(1)) for a in actors])
        time.sleep(1.0)  # let Ray's RDT monitor see the last transfers complete before the actors go
        return per_hop
    finally:
        for a in actors:
            ray.kill(a)


def p2p_hop_s(shape: tuple[int, ...], count: int = 50) -> float:
    """One-way seconds of a tensor between 2 Ray actors on ``pipeline.transport=p2p``'s data path: rayspec's
    message (a header, then the bytes) over their gloo group, ping-pong timed inside the actors."""
    import ray

    from rayspec.p2p import P2PRunner

    @ray.remote(num_cpus=0.5)
    class P2PHop(P2PRunner):
        def __init__(self) -> None:
            torch.set_num_threads(1)

        def pingpong(self, rank: int, n: int) -> float:
            x = torch.randn(shape)
            t0 = time.perf_counter()
            for i in range(n):
                if rank == 0:
                    self._p2p_send(x, 1, 2 * i)
                    x = self._p2p_recv(1, 2 * i + 1)
                    self.p2p_wait_sends([(1, 2 * i)])  # its reply proves it through, as in a pipeline
                else:
                    x = self._p2p_recv(0, 2 * i)
                    if i:
                        self.p2p_wait_sends([(0, 2 * i - 1)])
                    self._p2p_send(x + 0.0, 0, 2 * i + 1)  # a fresh tensor, as a stage sends
            self.p2p_wait_sends()
            return time.perf_counter() - t0

    actors = [P2PHop.remote() for _ in range(2)]  # type: ignore[attr-defined]
    try:
        address, port = ray.get(actors[0].p2p_rendezvous.remote(2, 120.0))
        ray.get([a.p2p_init.remote(address, port, r, 2, 120.0) for r, a in enumerate(actors)])
        ray.get([a.pingpong.remote(r, 5) for r, a in enumerate(actors)])
        return ray.get([a.pingpong.remote(r, count) for r, a in enumerate(actors)])[0] / (2 * count)
    finally:
        for a in actors:
            ray.kill(a)


def compiled_hop_s(actors: Sequence[Any], shape: tuple[int, ...], count: int, repeats: int = 10) -> float:
    """Seconds per hop of a compiled graph chaining ``count`` ``echo`` calls between 2 actors (the median run)."""
    from ray.dag import InputNode

    def chain(n: int) -> float:
        with InputNode() as inp:
            node = inp
            for i in range(n):
                node = actors[i % 2].echo.bind(node)
        dag = node.experimental_compile()
        try:
            x = torch.randn(shape)
            for _ in range(3):
                dag.execute(x).get(timeout=-1)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                dag.execute(x).get(timeout=-1)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        finally:
            dag.teardown()

    return (chain(count) - chain(count // 5)) / (count - count // 5)


# ----------------------------------------------------------------------------- the comparison
def compare(parts: Sequence[nn.Module], cfg: PeerConfig, peer: TorchPeer, runner: str, transport: str, *,
            steps: int, warmup: int, repeats: int, cpus_per_stage: float = 1.0) -> dict:
    """Pair ``repeats`` measurements of a rayspec runner with its torch schedule's; both start from the same weights.

    Returns:
        Throughputs, the median pair ratio, per-batch losses of both, and where the time goes:
        mean ms per F and B inside each stage on both sides and CPU ms per batch by process group.
    """
    torch_name = PEER_OF[runner]
    peer.reset(torch_name)
    ours = RayspecRunner(parts, cfg, runner, transport, cpus_per_stage)
    try:
        _, tl = peer.steps(torch_name, warmup)
        _, rl = ours.steps(warmup)
        before = ours.executor.stage_stats()
        t_times, r_times, t_losses, r_losses = [], [], list(tl), list(rl)
        t_cpu: list[dict[str, float]] = []
        r_cpu: list[dict[str, float]] = []
        t_busy: list[dict[tuple[int, str], float]] = []
        for _ in range(repeats):
            t, tl = peer.steps(torch_name, steps)
            t_cpu.append(peer.last_cpu_s)
            t_busy.append(peer.last_busy_s)
            r, rl = ours.steps(steps)
            r_cpu.append(ours.last_cpu_s)
            t_times.append(t)
            r_times.append(r)
            t_losses += tl
            r_losses += rl
        after = ours.executor.stage_stats()
    finally:
        ours.close()
    r_busy = {(a["stage"], kind): (a["busy_s"][kind] - b["busy_s"][kind]) / max(1, a["actions"][kind] - b["actions"][kind])
              for a, b in zip(after, before) for kind in "FB"}
    batches = steps * repeats
    samples = steps * cfg.batch
    ratios = [t / r for t, r in zip(t_times, r_times)]
    synchronous = LIKE_FOR_LIKE[runner]
    return {
        "runner": runner, "transport": transport, "torch": torch_name, "like_for_like": synchronous,
        "torch_samples_per_s": samples / statistics.median(t_times),
        "rayspec_samples_per_s": samples / statistics.median(r_times),
        "ratio": statistics.median(ratios), "ratios": ratios,
        "torch_step_ms": statistics.median(t_times) / steps * 1e3,
        "rayspec_step_ms": statistics.median(r_times) / steps * 1e3,
        "torch_losses": t_losses, "rayspec_losses": r_losses,
        "losses_finite": all(math.isfinite(v) for v in t_losses + r_losses),
        # equal up to summation order when like-for-like; otherwise how far staleness moved the losses
        "max_loss_diff": max(abs(a - b) for a, b in zip(t_losses, r_losses)),
        "rayspec_busy_ms": {f"{k}{kind}": v * 1e3 for (k, kind), v in r_busy.items()},
        "torch_busy_ms": {f"{k}{kind}": statistics.mean(b[(k, kind)] for b in t_busy) * 1e3 for (k, kind) in r_busy},
        "torch_cpu_ms_per_batch": {k: sum(c[k] for c in t_cpu) / batches * 1e3 for k in t_cpu[0]},
        "rayspec_cpu_ms_per_batch": {k: sum(c[k] for c in r_cpu) / batches * 1e3 for k in r_cpu[0]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps, one pair per runner")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--size", default="full")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="timed batches per measurement")
    ap.add_argument("--warmup", type=int, default=2, help="untimed batches first, on each side")
    ap.add_argument("--repeats", type=int, default=3, help="torch/rayspec measurement pairs per runner")
    ap.add_argument("--transports", default="p2p,compiled,object_store")
    ap.add_argument("--runners", default=",".join(RAYSPEC_RUNNERS))
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--worker-niceness", type=int, default=None,
                    help="RAY_worker_niceness of the Ray instance this starts (Ray's default: 15)")
    ap.add_argument("--out", default="peer", help="result name: benchmarks/results/OUT.json")
    args = ap.parse_args()
    if args.worker_niceness is not None:
        os.environ["RAY_worker_niceness"] = str(args.worker_niceness)
    steps, repeats = (5, 1) if args.quick else (args.steps, args.repeats)
    cfg = PeerConfig(args.model, args.size, args.batch, args.microbatches, args.lr, args.momentum)
    runners = [r for r in args.runners.split(",") if r]
    transports = [t for t in args.transports.split(",") if t]
    torch.set_num_threads(1)
    parts, balance = build_parts(cfg)
    m = cfg.microbatches
    mb_shape = (cfg.batch // m, *IMAGE.input_shape)
    act_shape = tuple(parts[0](torch.zeros(mb_shape)).shape)
    compute = profile_stages(parts, cfg)
    print(f"model {cfg.model} ({cfg.size}) split {balance}; batch {cfg.batch} in {m} micro-batches of {mb_shape[0]}; "
          f"activation {list(act_shape)} ({math.prod(act_shape) * 4 / 1024:.0f} KiB); {steps} steps x {repeats} pairs")
    print("compute alone, ms per micro-batch: " + ", ".join(f"stage {k} {kind} {v * 1e3:.2f}"
                                                            for (k, kind), v in compute.items()))
    import ray

    rows: list[dict] = []
    hops: dict[str, float] = {}
    with TorchPeer(parts, cfg) as peer:
        hops["torch gloo send/recv"] = peer.hop_s(act_shape)
        start_ray(2)
        try:
            for transport in transports:
                hops[f"ray {transport}"] = ray_hop_s(transport, act_shape)
            for transport in transports:
                for runner in runners:
                    row = compare(parts, cfg, peer, runner, transport, steps=steps, warmup=args.warmup,
                                  repeats=repeats)
                    row["ideal_step_ms"] = ideal_step_s(runner, m, compute) * 1e3
                    row["torch_ideal_step_ms"] = ideal_step_s("gpipe" if row["torch"] == "gpipe" else "1f1b-flushed",
                                                              m, compute) * 1e3
                    rows.append(row)
                    print(f"  {runner} on {transport}: rayspec {row['rayspec_samples_per_s']:.0f} samples/s, "
                          f"torch {row['torch']} {row['torch_samples_per_s']:.0f}, ratio {row['ratio']:.2f}")
        finally:
            ray.shutdown()
    print("\nthroughput (samples/s; ratio = rayspec / torch, median over interleaved pairs):")
    print(table([{
        "rayspec": r["runner"], "transport": r["transport"], "vs torch": r["torch"],
        "like-for-like": "yes" if r["like_for_like"] else "no",
        "rayspec s/s": f"{r['rayspec_samples_per_s']:.0f}", "torch s/s": f"{r['torch_samples_per_s']:.0f}",
        "ratio": f"{r['ratio']:.2f}", "pairs": " ".join(f"{v:.2f}" for v in r["ratios"]),
        "max |loss diff|": "-" if r["max_loss_diff"] is None else f"{r['max_loss_diff']:.1e}",
    } for r in rows], ["rayspec", "transport", "vs torch", "like-for-like", "rayspec s/s", "torch s/s", "ratio",
                       "pairs", "max |loss diff|"]))
    for r in rows:  # the slower stage's busy time per batch, and the rest of the batch (waiting)
        for side in ("rayspec", "torch"):
            b = r[f"{side}_busy_ms"]
            r[f"{side}_bottleneck_busy_ms"] = max(m * (b[f"{k}F"] + b[f"{k}B"]) for k in range(2))
            r[f"{side}_idle_ms"] = r[f"{side}_step_ms"] - r[f"{side}_bottleneck_busy_ms"]
    print("\nwhere the time goes, ms per batch of M micro-batches (ideal: the schedule's makespan from the compute "
          "alone; eff = ideal / measured; busy: the slower stage's time inside its F and B; idle = batch - busy):")
    print(table([{
        "runner": r["runner"], "transport": r["transport"], "ideal": f"{r['ideal_step_ms']:.0f}",
        "rayspec": f"{r['rayspec_step_ms']:.0f}", "eff": f"{r['ideal_step_ms'] / r['rayspec_step_ms']:.2f}",
        "busy": f"{r['rayspec_bottleneck_busy_ms']:.0f}", "idle": f"{r['rayspec_idle_ms']:.0f}",
        "torch ideal": f"{r['torch_ideal_step_ms']:.0f}", "torch": f"{r['torch_step_ms']:.0f}",
        "torch eff": f"{r['torch_ideal_step_ms'] / r['torch_step_ms']:.2f}",
        "torch busy": f"{r['torch_bottleneck_busy_ms']:.0f}", "torch idle": f"{r['torch_idle_ms']:.0f}",
        "extra/action": f"{(r['rayspec_step_ms'] - r['torch_step_ms']) / (4 * m):.2f}",
        "cpu stages": f"{r['rayspec_cpu_ms_per_batch']['stages']:.0f}",
        "cpu driver": f"{r['rayspec_cpu_ms_per_batch']['driver']:.0f}",
        "cpu ray sys": f"{r['rayspec_cpu_ms_per_batch']['ray_system']:.0f}",
        "torch cpu": f"{r['torch_cpu_ms_per_batch']['ranks']:.0f}",
    } for r in rows], ["runner", "transport", "ideal", "rayspec", "eff", "busy", "idle", "torch ideal", "torch",
                       "torch eff", "torch busy", "torch idle", "extra/action", "cpu stages", "cpu driver",
                       "cpu ray sys", "torch cpu"]))
    print("(extra/action: rayspec minus torch ms per batch over the 4M actions of a batch; cpu: CPU ms per batch of "
          "rayspec's 2 stage actors, its driver and the rest of its Ray node, and of the 2 torch ranks; "
          "2 cores give 2 CPU ms per wall ms)")
    print("\nms inside a stage per action (rayspec: Stage.forward/backward, optimizer step included; "
          "torch: PipelineStage.forward_one_chunk/backward_one_chunk):")
    keys = list(rows[0]["rayspec_busy_ms"]) if rows else []
    print(table([{"runner": "compute alone", "transport": "-",
                  **{k: f"{compute[(int(k[0]), k[1])] * 1e3:.1f}" for k in keys}}]
                + [{"runner": f"rayspec {r['runner']}", "transport": r["transport"],
                    **{k: f"{r['rayspec_busy_ms'][k]:.1f}" for k in keys}} for r in rows]
                + [{"runner": f"torch {r['torch']}", "transport": f"(paired with {r['runner']}/{r['transport']})",
                    **{k: f"{r['torch_busy_ms'][k]:.1f}" for k in keys}} for r in rows],
                ["runner", "transport", *keys]))
    print("\none hop of the activation, ms: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in hops.items()))
    path = write(args.out, {"config": asdict(cfg), "worker_niceness": os.environ.get("RAY_worker_niceness", "15"), "balance": balance, "steps": steps, "warmup": args.warmup,
                          "repeats": repeats, "activation_shape": list(act_shape),
                          "compute_ms": {f"{k}{kind}": v * 1e3 for (k, kind), v in compute.items()},
                          "hop_ms": {k: v * 1e3 for k, v in hops.items()}, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
