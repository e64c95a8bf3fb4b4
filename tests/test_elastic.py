"""``fault.elastic`` without a cluster: its settings, the layout it goes on with, and the re-split reference it must
equal (a lost node itself: ``tests/test_node_loss.py``, slow)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import Stop, StopAfter
from test_resplit import settings as resplit_settings

from rayspec.config import ConfigError, from_mapping
from rayspec.core.schedule import build_schedule
from rayspec.core.schedule_text import to_csv
from rayspec.training import RunFailed, run_training
from rayspec.training.context import RunContext
from rayspec.training.elastic import MIN_STAGES, shrunk
from rayspec.training.prepare import prepare
from rayspec.training.summary import RunSummary


def settings(method: str = "gpipe", stages: int = 3, **pipeline) -> dict:
    """The re-split tests' run (7 blocks, a checkpoint every 4 updates), restarted once, elastically."""
    return {**resplit_settings(method, stages, **pipeline), "fault": {"max_restarts": 1, "elastic": True}}


def test_elastic_settings_are_checked():
    cfg = settings()
    assert from_mapping(cfg).validate().fault.elastic is True
    with pytest.raises(ConfigError, match=r"fault\.elastic='yes' must be true or false"):
        from_mapping(cfg | {"fault": {"max_restarts": 1, "elastic": "yes"}}).validate()
    with pytest.raises(ConfigError, match=r"fault\.max_restarts=0 allows none; set fault\.max_restarts to 1 or more"):
        from_mapping(cfg | {"fault": {"elastic": True}}).validate()


def test_elastic_refuses_a_schedule_file_which_fixes_the_stage_count(tmp_path):
    schedule = tmp_path / "1f1b.csv"
    schedule.write_text(to_csv(build_schedule("1f1b-flushed", 2, 2)))
    cfg = settings("1f1b", 2, microbatches=2, schedule_file=str(schedule))
    with pytest.raises(ConfigError, match=r"fault\.elastic=true may change the stage count, but pipeline\.schedule_file"):
        from_mapping(cfg).validate()


def context(cfg: dict, tmp_path: Path) -> RunContext:
    return RunContext.create(prepare(from_mapping(cfg), tmp_path), tmp_path)


def test_fewer_stages_take_a_partition_chosen_again_and_keep_every_other_setting(tmp_path):
    ctx = context(settings(balance=[3, 2, 2]), tmp_path)
    two = shrunk(ctx, 2)
    assert two.config.pipeline.stages == 2 and two.config.pipeline.balance is None and two.balance == [4, 3]
    assert two.plan is not None and two.plan.balance == [4, 3]
    assert two.config.optim == ctx.config.optim and two.config.train == ctx.config.train
    assert ctx.prepared.balance == [3, 2, 2]  # the run's own prepared pieces are not changed here
    assert MIN_STAGES == 2


def test_a_stage_count_the_settings_do_not_allow_fails_the_run_naming_the_setting(tmp_path):
    cfg = settings("interleaved", 3, microbatches=3)
    cfg["train"]["batch_size"] = 18
    ctx = context(cfg, tmp_path)
    with pytest.raises(RunFailed, match=r"fault\.elastic cannot go on with 2 stages: .*pipeline\.microbatches=3"):
        shrunk(ctx, 2)


def test_the_resplit_reference_equals_the_uninterrupted_run(tmp_path):
    """What an elastic gpipe run is compared with (3 stages to update 8, then 2 stages from that checkpoint, as
    ``tests/node_loss_run.py`` builds it) is the uninterrupted run to rounding: going on with fewer stages changes
    no weight, and the change is recorded."""
    cfg = settings()
    full = run_training(from_mapping(cfg), tmp_path / "full")
    with pytest.raises(Stop):
        run_training(from_mapping(cfg), tmp_path / "resplit", callbacks=[StopAfter(9)])
    two = copy.deepcopy(cfg)
    two["pipeline"]["stages"], two["checkpoint"]["resume"] = 2, "auto"
    summary = run_training(from_mapping(two), tmp_path / "resplit")
    a = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "resplit" / "model.pt", weights_only=True)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-7, msg=k)
    (change,) = summary["layout_changes"]
    assert {k: change[k] for k in ("update", "from_stages", "to_stages", "from", "to")} == {
        "update": 8, "from_stages": 3, "to_stages": 2, "from": [3, 2, 2], "to": [4, 3]}
    assert full["layout_changes"] == [] and summary["stages"] == 2
    typed = RunSummary.read(tmp_path / "resplit")  # a typed field, in the file's place: after resumed_from
    assert typed.layout_changes == summary["layout_changes"] and RunSummary.read(tmp_path / "full").layout_changes == []
    keys = list(typed.to_dict())
    assert keys.index("layout_changes") == keys.index("resumed_from") + 1 and keys == list(summary)


def test_the_bundles_of_a_whole_group_are_confirmed_and_the_capacity_counts_live_nodes(ray_session):
    """On one live node: every bundle of a placed group answers; the node's 2 CPUs hold two 1-CPU bundles, four of
    half a CPU, none of 3 CPUs (a lost node: ``tests/test_node_loss.py``)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from rayspec.exec.ray.cluster import bundle_capacity, placed_bundles, wait_for_bundles

    group = placement_group([{"CPU": 0.5}] * 2)
    try:
        assert wait_for_bundles(group, [0, 1], timeout_s=60) == [0, 1]
        assert placed_bundles(group, [0, 1]) == [0, 1]
    finally:
        remove_placement_group(group)
    assert placed_bundles(group, [0, 1]) == []  # a removed group holds none
    assert (bundle_capacity({"CPU": 1.0}), bundle_capacity({"CPU": 0.5}), bundle_capacity({"CPU": 3.0})) == (2, 4, 0)
    assert bundle_capacity({"CPU": 1.0, "GPU": 1.0}) == 0  # no GPU here
