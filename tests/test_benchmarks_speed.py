"""Smoke tests of the speed figures' helpers: ``benchmarks.stage_cost``'s roofline and ``benchmarks.peer``'s
crossover, at the tiny model's size (the numbers are sane, not fast)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package lives at the repo root

from benchmarks._shared import peer_setup  # noqa: E402
from benchmarks.peer import crossover  # noqa: E402
from benchmarks.stage_cost import roofline  # noqa: E402

TINY = peer_setup.PeerConfig(model="mlp", size="tiny", batch=16, microbatches=4, pool=2)


def test_passes_count_a_prediction_per_version_and_the_minimum():
    assert roofline.passes("sgd", 8, 0, False) == (5 / 8, 5 / 8)  # a flushed step: its own minimum
    assert roofline.passes("sgd", 1, 1, False) == (8, 6)  # step, then one prediction
    assert roofline.passes("sgd", 1, 1, True) == (6, 6)
    assert roofline.passes("adamw", 1, 1, False) == (23, 8)  # the direction in full, a scaled prediction
    assert roofline.passes("adamw", 1, 1, True) == (8, 8)


def test_roofline_rows_against_copy():
    rows, levers = roofline.measure([(512, 256), (512,)], repeats=2)
    assert rows[0]["update"] == "copy_" and rows[0]["of_copy"] == 1.0
    assert {(r["optimizer"], r["update"]) for r in rows[1:]} == {
        (o, u) for o in ("sgd", "adamw")
        for u in ("step (torch fused)", "step, then prediction", "step + prediction, compiled")}
    assert all(r["GBps"] > 0 for r in rows)
    assert levers["params"] == 512 * 256 + 512 and levers["compiled_sgd"] and levers["compiled_adamw"]


def test_crossover_predicts_a_ratio_per_size_and_the_median_spread():
    parts, _ = peer_setup.build_parts(TINY)
    costs = crossover.update_costs(parts, TINY, compiled=False, repeats=2)
    assert set(costs) == {0, 1} and all(c["update"] > 0 and c["step"] > 0 for c in costs.values())
    rows = crossover.predict(parts, TINY, [2, 8], costs, hop_s=lambda shape: 1e-4)
    assert [r["microbatch_size"] for r in rows] == [2, 8] and all(r["predicted_ratio"] > 0 for r in rows)
    assert crossover.crossover([{"microbatch_size": 4, "predicted_ratio": 0.9},
                                {"microbatch_size": 8, "predicted_ratio": 1.1},
                                {"microbatch_size": 16, "predicted_ratio": 1.2}]) == 8
    assert crossover.crossover([{"microbatch_size": 4, "predicted_ratio": 0.9}]) is None
    assert crossover.median_spread([1.0]) == 0.0
    assert 0.0 < crossover.median_spread([0.9, 1.0, 1.1, 0.95, 1.05]) < 0.11
