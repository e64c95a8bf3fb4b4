"""A private ``ray start --head`` on this machine for tests: free ports, its own temporary directory and token,
one process group stopped by signal (never ``ray stop``, which would stop every Ray on the machine)."""

from __future__ import annotations

import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks._shared import cluster_script
from benchmarks._shared.cluster_script import ROOT, processes, stop_group  # noqa: F401 - tests import processes here

BIN = Path(sys.executable).parent  # the environment's python and ray: the head's jobs run this python


def free_ports(count: int, avoid: tuple[int, int] | None = None) -> list[int]:
    """``count`` distinct ports free now, none inside ``avoid`` (an inclusive range: the workers' ports, which
    Ray refuses to share with a component's port)."""
    socks: list[socket.socket] = []
    try:
        while len(socks) < count:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if avoid is not None and avoid[0] <= port <= avoid[1]:
                s.close()  # the kernel hands out another port on the next bind
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_range(size: int = 200) -> tuple[int, int]:
    """A run of ``size`` ports that are free now, for the head's worker processes."""
    for _ in range(50):
        base = random.randrange(20000, 60000 - size)
        socks = []
        try:
            for port in range(base, base + size):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base, base + size - 1
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"found no {size} consecutive free ports")


def run_cluster_script(script: Path, args: list[str], what: str, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``script ARGS TEMP`` (a test's multi-node Ray cluster, ``ray.cluster_utils.Cluster``) in a process group
    of its own (``benchmarks._shared.cluster_script``); fail naming ``what`` if it failed, ran past ``timeout`` s
    or left processes behind.

    Returns:
        Its standard output.
    """
    run = cluster_script.run_cluster_script(script, args, timeout, env)
    if run.returncode is None:
        pytest.fail(f"the {what} did not end within {timeout:g} s:\n{run.err[-4000:]}")
    assert run.returncode == 0, run.err[-4000:]
    assert not run.left, f"still running after the {what}: {run.left}"
    return run.out


class RayHead:
    """``ray start --head --block`` on 127.0.0.1: free ports, its own temporary directory and token,
    and the environment's ``bin`` first on ``PATH`` (so a job's ``python`` is this environment's).

    With ``as_default``, ``self.env`` has ``RAY_TMPDIR`` set to the head's temporary directory, whose ``ray/``
    holds the head's session and ``ray_current_cluster``: to a process run with that environment it is the head
    that ``ray start`` started on this machine, while the machine's own ``/tmp/ray`` stays untouched.
    """

    def __init__(self, num_cpus: int = 2, as_default: bool = False) -> None:
        self.temp = Path(tempfile.mkdtemp(prefix="rs-head-"))  # short: Ray's socket paths live under it
        self.ray_temp = ray_temp = self.temp / "ray" if as_default else self.temp
        token = self.temp / "auth_token"
        token.write_text(secrets.token_hex(32))
        low, high = free_range()
        gcs, self.dashboard, client, node, objects, agent, agent_grpc, env_agent, metrics = free_ports(9, (low, high))
        self.agent = agent
        self.address = f"http://127.0.0.1:{self.dashboard}"
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)
        if as_default:
            self.env["RAY_TMPDIR"] = str(self.temp)
        self.token = token.read_text()
        self.command = [
            str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1", f"--port={gcs}", f"--dashboard-port={self.dashboard}",
            f"--ray-client-server-port={client}", f"--node-manager-port={node}", f"--object-manager-port={objects}",
            f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={env_agent}", f"--metrics-export-port={metrics}",
            f"--min-worker-port={low}", f"--max-worker-port={high}", f"--num-cpus={num_cpus}",
            "--object-store-memory=200000000", f"--temp-dir={ray_temp}", "--disable-usage-stats",
        ]
        self.log = self.temp / "head.out"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def get(self, url: str) -> bytes:
        """GET ``url`` from the dashboard (or its agent) with the head's token."""
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.read()

    def _ok(self, url: str) -> bool:
        try:
            self.get(url)
            return True
        except OSError:
            return False

    def wait_ready(self, timeout: float = 180.0) -> float:
        """Wait until the dashboard and the head's dashboard agent (which runs submitted jobs) answer."""
        assert self.proc is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                pytest.fail(f"ray start --head exited with {self.proc.returncode}:\n{self.tail()}")
            if self._ok(f"{self.address}/api/version") and self._ok(f"http://127.0.0.1:{self.agent}/api/healthz"):
                return time.monotonic() - t0
            time.sleep(0.5)
        pytest.fail(f"the head's dashboard or agent did not answer within {timeout:.0f} s:\n{self.tail()}")

    def ray(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "ray"), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)

    def tail(self, chars: int = 3000) -> str:
        logs = self.ray_temp / "session_latest" / "logs"
        parts = [self.log.read_text()[-chars:]] if self.log.exists() else []
        for name in ("dashboard_agent.log", "dashboard.log"):
            if (logs / name).exists():
                parts.append(f"--- {name}\n" + (logs / name).read_text()[-chars:])
        return "\n".join(parts)

    def stop(self) -> list[str]:
        left = stop_group(self.proc, self.temp) if self.proc is not None else []
        shutil.rmtree(self.temp, ignore_errors=True)
        return left
