"""A real Ray cluster: ``ray start --head`` and ``ray job submit`` end to end, placement over several nodes,
and the example cluster files.

Each cluster here is private: the head runs on free ports with its own temporary directory and
token, as one process group that is stopped by signal (never ``ray stop``, which would stop every
Ray on the machine), and the multi-node run lives in a process of its own.
"""

from __future__ import annotations

import json
import math
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from ray_head import RayHead, run_cluster_script

from rayspec.config import from_mapping
from rayspec.models import build_model
from rayspec.training.prepare import prepare

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "cluster"
@pytest.fixture
def head() -> Iterator[RayHead]:
    h = RayHead()
    h.start()
    try:
        yield h
    finally:
        left = h.stop()
        assert not left, f"still running after the head was stopped: {left}"


def _submit(head: RayHead, submission_id: str, overrides: list[str], timeout: float = 60.0) -> tuple[
        subprocess.CompletedProcess, float]:
    """``examples/cluster/submit.sh`` against the head; retried while the dashboard has no agent yet."""
    env = {**head.env, "SUBMIT_OPTIONS": f"--submission-id {submission_id}"}
    t0 = time.monotonic()
    while True:
        try:
            res = subprocess.run([str(CLUSTER / "submit.sh"), head.address, *overrides], env=env,
                                 capture_output=True, text=True, timeout=600, cwd=ROOT)
        except subprocess.TimeoutExpired as err:
            logs = head.ray("job", "logs", submission_id, "--address", head.address)
            pytest.fail(f"the job did not end within 600 s:\n{err.stdout!r:.3000}\njob logs:\n{logs.stdout[-4000:]}")
        if res.returncode == 0 or "No available agent" not in res.stdout + res.stderr:
            return res, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return res, time.monotonic() - t0
        time.sleep(2)


@pytest.mark.slow
def test_job_submit_to_a_ray_start_head(head, tmp_path):
    """``ray start --head``, then ``submit.sh`` (``ray job submit --working-dir .``) runs a smoke training job on
    that cluster: SUCCEEDED, on the Ray executor, and the job's run directory holds the §4 files."""
    ready_s = head.wait_ready()
    run_dir = tmp_path / "run"
    job = f"rayspec-smoke-{secrets.token_hex(4)}"
    res, submit_s = _submit(head, job, ["debug=smoke", "pipeline.stages=2", f"hydra.run.dir={run_dir}"])
    out = res.stdout + res.stderr
    logs = head.ray("job", "logs", job, "--address", head.address)
    context = f"submit ({submit_s:.0f} s):\n{out[-4000:]}\njob logs:\n{logs.stdout[-4000:]}\n{logs.stderr[-2000:]}"
    assert res.returncode == 0, context
    info = json.loads(head.get(f"{head.address}/api/jobs/{job}"))
    assert info["status"] == "SUCCEEDED", f"{info}\n{context}"
    assert info["entrypoint"].startswith("python -m rayspec.train debug=smoke"), info
    assert "executor=ray" in logs.stdout and "step      4/4" in logs.stdout, context
    assert "Connecting to existing Ray cluster" in logs.stdout, context

    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["executor"], summary["stages"], summary["updates"]) == ("ray", 2, 4), summary
    assert math.isfinite(summary["final_train_loss"]), summary
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [2, 4]
    config = from_mapping(yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text()))
    model = build_model(config.model["name"], prepare(config).data.info, config.model["size"])
    model.load_state_dict(torch.load(run_dir / "model.pt"))

    # What --working-dir uploaded, as the head unpacked it: the checkout without .venv and caches.
    packages = list((head.temp / "session_latest" / "runtime_resources" / "working_dir_files").glob("_ray_pkg_*/"))
    assert len(packages) == 1, packages
    files = [p for p in packages[0].rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    assert (packages[0] / "rayspec" / "train.py").exists() and not (packages[0] / ".venv").exists()
    assert size < 8 * 2**20, f"uploaded {size / 2**20:.1f} MiB in {len(files)} files"
    print(f"head ready in {ready_s:.1f} s; job submitted and done in {submit_s:.1f} s; "
          f"uploaded {size / 2**20:.2f} MiB in {len(files)} files")


@pytest.mark.slow  # 30-45 s on 2 busy cores: with the job test, over what the default suite allows
def test_spread_puts_each_stage_on_its_own_node_with_the_same_numbers(tmp_path):
    """Three Ray nodes on this machine: ``placement=spread`` puts each stage actor on its own node, ``pack``
    keeps them on one node (each could hold all three), and both give the local executor's final weights
    and loss; the driver actor runs on the calling process's node."""
    out = run_cluster_script(Path(__file__).with_name("placement_run.py"), [str(tmp_path)], "multi-node run", 400)
    result = json.loads(out.strip().splitlines()[-1])
    spread, pack, nodes = result["placed"]["spread"], result["placed"]["pack"], result["nodes"]
    assert len(set(nodes)) == 3 and sorted(set(spread)) == sorted(nodes), result
    assert len(set(pack)) == 1 and pack[0] in nodes, result
    assert result["drivers"]["spread"] == result["drivers"]["pack"] == nodes[0], result  # the caller's node
    assert result["loss"]["spread"] == result["loss"]["pack"], result
    weights = {name: torch.load(tmp_path / name / "model.pt") for name in ("spread", "pack", "local")}
    for name in weights["local"]:
        assert torch.equal(weights["spread"][name], weights["pack"][name]), name
        torch.testing.assert_close(weights["spread"][name], weights["local"][name], rtol=1e-5, atol=1e-6)
    assert math.isclose(result["loss"]["spread"], result["loss"]["local"], rel_tol=1e-5), result


def _load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def test_ray_up_cluster_file():
    """``ray up examples/cluster/cluster.yaml``: a head and GPU workers that install rayspec and can take jobs."""
    c = _load("cluster.yaml")
    assert c["cluster_name"] and c["provider"]["type"] and c["max_workers"] >= 1
    assert c["head_node_type"] in c["available_node_types"]
    workers = [t for name, t in c["available_node_types"].items() if name != c["head_node_type"]]
    assert workers and all(t["max_workers"] >= 1 for t in workers)
    setup = " ".join(c["setup_commands"])
    assert "pip install" in setup and "rayspec" in setup
    for name in ("cluster.yaml", "rayjob.yaml"):  # the configs ship in the package: a plain install will do
        assert "pip install -e" not in (CLUSTER / name).read_text(), name
    assert any("ray start --head" in cmd and "--dashboard-host=0.0.0.0" in cmd for cmd in c["head_start_ray_commands"])
    assert any("ray start --address" in cmd for cmd in c["worker_start_ray_commands"])


def test_kuberay_rayjob_manifest():
    """``kubectl apply -f examples/cluster/rayjob.yaml``: a KubeRay RayJob whose entrypoint trains with rayspec."""
    job = _load("rayjob.yaml")
    assert job["apiVersion"].startswith("ray.io/") and job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["entrypoint"].startswith("python -m rayspec.train")
    assert "hydra.run.dir=" in spec["entrypoint"]
    cluster = spec["rayClusterSpec"]
    images = [c["image"] for c in cluster["headGroupSpec"]["template"]["spec"]["containers"]]
    for group in cluster["workerGroupSpecs"]:
        images += [c["image"] for c in group["template"]["spec"]["containers"]]
        assert group["replicas"] >= 1
    assert images and all(images)


def test_submit_script_usage():
    res = subprocess.run([str(CLUSTER / "submit.sh")], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "usage:" in res.stderr
