"""Lose a node under a running pipeline on a multi-node Ray cluster; print how the run went on.

``python tests/node_loss_run.py OUT_DIR SCENARIO TEMP_DIR`` starts its own Ray nodes on this machine
(``ray.cluster_utils.Cluster``: a head of no CPUs, where this process and its driver actor run, and three
worker nodes of 2 CPUs), trains a 2-stage gpipe run of ``STEPS`` updates with ``fault.max_restarts=2`` and its checkpoints in
``checkpoint.storage`` (a ``file://`` URI: a folder every node reaches), and removes a worker node after update ``LOSE_AFTER``:

- ``stage``: the node holding stage 1's bundle; the run restarts its stages on the nodes that remain;
- ``driver``: the node holding the driver actor (placed in bundle 0 of a placement group, as in a Tune trial);
  the caller starts a new driver actor, which resumes from the newest checkpoint in the storage.

Then it trains the same run without a loss, and prints one JSON line (also written to ``OUT_DIR/result.json``): the node removed, the run's restarts,
the seconds from the loss to the failure seen and to the pipeline running again (the figures of a node-loss row
of ``benchmarks.recovery``), and whether the final weights equal the uninterrupted run's. ``tests/test_node_loss.py`` runs it in a process of its own.
"""

from __future__ import annotations

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

from rayspec.config import from_mapping
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
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "temp_dir": temp, **NODE})
    try:
        for _ in range(WORKERS):
            cluster.add_node(wait=False, num_cpus=2, temp_dir=temp, **NODE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        storage = (out_dir / "storage").as_uri()
        config = from_mapping(compose([*OVERRIDES, f"checkpoint.storage={storage}"]))
        group, offset = None, 0
        if scenario == "driver":  # bundle 0: the driver actor; 1, 2: the stages
            group, offset = placement_group([{"CPU": 1}] * 3, strategy="SPREAD"), 1
            ray.get(group.ready())
            lose = LoseNode(cluster, lambda: bundle_node(3, 0))
        else:
            lose = LoseNode(cluster, lambda: bundle_node(2, 1))
        summary = train(config, out_dir / "lost", callbacks=[lose],
                        placement_group=group, bundle_offset=offset)
        if group is not None:
            remove_placement_group(group)
        reference = from_mapping(compose(OVERRIDES))
        train(reference, out_dir / "reference")
        a = torch.load(out_dir / "lost" / "model.pt", weights_only=True)
        b = torch.load(out_dir / "reference" / "model.pt", weights_only=True)
        restarts = summary["restarts"]
        running = [r["failed_at"] + r["recovery_s"] for r in restarts if "recovery_s" in r]  # the last restart's
        result = json.dumps({
            "scenario": scenario, "lost": lose.lost, "restarts": restarts, "updates": summary["updates"],
            "steps": STEPS, "every": EVERY,
            "seen_s": restarts[0]["failed_at"] - lose.lost_at if restarts else None,
            "running_again_s": running[-1] - lose.lost_at if running else None,
            "updates_redone": sum(r["lost_updates"] for r in restarts),
            "checkpoint": summary["checkpoint"], "equal": all(torch.equal(a[k], b[k]) for k in a),
        }, default=str)
        (out_dir / "result.json").write_text(result)  # what the test reads: Ray may print after this line
        print(result)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])  # OUT_DIR SCENARIO TEMP_DIR
