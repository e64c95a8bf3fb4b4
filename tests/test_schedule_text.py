"""The schedules users run today as torch builds them: the same orders, torch's CSV both ways, torch's checks, and
each schedule's bubble on the simulated timeline equal to its formula."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from rayspec.core.orders import BUBBLES, bubble_formula
from rayspec.core.schedule import EQUAL_FIW, Action, ScheduleError, build_schedule
from rayspec.core.schedule_text import check_rows, from_rows, load_schedule, parse_action, read_rows, to_csv

TORCH = {"1f1b-flushed": torch_schedules.Schedule1F1B, "zb1p": torch_schedules.ScheduleInterleavedZeroBubble,
         "interleaved": torch_schedules.ScheduleInterleaved1F1B}


def _stage(index, stages, ranks):
    """What torch's schedule builders read of a stage: its place in the pipeline (no process group, no module run);
    torch's own schedule tests stand in for the stage the same way."""
    return SimpleNamespace(stage_index=index, num_stages=stages, group_size=ranks, group_rank=index % ranks,
                           is_first=index == 0, is_last=index == stages - 1, submod=torch.nn.Linear(1, 1))


def torch_schedule(name, ranks, m, virtual=1):
    stages = ranks * virtual
    if name == "1f1b-flushed":
        return TORCH[name](_stage(0, ranks, ranks), m)
    return TORCH[name]([_stage(c * ranks, stages, ranks) for c in range(virtual)], m)


def torch_order(name, ranks, m, virtual=1):
    """torch's compute actions per rank, in order (``pipeline_order``; rank 0's ``Schedule1F1B`` has none)."""
    return [[str(a) for a in row if a is not None] for _, row in sorted(torch_schedule(name, ranks, m, virtual)
                                                                        .pipeline_order.items())]


@pytest.mark.parametrize("ranks,m", [(2, 4), (2, 8), (4, 8), (4, 16), (3, 6)])
@pytest.mark.parametrize("name,virtual", [("zb1p", 1), ("interleaved", 1), ("interleaved", 2), ("interleaved", 3)])
def test_orders_are_torchs(name, virtual, ranks, m):
    mine = build_schedule(name, ranks, m, virtual=virtual)
    assert [[a.text for a in row] for row in mine.rank_actions] == torch_order(name, ranks, m, virtual)


@pytest.mark.parametrize("n,m", [(4, 8), (4, 16), (2, 8), (8, 16)])
@pytest.mark.parametrize("name,virtual", [("1f1b-flushed", 1), ("gpipe", 1), ("zb1p", 1), ("interleaved", 2),
                                          ("interleaved", 4)])
def test_simulated_bubble_is_the_formula(name, virtual, n, m):
    """F = I = W (B = I + W): 1F1B and GPipe idle (p-1)/m of their busy time, ZB-H1 (p-1)/3m, interleaved (p-1)/vm."""
    schedule = build_schedule(name, n, 3 * m, group=m, virtual=virtual)  # three batches, flushed
    assert schedule.bubble(EQUAL_FIW) == pytest.approx(bubble_formula(name, n, m, virtual), abs=1e-12)
    assert BUBBLES[name]


def test_torch_csv_reads_here_and_ours_reads_in_torch(tmp_path):
    """torch's ``_dump_csv`` of ZB-H1 is our zb1p; our interleaved CSV loads and validates in torch."""
    theirs = torch_schedule("zb1p", 4, 8)
    theirs._dump_csv(tmp_path / "zb.csv", format="compute_only")
    loaded = load_schedule(tmp_path / "zb.csv")
    built = build_schedule("zb1p", 4, 8)
    assert loaded.actions == built.actions and loaded.name == "zb.csv"
    (tmp_path / "il.csv").write_text(to_csv(build_schedule("interleaved", 4, 8, virtual=2)))
    again = torch_schedule("interleaved", 4, 8, virtual=2)
    again._load_csv(tmp_path / "il.csv")
    assert [[str(a) for a in row if a is not None] for _, row in sorted(again.pipeline_order.items())] == \
        torch_order("interleaved", 4, 8, virtual=2)
    assert read_rows(to_csv(built))[0][0] == Action(0, "F", 0)


def test_text_round_trip():
    assert parse_action(" 1I3 ") == Action(1, "I", 3) and parse_action("") is None
    assert Action(0, "W", 5).text == "0W5"
    with pytest.raises(ScheduleError, match="UNSHARD"):
        parse_action("1UNSHARD")


def _broken(edit):
    rows = read_rows(to_csv(build_schedule("zb1p", 2, 4)))
    edit(rows)
    return rows


def _swap(rows, r, a, b):
    i, j = (next(k for k, x in enumerate(rows[r]) if x is not None and x.text == t) for t in (a, b))
    rows[r][i], rows[r][j] = rows[r][j], rows[r][i]


@pytest.mark.parametrize("edit,message,cell", [
    (lambda rows: _swap(rows, 1, "1W0", "1I0"), "rank 1, step 2: 1W0 runs before 1I0", ">1W0<"),
    (lambda rows: _swap(rows, 0, "0F1", "0I1"), r"rank 0, step 1: 0I1 runs before 0F1", ">0I1<"),
    (lambda rows: rows[0].append(Action(0, "F", 2)), "0F2 runs twice", ">0F2<"),
    (lambda rows: rows[1].remove(Action(1, "W", 3)), r"stage 1 runs 4 F, 0 B, 4 I and 3 W", ">1"),
    (lambda rows: rows[0].append(Action(1, "F", 7)), "stage 1 belongs on rank 1", ">1F7<"),
])
def test_a_bad_schedule_shows_the_grid_with_the_cell_marked(edit, message, cell):
    rows = _broken(edit)
    with pytest.raises(ScheduleError, match=message) as err:
        from_rows(rows)
    assert cell in str(err.value) and "<-- error here" in str(err.value) and "Rank 0" in str(err.value)


def test_check_rows_counts_stages_and_microbatches():
    assert check_rows(read_rows(to_csv(build_schedule("interleaved", 2, 4, virtual=2)))) == (4, 4)


def test_a_deadlocking_order_is_refused():
    rows = [[Action(0, "F", 0), Action(0, "I", 0), Action(0, "W", 0)], [Action(1, "I", 0), Action(1, "F", 0)]]
    with pytest.raises(ScheduleError, match="1I0 runs before 1F0"):
        from_rows(rows)
    rows = [[Action(0, "F", 1), Action(0, "F", 0), Action(0, "B", 0), Action(0, "B", 1)],
            [Action(1, "F", 0), Action(1, "B", 0), Action(1, "F", 1), Action(1, "B", 1)]]
    assert from_rows(rows).microbatches == 2  # out of micro-batch order, still runs
    rows = [[Action(0, "F", 0), Action(0, "B", 1), Action(0, "F", 1), Action(0, "B", 0)],
            [Action(1, "F", 1), Action(1, "B", 1), Action(1, "F", 0), Action(1, "B", 0)]]
    with pytest.raises(ScheduleError):
        from_rows(rows)


def test_cli_prints_torch_csv_and_reads_it_back(tmp_path):
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "rayspec.schedule", *args], capture_output=True, text=True,
                              check=True).stdout

    csv_text = cli("method=zb1p", "stages=4", "microbatches=8", "csv=true")
    assert csv_text == to_csv(build_schedule("zb1p", 4, 8)) and csv_text.startswith("0F0,0F1,0F2,")
    (tmp_path / "zb.csv").write_text(csv_text)
    out = cli(f"read={tmp_path / 'zb.csv'}")
    assert "stage 3 |" in out and "W7*" in out and "simulated with F = I = W (B = I + W): 0.1250" in out
    assert "formula (p-1)/(3m) = 0.1250" in cli("method=zb1p", "stages=4", "microbatches=8")
    assert "rank 1 | " in cli("method=interleaved", "stages=2", "microbatches=4", "virtual=2")


def test_measured_bubble_of_a_simulated_timeline_is_the_simulated_bubble():
    from rayspec.core.orders import measured_bubble

    schedule = build_schedule("interleaved", 4, 16, group=8, virtual=2)
    times = schedule.timeline(EQUAL_FIW)
    timelines = [[(a.kind, a.microbatch, *times[a.key]) for a in acts] for acts in schedule.actions]
    assert measured_bubble(timelines, ranks=4) == pytest.approx(schedule.bubble(EQUAL_FIW))
