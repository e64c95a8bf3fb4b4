"""Processes of a benchmark: a quiet local Ray, actor processes found and killed, CPU accounting, free ports."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence


def start_ray(num_cpus: int | None = None) -> None:
    """A local Ray instance of ``num_cpus`` CPUs (default: all), no dashboard, actors' logs kept out; once."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False)


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
    """A TCP port on 127.0.0.1 free right now (for a torch.distributed rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
