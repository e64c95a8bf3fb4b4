"""A script that starts its own multi-node Ray on this machine (``ray.cluster_utils.Cluster``), run in a process group
of its own with a private temporary directory and token, and stopped by signal (never ``ray stop``, which would stop
every Ray on the machine). ``tests/ray_head.py`` and ``benchmarks.recovery`` run the node-loss script this way."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout: the script's working directory."""


def processes(pgid: int, temp: Path) -> list[str]:
    """``pid args`` of every live process in process group ``pgid`` or with ``temp`` in its arguments
    (Ray's processes name their session directory)."""
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,stat=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    return [f"{r[0]} {r[3]}"[:160] for r in rows if len(r) == 4 and not r[2].startswith("Z")
            and (r[1] == str(pgid) or str(temp) in r[3])]


def stop_group(proc: subprocess.Popen, temp: Path, timeout: float = 60.0) -> list[str]:
    """SIGTERM the group's leader (``ray start --block`` then stops its Ray processes), wait for the whole
    group and every process under ``temp`` to go, SIGKILL what is left; returns what was still running
    when the wait ended."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while (left := processes(proc.pid, temp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        for line in left:
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait(timeout=30)
    return left


@dataclass
class ScriptRun:
    """How a cluster script ended."""

    returncode: int | None
    """Its exit status; None when it ran past the timeout and was stopped."""
    out: str
    err: str
    left: list[str]
    """Processes still running after it ended, killed then."""


def run_cluster_script(script: Path, args: list[str], timeout: float, env: dict[str, str] | None = None) -> ScriptRun:
    """Run ``script ARGS TEMP`` in a process group of its own, with a private temporary directory (short: Ray's
    socket paths live under it) and auth token; stop the group when it ends or after ``timeout`` s."""
    temp = Path(tempfile.mkdtemp(prefix="rs-nodes-"))
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           **(env or {})}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, str(script), *args, str(temp)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc, temp, timeout=10)
            out, err = proc.communicate()
            return ScriptRun(None, out, err, [])
        left = stop_group(proc, temp, timeout=30)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return ScriptRun(proc.returncode, out, err, left)
