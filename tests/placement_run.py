"""Train one small config on a multi-node Ray cluster with each ``pipeline.placement``; print what ran where.

``python tests/placement_run.py OUT_DIR TEMP_DIR`` starts its own Ray nodes on this machine
(``ray.cluster_utils.Cluster``: a head and two worker nodes of 3 CPUs each, their files under
``TEMP_DIR``, which must be a short path: Ray's sockets live there), trains the
same 3-stage run with ``pipeline.placement=spread``, with ``pack`` and with the local executor
into ``OUT_DIR/<name>/``, and prints one JSON line: the node ids, the node of each stage
actor per placement, and each run's final loss. ``tests/test_cluster.py`` runs it in a process
of its own, apart from the test session's Ray.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
import ray._common.utils
import ray._private.utils
from ray.cluster_utils import Cluster

from rayspec.config import from_mapping
from rayspec.config.compose import compose
from rayspec.training import run_training

# Cluster records its address in the machine's default Ray directory (/tmp/ray), where any plain
# ray.init() on the machine would find and join it; this cluster is private to the script.
ray._private.utils.write_ray_address = lambda *args, **kwargs: None
ray._common.utils.reset_ray_address = lambda *args, **kwargs: None

NODES = 3
OVERRIDES = ["debug=smoke", "pipeline.stages=3", "pipeline.cpus_per_stage=1", "train.max_steps=6",
             "ray.log_to_driver=false"]
NODE = {"object_store_memory": 80 * 1024 * 1024, "include_dashboard": False}


def main(out_dir: Path, temp: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "temp_dir": temp, **NODE})
    try:
        nodes = [cluster.head_node.node_id]
        nodes += [cluster.add_node(wait=False, num_cpus=3, temp_dir=temp, **NODE).node_id for _ in range(NODES - 1)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        placed: dict[str, list[str]] = {}
        drivers: dict[str, str] = {}
        losses = {}
        for name, extra in (("spread", ["pipeline.placement=spread"]), ("pack", ["pipeline.placement=pack"]),
                            ("local", ["pipeline.executor=local"])):
            config = from_mapping(compose(OVERRIDES + extra))
            summary = run_training(config, out_dir / name)
            losses[name] = summary["final_train_loss"]
            if "stage_nodes" in summary:  # the Ray executor
                placed[name], drivers[name] = summary["stage_nodes"], summary["driver_node"]
        print(json.dumps({"nodes": nodes, "placed": placed, "drivers": drivers, "loss": losses}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
