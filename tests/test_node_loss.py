"""A node lost under a running pipeline, on a multi-node Ray cluster of this machine (``tests/node_loss_run.py``,
in a process of its own, apart from the test session's Ray)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from ray_head import stop_group

ROOT = Path(__file__).resolve().parents[1]


def lose_a_node(scenario: str, out_dir: Path) -> dict:
    temp = Path(tempfile.mkdtemp(prefix="rs-loss-"))  # short: Ray's socket paths live under it
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    script = Path(__file__).with_name("node_loss_run.py")
    proc = subprocess.Popen([sys.executable, str(script), str(out_dir), str(temp), scenario], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            stop_group(proc, temp, timeout=10)
            out, err = proc.communicate()
            pytest.fail(f"the node-loss run did not end within 600 s:\n{err[-4000:]}")
        left = stop_group(proc, temp, timeout=30)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 0, err[-4000:]
    assert not left, f"still running after the node-loss run: {left}"
    return json.loads((out_dir / "result.json").read_text())  # stdout may hold Ray's lines after the result


@pytest.mark.slow  # minutes on 2 busy cores: four Ray nodes, a lost one, two runs
@pytest.mark.parametrize("scenario", ["stage", "driver"])
def test_a_lost_node_is_survived_with_restarts_and_the_weights_are_the_uninterrupted_runs(tmp_path, scenario):
    """The node holding stage 1 (``stage``) or the driver actor (``driver``) is removed after update ``LOSE_AFTER``: with
    ``fault.max_restarts`` the run restarts from the newest checkpoint in ``checkpoint.storage`` on the nodes
    that remain and ends with the weights of a run that lost nothing (gpipe: synchronous, exact resume)."""
    result = lose_a_node(scenario, tmp_path)
    print(json.dumps({k: result[k] for k in ("scenario", "seen_s", "running_again_s", "updates_redone")}))  # -s
    assert result["lost"] is not None and result["updates"] == result["steps"], result
    restarts = result["restarts"]
    # One restart, or two where a new driver actor was placed on the lost node before Ray declared it dead.
    assert len(restarts) in (1, 2) and {r["kind"] for r in restarts} == {scenario}, result
    assert all(r["resumed_from"] % result["every"] == 0 and 0 < r["resumed_from"] < result["steps"] for r in restarts), result
    assert result["running_again_s"] is not None, result
    assert result["checkpoint"].startswith((tmp_path / "storage").as_uri()), result
    assert result["equal"], result
