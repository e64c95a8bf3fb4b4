"""Starting or joining Ray (rayspec/exec/ray/connect.py, [Note: Ray address]): a default run starts a fresh
local Ray whatever head ``ray start`` recorded, joins ``RAY_ADDRESS`` when set, and ``auto`` or an explicit
address fails within a bounded time, with a clear error, when the head is gone.

The dead head here is a private ``ray start --head`` whose temporary directory is the ``RAY_TMPDIR`` of the
processes under test only; the machine's ``/tmp/ray`` is never touched.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from ray_head import RayHead, processes

from rayspec.config import ConfigError, RayConfig
from rayspec.exec.ray.connect import recorded_address_file, resolve_address, wait_for_head


def test_which_address_is_joined(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert recorded_address_file() == tmp_path / "ray" / "ray_current_cluster"
    assert resolve_address(None)[0] is None and resolve_address("local")[0] is None
    assert resolve_address("auto")[0] == "auto"  # nothing recorded: Ray's own search of this machine
    recorded_address_file().parent.mkdir()
    recorded_address_file().write_text("10.0.0.1:6379\n")
    assert resolve_address(None) == (None, "ray.address=null and RAY_ADDRESS is not set")  # never the recorded head
    assert resolve_address("auto")[0] == "10.0.0.1:6379"
    assert resolve_address("10.0.0.3:1234") == ("10.0.0.3:1234", "ray.address=10.0.0.3:1234")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")  # inside a Ray job
    assert resolve_address(None)[0] == "10.0.0.2:6379" and resolve_address("auto")[0] == "10.0.0.2:6379"
    assert resolve_address("local")[0] is None


def test_a_closed_port_fails_at_once_and_names_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"no Ray head answers at 127.0.0.1:{port} \(here\) within 1 s: .*refused"):
        wait_for_head(f"127.0.0.1:{port}", "here", 1.0)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ConfigError, match="ray.connect_timeout_s=0 must be a positive number"):
        RayConfig(connect_timeout_s=0).check()


def _log_time(line: str) -> datetime:
    """The time of a Hydra log line ``[2026-01-01 12:00:00,123][name][INFO] - ...``."""
    stamp = re.match(r"\[([\d-]+ [\d:]+,\d+)\]", line)
    assert stamp, line
    return datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")


@pytest.mark.slow  # a head to start and kill, a Ray run and a failing one: about a minute on 2 busy cores
def test_a_dead_recorded_head_neither_hangs_a_default_run_nor_waits_without_bound(tmp_path):
    head = RayHead(num_cpus=1, as_default=True)
    head.start()
    try:
        recorded = head.ray_temp / "ray_current_cluster"
        deadline = time.monotonic() + 180
        while not recorded.exists() and time.monotonic() < deadline:
            assert head.proc is not None and head.proc.poll() is None, head.tail()
            time.sleep(0.5)
        assert recorded.exists(), head.tail()
        address = recorded.read_text().strip()
        assert head.proc is not None
        for line in processes(head.proc.pid, head.temp):  # a crash: no `ray stop`, the record stays
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        while processes(head.proc.pid, head.temp) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not processes(head.proc.pid, head.temp) and recorded.read_text().strip() == address
        env = {k: v for k, v in head.env.items() if not k.startswith("RAY_AUTH")}
        command = [sys.executable, "-m", "rayspec.train", "debug=smoke", "pipeline.stages=2",
                   "pipeline.cpus_per_stage=0.5"]
        default = subprocess.run([*command, "ray.num_cpus=2", f"hydra.run.dir={tmp_path / 'default'}"], env=env,
                                 capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert default.returncode == 0, default.stderr[-3000:]
        lines = default.stdout.splitlines() + default.stderr.splitlines()
        begun = next(line for line in lines if "] - rayspec: spectrain" in line)
        started = next(line for line in lines if "Ray: started a local instance with 2 CPUs" in line)
        assert (_log_time(started) - _log_time(begun)).total_seconds() < 60, started
        assert (tmp_path / "default" / "summary.json").exists()
        t0 = time.monotonic()
        auto = subprocess.run([*command, "ray.address=auto", "ray.connect_timeout_s=3",
                               f"hydra.run.dir={tmp_path / 'auto'}"], env=env, capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
        assert auto.returncode == 2, auto.stderr[-3000:]
        assert f"error: no Ray head answers at {address} (ray.address=auto: the head that `ray start` recorded in " \
               f"{recorded}) within 3 s" in auto.stderr
        assert "Traceback" not in auto.stderr and time.monotonic() - t0 < 90
    finally:
        left = head.stop()
    assert not left, left
    assert not Path(head.temp).exists()
