"""Lose a node under a running pipeline on a multi-node Ray cluster; print how the run went on.

``python tests/node_loss_run.py OUT_DIR SCENARIO TEMP_DIR`` starts its own Ray nodes on this machine
(``ray.cluster_utils.Cluster``: a head of no CPUs, where this process and its driver actor run, and three
worker nodes of 2 CPUs), trains a 2-stage gpipe run of ``STEPS`` updates with ``fault.max_restarts=2`` and its checkpoints in
``checkpoint.storage`` (a ``file://`` URI: a folder every node reaches), and removes a worker node after update ``LOSE_AFTER``:

- ``stage``: the node holding stage 1's bundle; the run restarts its stages on the nodes that remain;
- ``driver``: the node holding the driver actor (placed in bundle 0 of a placement group, as in a Tune trial);
  the caller starts a new driver actor, which resumes from the newest checkpoint in the storage;
- ``elastic``: three worker nodes of 1 CPU and a 3-stage run with ``fault.elastic=true``; the node holding stage 1's
  bundle goes and nothing replaces it, so only 2 stages fit: the run goes on with 2 stages, re-split from the
  newest checkpoint.

Then it trains the same run without a loss (``elastic``: on the local executor, 3 stages to the update the run went
on from, then resumed on 2 stages: the uninterrupted run re-split at the same update), and prints one JSON line (also
written to ``OUT_DIR/result.json``): the node removed, the run's restarts and layout changes, the seconds from the
loss to the failure seen and to the pipeline running again (the figures of a node-loss row of ``benchmarks.recovery``),
and whether the final weights equal the reference's (``equal``: bit for bit; ``max_diff``). ``tests/test_node_loss.py``
runs it in a process of its own.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import ray
import ray._common.utils
import ray._private.utils
import torch
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from rayspec.config import Config, from_mapping
from rayspec.config.compose import compose
from rayspec.training import run_training as train

# The cluster is private to the script: it records no address where a plain ray.init() would find it.
ray._private.utils.write_ray_address = lambda *args, **kwargs: None
ray._common.utils.reset_ray_address = lambda *args, **kwargs: None

WORKERS = 3
# The run must still be going when Ray sees the node gone (about 3 s after the loss here): 16 updates of this tiny
# model take about half a second, so the run is long and the loss early.
STEPS, EVERY, LOSE_AFTER = 400, 20, 40
NODE = {"object_store_memory": 80 * 1024 * 1024, "include_dashboard": False}
OVERRIDES = ["pipeline.method=gpipe", "pipeline.stages=2", "pipeline.cpus_per_stage=1", "pipeline.microbatches=2",
             "pipeline.placement=spread", "model.size=tiny", "data.train_size=512", "data.val_size=64",
             "train.batch_size=16", f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_every=0",
             f"checkpoint.every={EVERY}", "fault.max_restarts=2", "ray.log_to_driver=false"]
ELASTIC = ["pipeline.stages=3", "fault.elastic=true"]
"""The ``elastic`` scenario's changes: 3 stages of 1 CPU on three 1-CPU workers, so that a lost one leaves room for 2."""


class Stop(Exception):
    """Ends the reference run's first part, at the update the elastic run went on from."""


class StopAfter:
    def __init__(self, step: int) -> None:
        self.step = step

    def on_metrics(self, record: dict) -> None:
        if "loss" in record and record["step"] > self.step:
            raise Stop(record["step"])


class LoseNode:
    """Removes the node that ``find()`` names at the first loss record of update ``LOSE_AFTER`` or later."""

    def __init__(self, cluster: Cluster, find) -> None:
        self.cluster, self.find = cluster, find
        self.lost: str | None = None
        self.lost_at = 0.0

    def on_metrics(self, record: dict) -> None:
        if self.lost is None and "loss" in record and record["step"] >= LOSE_AFTER:
            node_id = self.find()
            node = next(n for n in self.cluster.list_all_nodes() if n.node_id == node_id)
            self.lost, self.lost_at = node_id, time.time()
            self.cluster.remove_node(node, allow_graceful=False)


def bundle_node(bundles: int, index: int) -> str:
    """The node of bundle ``index`` of the live placement group of ``bundles`` bundles."""
    for group in placement_group_table().values():
        if group["state"] == "CREATED" and len(group["bundles"]) == bundles:
            return group["bundles_to_node_id"][index]
    raise RuntimeError(f"no placement group of {bundles} bundles")


def main(out_dir: Path, scenario: str, temp: str) -> None:
    elastic = scenario == "elastic"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "temp_dir": temp, **NODE})
    try:
        for _ in range(WORKERS):
            cluster.add_node(wait=False, num_cpus=1 if elastic else 2, temp_dir=temp, **NODE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        storage = (out_dir / "storage").as_uri()
        overrides = OVERRIDES + (ELASTIC if elastic else [])
        config = from_mapping(compose([*overrides, f"checkpoint.storage={storage}"]))
        group, offset = None, 0
        if scenario == "driver":  # bundle 0: the driver actor; 1, 2: the stages
            group, offset = placement_group([{"CPU": 1}] * 3, strategy="SPREAD"), 1
            ray.get(group.ready())
            lose = LoseNode(cluster, lambda: bundle_node(3, 0))
        else:
            lose = LoseNode(cluster, lambda: bundle_node(config.pipeline.stages, 1))
        summary = train(config, out_dir / "lost", callbacks=[lose],
                        placement_group=group, bundle_offset=offset)
        if group is not None:
            remove_placement_group(group)
        changes = summary["layout_changes"]
        if elastic and changes:
            reference_dir = resplit_reference(from_mapping(compose(overrides)), changes[0]["update"],
                                              changes[0]["to_stages"], out_dir / "reference")
        else:
            reference_dir = out_dir / "reference"
            train(from_mapping(compose(overrides)), reference_dir)
        a = torch.load(out_dir / "lost" / "model.pt", weights_only=True)
        b = torch.load(reference_dir / "model.pt", weights_only=True)
        restarts = summary["restarts"]
        running = [r["failed_at"] + r["recovery_s"] for r in restarts if "recovery_s" in r]  # the last restart's
        result = json.dumps({
            "scenario": scenario, "lost": lose.lost, "restarts": restarts, "updates": summary["updates"],
            "steps": STEPS, "every": EVERY, "lose_after": LOSE_AFTER, "stages": summary["stages"], "layout_changes": changes,
            "seen_s": restarts[0]["failed_at"] - lose.lost_at if restarts else None,
            "running_again_s": running[-1] - lose.lost_at if running else None,
            "updates_redone": sum(r["lost_updates"] for r in restarts),
            "checkpoint": summary["checkpoint"], "equal": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "max_diff": max((a[k] - b[k]).abs().max().item() for k in a) if a.keys() == b.keys() else None,
            # gpipe on Ray against the local executor: equal to rounding (the tolerance of tests/test_resplit.py)
            "close": a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7) for k in a),
        }, default=str)
        (out_dir / "result.json").write_text(result)  # what the test reads: Ray may print after this line
        print(result)
    finally:
        ray.shutdown()
        cluster.shutdown()


def resplit_reference(config: Config, update: int, stages: int, run_dir: Path) -> Path:
    """The uninterrupted run re-split at ``update``, on the local executor: ``config``'s stages to ``update``, then
    resumed from that checkpoint on ``stages`` stages."""
    local = dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, executor="local"))
    try:
        train(local, run_dir, callbacks=[StopAfter(update)])
    except Stop:
        pass
    resumed = dataclasses.replace(local, pipeline=dataclasses.replace(local.pipeline, stages=stages),
                                  checkpoint=dataclasses.replace(local.checkpoint, resume="auto"))
    train(resumed, run_dir)
    return run_dir


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])  # OUT_DIR SCENARIO TEMP_DIR
