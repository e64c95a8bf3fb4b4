"""A node lost under a running pipeline, on a multi-node Ray cluster of this machine (``tests/node_loss_run.py``,
in a process of its own, apart from the test session's Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ray_head import ROOT, run_cluster_script


def lose_a_node(scenario: str, out_dir: Path) -> dict:
    script = Path(__file__).with_name("node_loss_run.py")
    run_cluster_script(script, [str(out_dir), scenario], "node-loss run", 600, env={"PYTHONPATH": str(ROOT)})
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


@pytest.mark.slow  # minutes on 2 busy cores: four Ray nodes, a lost one, the run and its reference
def test_a_lost_node_that_is_not_replaced_leaves_an_elastic_run_on_fewer_stages_equal_to_the_resplit_run(tmp_path):
    """3 stages on three 1-CPU nodes with ``fault.elastic=true``; stage 1's node goes and nothing replaces it: the run
    goes on with the 2 stages that fit, re-split from the newest checkpoint, records it in ``layout_changes``, and
    ends with the weights of the uninterrupted run re-split onto 2 stages at the same update (gpipe, to rounding)."""
    result = lose_a_node("elastic", tmp_path)
    print(json.dumps({k: result[k] for k in ("scenario", "seen_s", "running_again_s", "updates_redone", "max_diff")}))
    assert result["lost"] is not None and result["updates"] == result["steps"] and result["stages"] == 2, result
    (change,) = result["layout_changes"]
    assert (change["from_stages"], change["to_stages"]) == (3, 2) and change["reason"].startswith("fault.elastic"), result
    assert change["update"] % result["every"] == 0 and 0 < change["update"] < result["steps"], result
    assert {r["kind"] for r in result["restarts"]} == {"stage"} and result["restarts"][-1]["resumed_from"] == change["update"]
    assert result["running_again_s"] is not None, result
    assert result["close"], result
