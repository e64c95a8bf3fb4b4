"""The study protocol's statistics and tables (rayspec/cli/study_stats.py, study_tables.py) on records made by hand."""

from __future__ import annotations

import math
import statistics

import pytest

from rayspec.cli.study_config import BASELINE, Study, run_name
from rayspec.cli.study_report import _entry, _paper_lines, cells
from rayspec.cli.study_stats import collapsed, diverged_at, interval, paired, score, t_quantile, updates_to
from rayspec.cli.study_tables import identical_groups, protocol_cells, protocol_lines, sweep_lines, sweep_rows


def record(label, seed, accs, stages=1, losses=None, status="ok"):
    """A run record as study_run writes it: val rows [update, loss, accuracy] every 100 updates."""
    ref = None if label == BASELINE else run_name(BASELINE, 1, seed)
    return {"label": label, "stages": stages, "seed": seed, "reference": ref, "status": status, "lr": 0.1,
            "curves": {"val": [[100 * (i + 1), 1.0, a] for i, a in enumerate(accs)],
                       "loss": losses or [[10, 2.3], [20, 1.0]]}}


def study(methods=("gpipe", "async", "pipedream"), seeds=(0, 1, 2)):
    return Study(name="s", overrides=[], methods=list(methods), stages=[4], seeds=list(seeds))


def test_score_is_the_mean_of_the_last_three_evaluations():
    assert score(record(BASELINE, 0, [0.1, 0.5, 0.6, 0.7])) == pytest.approx(0.6)
    assert score(record(BASELINE, 0, [0.4, 0.6])) == pytest.approx(0.5)  # fewer evaluations: all of them
    assert score(record(BASELINE, 0, [0.4], status="diverged")) is None
    assert score(record(BASELINE, 0, [0.4, math.nan])) is None


def test_divergence_rule():
    assert diverged_at([[10, 2.3], [20, 6.8], [30, 1.0]]) is None  # below 3x the first logged loss
    assert diverged_at([[10, 2.3], [20, 7.0]]) == (20, 7.0)
    assert diverged_at([[10, 2.3], [20, 2.6e10]]) == (20, 2.6e10)  # huge but finite: diverged all the same
    step, loss = diverged_at([[10, 2.3], [20, math.nan]])
    assert step == 20 and math.isnan(loss)
    assert diverged_at([[10, 2.3], [20, math.inf]]) == (20, math.inf)
    assert diverged_at([]) is None


def test_t_interval():
    assert t_quantile(4) == 2.776 and t_quantile(150) == 1.960 and t_quantile(35) == 2.042
    values = [0.01, 0.02, 0.0, 0.03, 0.015]
    low, high = interval(values)
    half = 2.776 * statistics.stdev(values) / math.sqrt(5)
    assert (low, high) == pytest.approx((statistics.fmean(values) - half, statistics.fmean(values) + half))
    assert interval([0.5]) is None


def test_paired_differences_and_updates_to_target():
    base = {run_name(BASELINE, 1, s): record(BASELINE, s, [0.5, 0.8, 0.9, 0.9]) for s in (0, 1)}
    runs = [record("async", 0, [0.5, 0.7, 0.8, 0.8], 4), record("async", 1, [0.5, 0.8], 4, status="diverged")]
    assert paired(runs, base) == pytest.approx([-0.1])  # the diverged seed has no score: no pair
    assert updates_to(base[run_name(BASELINE, 1, 0)]["curves"]["val"], 0.85) == 300
    assert updates_to(runs[0]["curves"]["val"], 0.85) is None


def records_for(st, spec):
    """Records of every seed: ``spec[label] = (accs per seed, status per seed)``."""
    out = {}
    for label, (accs, statuses) in spec.items():
        for seed in st.seeds:
            stages = 1 if label == BASELINE else 4
            out[run_name(label, stages, seed)] = record(label, seed, accs[seed], stages, status=statuses[seed])
    return out


def test_cells_count_diverged_runs_apart_and_merge_identical_methods():
    st = study()
    ok = ["ok"] * 3
    recs = records_for(st, {
        BASELINE: ([[0.8, 0.9, 0.9], [0.8, 0.88, 0.9], [0.8, 0.9, 0.92]], ok),
        "gpipe": ([[0.8, 0.9, 0.91], [0.8, 0.88, 0.9], [0.8, 0.9, 0.91]], ok),
        "async": ([[0.5, 0.6, 0.7], [0.1, 0.1, 0.1], [0.5, 0.6, 0.6]], ["ok", "diverged", "ok"]),
        "pipedream": ([[0.5, 0.6, 0.7], [0.1, 0.1, 0.1], [0.5, 0.6, 0.6]], ["ok", "diverged", "ok"]),
    })
    cells = protocol_cells(st, recs)
    a = cells["async", 4]
    assert (a["runs"], a["scored"], a["diverged"], a["pairs"]) == (3, 2, 1, 2)
    assert a["score"] == pytest.approx(statistics.fmean([0.6, 0.5666667]), abs=1e-6)  # the diverged run left out
    g = cells["gpipe", 4]
    deltas = [0.01 / 3, 0.0, -0.01 / 3]
    assert g["delta"] == pytest.approx(statistics.fmean(deltas))
    assert g["delta_ci"] == pytest.approx(interval(deltas))
    assert identical_groups(st, recs, 4) == [["gpipe"], ["async", "pipedream"]]
    text = "\n".join(protocol_lines(st, recs))
    assert "| `async` = `pipedream` |" in text and "1 of 3 |" in text and "Merged: async = pipedream at N=4" in text
    assert text.index("`gpipe` (noise floor)") < text.index("`async` = `pipedream`")
    target = 0.95 * cells[BASELINE, 4]["score"]
    assert g["target"] == pytest.approx(target) and a["not_reached"] == 2 and g["updates_to_target"] == [200, 200, 200]


def test_runs_that_differ_in_one_seed_are_not_merged():
    st = study(("async", "pipedream"))
    same = [[0.5, 0.6, 0.7]] * 3
    recs = records_for(st, {BASELINE: (same, ["ok"] * 3), "async": (same, ["ok"] * 3),
                            "pipedream": ([*same[:2], [0.5, 0.6, 0.71]], ["ok"] * 3)})
    assert identical_groups(st, recs, 4) == [["async"], ["pipedream"]]


def test_runs_that_end_at_a_constant_prediction_are_counted_as_collapsed_and_left_out():
    """A run at chance (always the most frequent class) whose loss never passed 3x its first is not diverged: it
    collapsed, and is counted so, never averaged in."""
    chance = 0.1
    assert collapsed(record("async", 0, [0.3, 0.1, 0.1, 0.1], 4), chance)
    assert collapsed(record("async", 0, [0.1, 0.105, 0.11], 4), chance)  # within one point
    assert not collapsed(record("async", 0, [0.5, 0.6, 0.7], 4), chance)
    assert not collapsed(record("async", 0, [0.1, 0.1, 0.1], 4), None)  # chance unknown: nothing collapsed
    assert not collapsed(record("async", 0, [0.1, 0.1], 4, status="diverged"), chance)  # diverged, not collapsed
    st = study(("async",))
    ok = ["ok"] * 3
    recs = records_for(st, {BASELINE: ([[0.8, 0.9, 0.9]] * 3, ok),
                            "async": ([[0.8, 0.9, 0.88], [0.3, 0.1, 0.1, 0.1], [0.8, 0.85, 0.86]], ok)})
    a = protocol_cells(st, recs, chance)["async", 4]
    assert (a["runs"], a["scored"], a["collapsed"], a["diverged"], a["pairs"]) == (3, 2, 1, 0, 2)
    assert a["score"] == pytest.approx(statistics.fmean([(0.8 + 0.9 + 0.88) / 3, (0.8 + 0.85 + 0.86) / 3]))
    assert a["not_reached"] == 1  # the collapsed run is counted among the runs that never reached the target
    text = "\n".join(protocol_lines(st, recs, chance))
    assert "| diverged | collapsed |" in text and "| 0 of 3 | 1 of 3 |" in text and "(10.0 %)" in text
    assert "collapsed" not in "\n".join(protocol_lines(st, recs))  # without a chance level: the old table


def test_the_rate_sweep_marks_collapsed_runs_and_keeps_them_in_the_mean():
    st = Study(name="s", overrides=[], methods=["async"], stages=[4], seeds=[0, 1],
               lr_sweep={"stages": 4, "seeds": [0, 1], "factors": [1, 3]})
    recs = {}
    for seed in (0, 1):
        recs[run_name(BASELINE, 1, seed)] = record(BASELINE, seed, [0.9])
        recs[run_name(BASELINE, 1, seed, 0.03)] = record(BASELINE, seed, [0.8])  # 3x the default rate
        recs[run_name("async", 4, seed)] = record("async", seed, [0.85], 4)
        recs[run_name("async", 4, seed, 0.03)] = record("async", seed, [0.1 if seed else 0.7], 4)
    rows = {(r["label"], r["factor"]): r for r in sweep_rows(st, recs, 0.1)}
    assert rows["async", 3]["collapsed"] == 1 and rows["async", 3]["score"] == pytest.approx(0.4)
    assert "| `async` | 85.00 | 40.00 (1 c) |" in "\n".join(sweep_lines(st, list(rows.values())))


def test_the_final_figures_table_counts_collapsed_runs():
    """The report's older table (the last evaluation's figures of every run that did not diverge) says how many of
    its runs collapsed, which the protocol's table leaves out."""
    st = study(("async",))
    ok = ["ok"] * 3
    recs = records_for(st, {BASELINE: ([[0.8, 0.9, 0.9]] * 3, ok),
                            "async": ([[0.8, 0.9, 0.88], [0.3, 0.1, 0.1, 0.1], [0.8, 0.85, 0.86]], ok)})
    for r in recs.values():
        r["final"] = {"val_accuracy": r["curves"]["val"][-1][2], "val_loss": 1.0}
    a = {(c["label"], c["stages"]): c for c in cells(st, recs, chance=0.1)}["async", 4]
    assert (a["runs"], a["ok"], a["collapsed"], a["diverged"]) == (3, 3, 1, 0)
    assert a["val_accuracy"] == pytest.approx((0.88 + 0.1 + 0.86) / 3)
    assert _entry(a, "val_accuracy", 100.0).endswith("(1/3 collapsed, in the mean)")
    row = _paper_lines(st, {("async", 4): a, (BASELINE, 4): {**a, "collapsed": 0}}, {"model": {"name": "m"}}, "tiny")
    assert "| m tiny | 61.3 ± 44.5 | 61.3 ± 44.5† |" in "\n".join(row) and row[-1].startswith("† averages runs that collapsed")
    unknown = {(c["label"], c["stages"]): c for c in cells(st, recs)}["async", 4]  # chance unknown
    assert unknown["collapsed"] == 0 and "collapsed" not in _entry(unknown, "val_accuracy", 100.0)


def test_the_selection_rules_pick_the_cheapest_setting_near_the_best_or_past_a_floor():
    from benchmarks.studies.select import choose

    def rows(value, scores, cpu, status="ok"):
        return [{"value": value, "score": s, "cpu_seconds": cpu, "status": status} for s in scores]

    probes = (rows("w8", [0.905, 0.911], 41) + rows("w12", [0.909, 0.913], 50) + rows("w16", [0.910, 0.914], 80)
              + rows("w24", [0.95, 0.1], 90, status="diverged"))
    assert choose(probes, "budget") == "w8"  # within 0.5 point of the best (w16's 91.2 %), and the cheapest
    assert choose(probes, "budget", min_score=0.91) == "w12"  # w8's mean, 90.8 %, is under the floor
    assert choose(probes, "budget", min_score=0.92) is None  # none reaches it; the diverged setting never counts
    assert choose(rows("lr=0.1", [0.9], 1) + rows("lr=0.05", [0.905], 1), "rate") == "lr=0.1"  # the largest rate
