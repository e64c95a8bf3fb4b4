"""Node loss on a multi-node Ray cluster of this machine: ``tests/node_loss_run.py`` per scenario, in a process of
its own (``ray.cluster_utils.Cluster``: a head of no CPUs and three worker nodes), its figures as the node-loss
rows of ``benchmarks.recovery``.

Scenarios: ``stage`` (the node holding stage 1 of a 2-stage gpipe run goes; the bundle is placed again on a node
that remains), ``driver`` (the node holding the driver actor goes; a new driver actor resumes from
``checkpoint.storage``), ``elastic`` (3 stages on three 1-CPU nodes, ``fault.elastic=true``; stage 1's node goes and
nothing replaces it: the run goes on with 2 stages). The loss comes at the first loss record of update 40 or later
that reaches the calling process; 400 updates, a checkpoint every 20.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._shared.cluster_script import ROOT, run_cluster_script

SCRIPT = ROOT / "tests" / "node_loss_run.py"
SCENARIOS = ("stage", "driver", "elastic")


def node_loss(scenarios: Sequence[str] = SCENARIOS, timeout_s: float = 900.0) -> dict[str, dict[str, Any]]:
    """Per scenario: seconds from the loss to the failure seen and to the pipeline running again (and of those, the
    restarts' wait for the stage bundles), the updates redone, the restarts, the stage counts and whether the final
    weights equal the reference's."""
    rows: dict[str, dict[str, Any]] = {}
    for scenario in scenarios:
        with tempfile.TemporaryDirectory(prefix="rs-node-loss-") as tmp:
            run = run_cluster_script(SCRIPT, [tmp, scenario], timeout_s, env={"PYTHONPATH": str(ROOT)})
            if run.returncode != 0:
                raise RuntimeError(f"the node-loss run ({scenario}) failed ({run.returncode}):\n{run.err[-3000:]}")
            r = json.loads((Path(tmp) / "result.json").read_text())
        changes = r.get("layout_changes", [])
        rows[scenario] = {
            "seen_s": r["seen_s"], "running_again_s": r["running_again_s"], "updates_redone": r["updates_redone"],
            "restarts": len(r["restarts"]), "resumed_from": [x["resumed_from"] for x in r["restarts"]],
            # of the time to running again: waiting for Ray to declare the node gone and place its bundles again
            "placement_wait_s": sum(x.get("placement_wait_s", 0.0) for x in r["restarts"]),
            "stages": [changes[0]["from_stages"], r["stages"]] if changes else [r["stages"], r["stages"]],
            "updates": r["updates"], "lose_after": r.get("lose_after"), "checkpoint_every": r["every"],
            "equal": r["equal"], "close": r.get("close"), "max_diff": r.get("max_diff"),
        }
    return rows
