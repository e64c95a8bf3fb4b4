"""Shared pieces of the benchmarks: a quiet Ray, sleep-timed blocks, result files, CPU accounting, free ports."""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"


def start_ray(num_cpus: int | None = None) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False)


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {gpu}, torch {torch.__version__}"


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": machine(), "date": time.strftime("%Y-%m-%d"), **payload}
    path.write_text(json.dumps(payload, indent=2))
    return path


class _SleepGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, backward_s):  # type: ignore[override]
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        time.sleep(ctx.backward_s)
        return g, None


class SleepBlock(nn.Module):
    """A block that takes ``forward_s`` to run forward and ``backward_s`` backward, using no CPU."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_s)
        return _SleepGrad.apply(x * self.scale, self.backward_s)


def table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(f"{r[c]}") for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(f"{r[c]}".ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


def actor_processes(title: str = "StageActor") -> list:
    """This process's live actor processes of one class (Ray titles them ``ray::<title>...``), oldest first."""
    import psutil

    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if " ".join(proc.cmdline()).startswith(f"ray::{title}"):
                found.append(proc)
        except psutil.Error:
            continue
    return sorted(found, key=lambda p: p.create_time())


def stage_actor_processes() -> list:
    """This process's live stage actor processes, oldest first."""
    return actor_processes("StageActor")


class KillActor:
    """A run callback: at update ``at``, SIGKILL the newest actor process titled ``title``: by default the
    running pipeline's last stage; ``DriverActor`` for the run's driver actor."""

    def __init__(self, at: int, title: str = "StageActor") -> None:
        self.at, self.title = at, title
        self.pid: int | None = None
        self.killed_at: float | None = None  # time.time() of the kill

    def on_metrics(self, record: dict) -> None:
        import signal

        if self.pid is None and "loss" in record and record["step"] >= self.at:
            victims = actor_processes(self.title)
            if not victims:
                raise RuntimeError(f"no {self.title} process found under this process")
            self.pid, self.killed_at = victims[-1].pid, time.time()
            os.kill(self.pid, signal.SIGKILL)


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
