"""Schedules as data: validity, version simulation, SpecTrain's s, the grid and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rayspec.core.schedule import Action, Schedule, ScheduleError, build_schedule
from rayspec.errors import ConfigError


@pytest.mark.parametrize("name", ["vanilla", "gpipe", "1f1b"])
def test_valid_for_all_sizes(name):
    for n in range(1, 9):
        for m in range(1, 17):
            groups = [d for d in range(1, m + 1) if m % d == 0] if name == "gpipe" else [1]
            for g in groups:
                sch = build_schedule(name, n, m, group=g)
                sch.validate()
                assert all(len(acts) == 2 * m for acts in sch.actions)
                assert len(sch.order()) == 2 * n * m
                assert sch.updates == m // g


@pytest.mark.parametrize("n", range(2, 9))
def test_1f1b_closed_forms(n):
    m_total = 4 * n + 4
    sch = build_schedule("1f1b", n, m_total)
    held = sch.versions()
    paper, consistent = sch.version_differences("paper"), sch.version_differences("consistent")
    for k in range(n):
        for m in range(n, m_total - n):  # steady state (DESIGN §2)
            assert held[(k, "F", m)] == m - (n - k - 1)
            assert held[(k, "B", m)] == m
            assert paper[(k, "F", m)] == k // 2 + n - k - 1
            assert paper[(k, "B", m)] == k // 2
            assert consistent[(k, "F", m)] == n - k - 1
            assert consistent[(k, "B", m)] == 0


def test_fill_predicts_less_than_closed_form():
    """While the pipeline fills, fewer updates lie ahead: the simulation says so (DESIGN §2)."""
    sch = build_schedule("1f1b", 4, 12)
    s = sch.version_differences("consistent")
    assert [s[(0, "F", m)] for m in range(4)] == [0, 1, 2, 3]


def test_design_worked_example():
    sch = build_schedule("1f1b", 4, 16)
    held, paper, cons = sch.versions(), sch.version_differences("paper"), sch.version_differences("consistent")
    table = [(2, 5, 3, 0, 3), (3, 5, 2, 0, 2), (4, 5, 2, 1, 1), (5, 5, 1, 1, 0)]
    for k, (vf, vb, pf, pb, cf) in enumerate(table):
        assert (held[(k, "F", 5)], held[(k, "B", 5)]) == (vf, vb)
        assert (paper[(k, "F", 5)], paper[(k, "B", 5)], cons[(k, "F", 5)]) == (pf, pb, cf)


@pytest.mark.parametrize("name,group", [("vanilla", 1), ("gpipe", 4), ("gpipe", 16)])
@pytest.mark.parametrize("variant", ["paper", "consistent"])
def test_synchronous_schedules_have_no_staleness(name, group, variant):
    for n in range(1, 9):
        sch = build_schedule(name, n, 16, group=group)
        assert sch.is_synchronous()
        assert set(sch.version_differences(variant).values()) == {0}


def test_gpipe_updates_after_each_flush():
    sch = build_schedule("gpipe", 3, 8, group=4)
    for acts in sch.actions:
        assert [str(a) for a in acts] == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3",
                                          "F4", "F5", "F6", "F7", "B4", "B5", "B6", "B7"]
        assert [a.microbatch for a in acts if a.update] == [3, 7]
    assert sch.max_in_flight(0) == 4


def test_makespan_and_in_flight():
    n, m = 4, 32
    gpipe = build_schedule("gpipe", n, m)
    assert gpipe.makespan({"F": 1, "B": 2}) == (m + n - 1) * 3  # fill-drain: (M+N-1)(F+B)
    f1b = build_schedule("1f1b", n, m)
    assert f1b.makespan({"F": 1, "B": 1}) == 2 * m + 2 * (n - 1)
    assert [f1b.max_in_flight(k) for k in range(n)] == [n - k for k in range(n)]



def test_link_cost_delays_cross_rank_inputs_only():
    """A link cost delays an activation or gradient sent to another rank, never a stage's own F or I, nor a
    neighbouring chunk on the same rank; without one the timeline is the unit one, to the bit."""
    n = 3
    one = build_schedule("gpipe", n, 1)
    assert one.timeline() == one.timeline(link=0.0) == one.timeline({"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0})
    assert one.makespan({"F": 1, "B": 2}) == n * 3
    # F0 crosses n - 1 boundaries on its way down, B0 as many on its way up
    assert one.makespan({"F": 1, "B": 2}, link=0.5) == n * 3 + 2 * (n - 1) * 0.5
    assert one.makespan({"F": 1, "B": 2}, link={0: 0.5}) == n * 3 + 2 * 0.5  # boundary 1 is free
    times = one.timeline({"F": 1, "B": 2}, link=0.5)
    assert times[(n - 1, "B", 0)][0] == times[(n - 1, "F", 0)][1]  # the last stage's own F: no hop
    chunks = build_schedule("interleaved", 1, 4, virtual=2)  # both chunks on one rank: nothing crosses a link
    assert chunks.timeline(link=9.0) == chunks.timeline()
    split = build_schedule("zb1p", 2, 4)
    times = split.timeline({"F": 1, "I": 1, "W": 1}, link=0.25)
    assert times[(0, "I", 0)][0] >= times[(1, "I", 0)][1] + 0.25  # stage 0's I waits for stage 1's I plus the hop


def test_step_cost_follows_each_update():
    """``step`` is added to the action an update follows, per stage where given per stage."""
    gpipe = build_schedule("gpipe", 1, 8, group=4)
    assert gpipe.makespan({"F": 1, "B": 1, "step": 3}) == 16 + 2 * 3
    assert gpipe.makespan({"F": 1, "B": 1, (0, "step"): 0.5, "step": 3}) == 16 + 2 * 0.5
    assert gpipe.makespan({"F": 1, "B": 1}) == 16

def _schedule(actions, n=2, m=1, group=1):
    return Schedule("1f1b", n, m, group, tuple(tuple(a) for a in actions))


def test_validator_rejects_broken_schedules():
    good = build_schedule("1f1b", 2, 2)
    missing = [list(good.actions[0][:-1]), list(good.actions[1])]
    with pytest.raises(ScheduleError, match="exactly once"):
        _schedule(missing, m=2).validate()
    b_first = [[Action(0, "B", 0, True), Action(0, "F", 0)], [Action(1, "F", 0), Action(1, "B", 0, True)]]
    with pytest.raises(ScheduleError, match="before F0"):
        _schedule(b_first).validate()
    # stage 1 wants F1 before F0 while stage 0 sends F0 first, then waits for B0: deadlock
    dead = [[Action(0, "F", 0), Action(0, "B", 0, True), Action(0, "F", 1), Action(0, "B", 1, True)],
            [Action(1, "F", 1), Action(1, "B", 1, True), Action(1, "F", 0), Action(1, "B", 0, True)]]
    with pytest.raises(ScheduleError, match="deadlock"):
        _schedule(dead, m=2).validate()
    no_update = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "F", 0), Action(1, "B", 0, True)]]
    with pytest.raises(ScheduleError, match="never applied"):
        _schedule(no_update).validate()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(name="zigzag", stages=2, microbatches=2), ConfigError, "schedule='zigzag' is unknown; choose one of vanilla"),
    (dict(name="1f1b", stages=0, microbatches=2), ScheduleError, "stages=0"),
    (dict(name="gpipe", stages=2, microbatches=0), ScheduleError, "microbatches=0"),
    (dict(name="gpipe", stages=2, microbatches=6, group=4), ScheduleError, "group=4 must be >= 1 and divide"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        build_schedule(kwargs.pop("name"), **kwargs)


def test_grid_shows_every_action():
    sch = build_schedule("1f1b", 4, 8)
    grid = sch.grid(sch.version_differences("paper"))
    lines = grid.splitlines()
    assert len(lines) == 5 and lines[1].startswith("stage 0 |")
    assert "F7+3" in lines[1] and "B0+1" in lines[3]
    assert sum(line.count("F") + line.count("B") for line in lines[1:]) == 64


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rayspec.schedule", *args], capture_output=True, text=True, check=True)


def test_cli_grid_and_json():
    out = _cli("stages=4", "microbatches=8", "schedule=1f1b", "method=spectrain", "variant=paper").stdout
    assert "stage 3 |" in out and "F0+0" in out
    recs = json.loads(_cli("stages=4", "microbatches=8", "schedule=1f1b", "method=spectrain", "variant=paper",
                           "json=true").stdout)
    assert len(recs) == 4 * 8 * 2
    assert set(recs[0]) == {"stage", "kind", "microbatch", "version", "s"}
    sch = build_schedule("1f1b", 4, 8)
    s = sch.version_differences("paper")
    for r in recs:
        assert r["s"] == s[(r["stage"], r["kind"], r["microbatch"])]
    assert {r["s"] for r in json.loads(_cli("method=gpipe", "json=true").stdout)} == {0}


def test_cli_rejects_bad_input():
    res = subprocess.run([sys.executable, "-m", "rayspec.schedule", "stages=0"], capture_output=True, text=True)
    assert res.returncode == 2 and "stages=0" in res.stderr
