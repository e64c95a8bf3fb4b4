"""The time-to-accuracy projection (``benchmarks.time_to_accuracy.project``): its ``--quick`` run in this process writes
a results file of the documented shape to the scratch folder, and its replayed times respect each stage's own work.
The study's data is a small file in the Rotten Tomatoes file's format (``data.path``), so that the run needs no
installed data."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package lives at the repo root

from test_data import rt_rows, write_csv  # noqa: E402

from benchmarks._shared import results  # noqa: E402
from benchmarks.time_to_accuracy import project  # noqa: E402

SYNCHRONOUS = ("vanilla", "gpipe", "1f1b", "zb1p", "interleaved")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The ``--quick`` projection's JSON, written to a scratch folder; the committed results stay as they were."""
    scratch = tmp_path_factory.mktemp("quick")
    before = {p: p.stat().st_mtime_ns for p in results.RESULTS.rglob("*") if p.is_file()}
    reviews = write_csv(scratch / "rt.csv.bz2", rt_rows(movies=200, seed=3))
    saved, results.QUICK_RESULTS = results.QUICK_RESULTS, scratch
    threads = torch.get_num_threads()
    try:
        project.main(["--quick", "--set", f"data.path={reviews}"])
    finally:
        results.QUICK_RESULTS = saved
    assert {p: p.stat().st_mtime_ns for p in results.RESULTS.rglob("*") if p.is_file()} == before
    assert torch.get_num_threads() == threads  # later tests compare runs bit for bit with runs in other processes
    return json.loads((scratch / f"{project.NAME}.json").read_text())


def test_quick_projection_has_its_parts(quick):
    assert quick["projection"] is True and quick["left_out"] and quick["dataparallel_model"]
    assert set(quick["links"]) == {"none", "measured_cpu_hop", "assumed_link"}
    n2 = quick["stages"]["2"]
    assert set(n2["measured"]) == set(project.PROJECTED)
    for name, measured in n2["measured"].items():
        assert measured["costs"], name
        assert all(v >= 0 for v in measured["costs"].values()), name
        assert set(n2["per_update"][name]) == set(quick["links"])
    acc = n2["accuracy"]
    assert 0.5 < acc["baseline_score"] < 1
    assert acc["methods"]["spectrain-acc4"] == {"curves": "not measured"}  # --quick trains nothing
    assert set(acc["methods"]["gpipe"]) == {"curves", "0.95", "0.99"}
    block = n2["time_to_target"]["assumed_link 0.95"]
    assert block["winner"] in project.PROJECTED
    assert block["methods"][block["winner"]]["ratio"] == pytest.approx(1.0)


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_time_per_update_is_at_least_one_stages_work(quick, name):
    """No schedule can update faster than its busiest rank computes one update's micro-batches and step; a link
    only adds."""
    speed = quick["stages"]["2"]["per_update"][name]
    for link, figures in speed.items():
        assert figures["seconds"] >= figures["stage_work"] * (1 - 1e-9) > 0, link
    assert speed["measured_cpu_hop"]["seconds"] >= speed["none"]["seconds"]
    # the least disturbed costs are each at most the median ones, and a timeline only grows with its durations
    assert all(f["least_disturbed"] <= f["seconds"] * (1 + 1e-9) for f in speed.values())


def test_dataparallel_adds_the_all_reduce():
    measured = {"costs": {"0 F": 1.0, "0 B": 2.0}, "param_bytes": 1000}
    figures = project.per_update("dataparallel", 4, measured, (0.5, 0.001))
    assert figures["all_reduce"] == pytest.approx(2 * 3 * (0.5 + 1000 / 4 * 0.001))
    assert figures["seconds"] == pytest.approx(3.0 + figures["all_reduce"])
