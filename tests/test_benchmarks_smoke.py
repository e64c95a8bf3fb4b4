"""Smoke tests of ``benchmarks.memory``, ``benchmarks.peer``, ``benchmarks.efficiency``, ``benchmarks.gpu_check`` and
``benchmarks.studies.table`` at their smallest sizes (the numbers are sane), and of the runner, ``python -m benchmarks``:
its list, and each of those benchmarks' ``--quick`` run, which writes to a scratch folder, never to the results."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package lives at the repo root

from benchmarks.__main__ import main as benchmarks_main  # noqa: E402
from benchmarks._shared import one_hop, peer_setup, results, torch_peer  # noqa: E402
from benchmarks.efficiency import bench as efficiency  # noqa: E402
from benchmarks.efficiency import schedules  # noqa: E402
from benchmarks.memory import bench as memory  # noqa: E402
from benchmarks.peer import bench as peer  # noqa: E402
from benchmarks.studies import table as studies_table  # noqa: E402
from rayspec.data import DataInfo  # noqa: E402
from rayspec.models import build_model  # noqa: E402
from rayspec.partition import uniform  # noqa: E402

IMAGE = DataInfo("image", 10, (3, 32, 32))
TINY = peer_setup.PeerConfig(model="mlp", size="tiny", batch=16, microbatches=4, pool=2)


# ----------------------------------------------------------------------------- the runner
@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """``--quick`` runs write here; the committed results must not change."""
    before = {p: p.stat().st_mtime_ns for p in results.RESULTS.rglob("*") if p.is_file()}
    monkeypatch.setattr(results, "QUICK_RESULTS", tmp_path)
    yield tmp_path
    assert {p: p.stat().st_mtime_ns for p in results.RESULTS.rglob("*") if p.is_file()} == before


def test_runner_lists_every_benchmark_with_its_line(capsys):
    assert benchmarks_main(["list"]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert set(lines) == {"overhead", "stage_cost", "efficiency", "partition", "communication", "communication.plot",
                          "memory", "memory.plot", "p2p_memory", "throughput", "peer", "hops", "recovery", "driver",
                          "probe", "gpu_check", "studies", "studies.lr", "studies.table", "studies.select",
                          "studies.budget", "time_to_accuracy", "time_to_accuracy.project"}
    assert all(line.strip() for line in lines.values())
    assert benchmarks_main([]) == 2 and "usage" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown"):
        benchmarks_main(["run", "no_such_benchmark"])


def test_memory_quick_through_the_runner(scratch, capsys):
    """``run memory --quick`` then ``run memory.plot --quick``: the tiny models' results and plot, in the scratch folder."""
    assert benchmarks_main(["run", "memory", "--quick", "--models", "mlp,vgg16", "--stages", "2,4"]) == 0
    import json

    data = json.loads((scratch / "memory.json").read_text())
    assert {r["model"] for r in data["results"]} == {"mlp", "vgg16"} and data["mismatches"] == []
    assert benchmarks_main(["run", "memory.plot", "--quick"]) == 0
    assert (scratch / "memory.png").stat().st_size > 0
    assert f"wrote {scratch / 'memory.json'}" in capsys.readouterr().out


def test_studies_table_quick_through_the_runner(scratch, capsys):
    assert benchmarks_main(["run", "studies.table", "--quick", "--stages", "4"]) == 0
    assert "N=4: final validation accuracy" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["efficiency", "peer"])
def test_quick_through_the_runner(name):
    """The benchmark's own ``--quick`` run, end to end in its own process (it starts and stops its Ray), writes its
    results file to the scratch folder and leaves the committed results alone."""
    import subprocess
    import time

    before = {p: p.stat().st_mtime_ns for p in results.RESULTS.rglob("*") if p.is_file()}
    started = time.time_ns()
    extra = ["--transports", "p2p"] if name == "peer" else ["--transports", "p2p", "--stages", "2"]
    res = subprocess.run([sys.executable, "-m", "benchmarks", "run", name, "--quick", *extra], capture_output=True,
                         text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    assert (results.QUICK_RESULTS / f"{name}.json").stat().st_mtime_ns >= started
    assert {p: p.stat().st_mtime_ns for p in results.RESULTS.rglob("*") if p.is_file()} == before


def test_time_to_accuracy_resumes_only_finished_runs_of_the_same_settings(tmp_path):
    """The partial file written after every run: ``--resume`` keeps its finished runs by (method, seed), trains a
    failed one again, and refuses a file written with other settings."""
    from benchmarks.time_to_accuracy import bench as tta

    path = tmp_path / "tta.partial.json"
    key = {"study": "fashion", "stages": 2, "eval_every": 150, "overrides": []}
    ok = {"method": "gpipe", "seed": 0, "train_s": 1.0, "curve": [[150, 1.0, 0.8]], "overrides": ["seed=0"]}
    failed = {"method": "gpipe", "seed": 1, "error": "RuntimeError: boom", "curve": [], "overrides": ["seed=1"]}
    assert tta._resumed(path, key) == {}
    tta._save_partial(path, key, {"sequential": [], "gpipe": [ok, failed]})
    assert tta._resumed(path, key) == {("gpipe", 0): ok}
    with pytest.raises(SystemExit, match="other settings"):
        tta._resumed(path, {**key, "eval_every": 300})
    fresh = {**ok, "seed": 1}  # a run of another invocation (only seed 1): seed 0's run stays in the file
    tta._save_partial(path, key, {"sequential": [], "gpipe": [fresh]}, others={("gpipe", 0): ok})
    assert tta._resumed(path, key) == {("gpipe", 1): fresh, ("gpipe", 0): ok}


@pytest.mark.slow
def test_time_to_accuracy_quick_through_the_runner(tmp_path):
    """``run time_to_accuracy --quick`` in its own process: a row per method run, the targets from the baseline, and
    curves whose training seconds grow, in the scratch folder. The study's data: a small file in the Rotten Tomatoes
    file's format (``--set data.path=FILE``), so that the run needs no installed data."""
    import json
    import subprocess
    import time

    from test_data import rt_rows, write_csv

    reviews = write_csv(tmp_path / "rt.csv.bz2", rt_rows(movies=200, seed=3))
    before = {p: p.stat().st_mtime_ns for p in results.RESULTS.rglob("*") if p.is_file()}
    started = time.time_ns()
    res = subprocess.run([sys.executable, "-m", "benchmarks", "run", "time_to_accuracy", "--quick", "--set",
                          f"data.path={reviews}"],
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    path = results.QUICK_RESULTS / "time_to_accuracy.json"
    assert path.stat().st_mtime_ns >= started and (results.QUICK_RESULTS / "time_to_accuracy.png").stat().st_size > 0
    data = json.loads(path.read_text())
    assert data["study"] == "reviews" and [r["method"] for r in data["rows"]] == ["sequential", "vanilla",
                                                                                  "spectrain-paper"]
    assert set(data["targets"]) == {"to_95", "to_99"} and 0 < data["targets"]["to_95"] < data["targets"]["to_99"] < 1
    for label, runs in data["runs"].items():
        for run in runs:
            assert "error" not in run, run
            clock = [row[1] for row in run["curve"]]
            assert len(clock) == 3 and all(0 < a < b for a, b in zip(clock, clock[1:])), (label, run["curve"])
            assert clock[-1] <= run["train_s"] + 1e-9 and run["updates"] == 12
    assert {p: p.stat().st_mtime_ns for p in results.RESULTS.rglob("*") if p.is_file()} == before
    assert (results.QUICK_RESULTS / "time_to_accuracy.partial.json").exists()  # kept, for --resume to add to


def test_time_to_accuracy_counts_runs_that_miss_the_target():
    """The median counts a run that never reached the target as slower than all that did; failed runs miss."""
    from benchmarks.time_to_accuracy import _curves

    assert _curves.median([3.0, None, 1.0]) == 3.0 and _curves.median([3.0, None, None]) is None
    assert _curves.median([2.0, 4.0]) == 3.0 and _curves.median([2.0, None]) is None
    curve = [[10, 1.0, 0.5], [20, 2.0, 0.7], [30, 3.0, 0.8], [40, 4.0, 0.9]]
    goal = _curves.targets([{"seed": 0, "curve": curve}])
    assert goal["baseline_score"] == pytest.approx(0.8) and goal["targets"]["to_95"] == pytest.approx(0.76)
    runs = [{"seed": 0, "curve": curve, "train_s": 4.0, "updates": 40},
            {"seed": 1, "curve": [[10, 1.5, 0.79], [20, 3.0, 0.78]], "train_s": 3.0, "updates": 20},
            {"seed": 2, "error": "FloatingPointError: the loss became non-finite", "curve": []}]
    row = _curves.method_row("m", runs, goal["targets"])
    assert row["to_95"] == {"median_s": 3.0, "per_seed_s": [3.0, 1.5, None], "not_reached": 1}
    assert row["to_99"]["per_seed_s"] == [3.0, None, None] and row["to_99"]["median_s"] is None
    assert row["s_per_update"] == pytest.approx(0.125) and row["errors"] == {2: runs[2]["error"]}
    _curves.add_ratios([row], ["to_95", "to_99"])
    assert row["to_95"]["ratio_to_best"] == 1.0 and row["to_99"]["ratio_to_best"] is None


# ----------------------------------------------------------------------------- memory
@pytest.fixture(scope="module")
def tiny_mlp():
    import torch

    torch.manual_seed(0)
    return build_model("mlp", IMAGE, "tiny")


@pytest.mark.parametrize("n", [2, 4])
def test_memory_peaks_follow_the_stage_accounting(tiny_mlp, n):
    """Peak weight bytes per stage are exactly the copies Stage keeps, in both segments."""
    balance = uniform(len(tiny_mlp), n)
    pd = memory.stage_memory(tiny_mlp, IMAGE, n, "pipedream", balance, segments=2)
    st = memory.stage_memory(tiny_mlp, IMAGE, n, "spectrain", balance, segments=2)
    predicts = memory.predicting_stages(n, memory.microbatch_count(n))
    assert predicts == ([True, False] if n == 2 else [True] * n)  # paper variant: N=2's last stage never predicts
    for k in range(n):
        w = pd[k]["weight_bytes"]
        assert w > 0 and st[k]["weight_bytes"] == w
        # pipedream: weights + momentum + N-k stashed versions in every segment; a drained stage frees its scratch
        assert pd[k]["peak_first"] == pd[k]["peak_later"] == w * (2 + n - k)
        assert pd[k]["peak_stash"] == n - k
        assert pd[k]["final"] == {"weights": w, "optimizer": w, "scratch": 0, "stash": 0}
        # spectrain: weights + momentum + one scratch copy, never a stash
        assert st[k]["peak_first"] == st[k]["peak_later"] == w * (3 if predicts[k] else 2)
        assert st[k]["peak_stash"] == 0
        assert st[k]["final"] == {"weights": w, "optimizer": w, "scratch": w if predicts[k] else 0, "stash": 0}
        for method, got in (("pipedream", pd[k]), ("spectrain", st[k])):
            assert got["peak_first"] == w * memory.expected_copies(method, n, k, later=False, predicts=predicts[k])
            assert got["peak_later"] == w * memory.expected_copies(method, n, k, later=True, predicts=predicts[k])


def test_memory_measure_rows_and_totals():
    r = memory.measure("mlp", "tiny", 4, "parameters", batch=2, segments=2)
    assert len(r["per_stage"]) == 4 and sum(r["balance"]) == 7
    for s in r["per_stage"]:
        assert s["pipedream_copies"] == s["expected_pipedream"]
        assert s["pipedream_later_copies"] == s["expected_pipedream_later"]
        assert s["spectrain_copies"] == s["expected_spectrain"] == 3
    t = r["total"]
    assert t["pipedream_mib"] > t["spectrain_mib"] > t["weights_mib"] > 0
    assert math.isclose(t["ratio"], t["pipedream_mib"] / t["spectrain_mib"])


def test_predicting_stages_consistent_variant():
    assert memory.predicting_stages(4, 12, "consistent") == [True, True, True, False]


# ----------------------------------------------------------------------------- peer
def test_flushed_1f1b_is_torch_schedule1f1b():
    s = peer_setup.rayspec_schedule("1f1b", 4, 3)
    assert s.is_synchronous() and s.updates == 3 and s.group == 4
    first = [str(a) for a in s.actions[0][:8]]
    assert first == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]  # then the next batch, after the flush
    assert str(s.actions[0][8]) == "F4"
    assert peer_setup.rayspec_schedule("1f1b-flushed", 4, 3) == s  # the former name of the runner
    assert peer_setup.runner_method("1f1b-flushed") == "1f1b"
    zb = peer_setup.rayspec_schedule("zb1p", 4, 3)
    assert zb.is_synchronous() and zb.updates == 3 and zb.splits_backward
    assert peer_setup.rayspec_schedule("interleaved", 4, 3).virtual == 2
    assert peer_setup.rayspec_schedule("gpipe", 4, 3).is_synchronous()
    assert not peer_setup.rayspec_schedule("spectrain", 4, 3).is_synchronous()
    grouped = peer_setup.rayspec_schedule("spectrain-grouped", 4, 3)  # one update per batch, no flush between batches
    assert not grouped.is_synchronous() and grouped.updates == 3 and grouped.group == 4
    assert [str(a) for a in grouped.actions[0][7:9]] == ["F4", "B3"]  # the next batch starts before the update


def test_microbatches_and_ideal():
    parts, balance = peer_setup.build_parts(TINY)
    assert len(parts) == 2 and sum(balance) == 7
    batches = peer_setup.make_batches(TINY)
    mbs = peer_setup.microbatches(batches, 1, 3, TINY.microbatches)
    assert len(mbs) == 3 * TINY.microbatches and mbs[0][0].shape == (4, 3, 32, 32)
    compute = peer_setup.profile_stages(parts, TINY, repeats=2)
    assert set(compute) == {(k, kind) for k in (0, 1) for kind in "FBIW"}
    assert all(v > 0 for key, v in compute.items() if key != (0, "I"))  # stage 0 needs no input gradient
    chunks, chunk_balance = peer_setup.build_parts(TINY, 4)  # interleaved: 2 chunks per rank
    assert len(chunks) == 4 and sum(chunk_balance) == 7
    chunk_compute = peer_setup.profile_stages(chunks, TINY, repeats=2)
    for runner in peer_setup.RAYSPEC_RUNNERS:
        durations = chunk_compute if peer_setup.chunks_per_rank(runner) > 1 else compute
        assert peer_setup.ideal_step_s(runner, TINY.microbatches, durations) > 0
    with pytest.raises(ValueError, match="interleaved"):
        peer_setup.ideal_step_s("interleaved", TINY.microbatches, compute)


def test_torch_sleep_pipeline_efficiency():
    """torch.distributed.pipelining over 3 sleep stages: both schedules, never faster than the ideal makespan
    (sleeps are lower bounds, so running fewer actions than the schedule's would show as efficiency > 1)."""
    rows = efficiency.measure_torch(3, 4, 0.01, 0.02, repeats=2, width=16, timeout_s=120)
    assert sorted(r["schedule"] for r in rows) == ["1f1b", "gpipe"]
    for r in rows:
        assert r["transport"] == "torch" and r["stages"] == 3 and r["microbatches"] == 4
        assert r["ideal_s"] == pytest.approx((3 - 1 + 4) * 0.03)
        assert 0.3 < r["efficiency_median"] <= r["efficiency_best"] <= 1.0, r


def test_torch_schedule_bubbles_on_split_sleep_stages():
    """torch's 1F1B, ZB-H1 and interleaved 1F1B (2 blocks per rank) over 2 sleep ranks whose backward splits into I
    and W: a row per schedule with its formula; the measured bubble is no lower than the formula's (sleeps are lower
    bounds) and below 1."""
    rows = schedules.measure_torch(["1f1b", "zb1p", "interleaved"], 2, [4], 0.01, 0.01, 0.01, repeats=1, timeout_s=120)
    assert [(r["method"], r["torch"], r["virtual"]) for r in rows] == [
        ("1f1b", "Schedule1F1B", 1), ("zb1p", "ScheduleInterleavedZeroBubble", 1),
        ("interleaved", "ScheduleInterleaved1F1B", 2)]
    assert [r["formula"] for r in rows] == [pytest.approx(1 / 4), pytest.approx(1 / 12, abs=1e-4), pytest.approx(1 / 8)]
    for r in rows:
        assert r["formula"] - 0.02 < r["bubble_median"] < 1.0, r


@pytest.mark.slow
def test_rayspec_schedule_bubble_on_split_sleep_stages(ray_session):
    """rayspec's zb1p on the Ray executor with p2p over 2 split sleep stages: its traced actions give a bubble no
    lower than the formula's and below 1."""
    r = schedules.measure_rayspec("zb1p", 2, 4, 0.01, 0.01, 0.01, repeats=1)
    assert r["side"] == "rayspec p2p" and r["formula"] == pytest.approx(1 / 12, abs=1e-4)
    assert r["formula"] - 0.02 < r["bubble_median"] < 1.0 and r["median_s"] >= r["ideal_s"], r


def test_split_sleep_block_sleeps_i_and_w_apart():
    import time

    import torch

    block = schedules.SplitSleepBlock(0.0, 0.02, 0.06)
    x = torch.randn(2, 4, requires_grad=True)
    block(x).sum().backward()  # the first backward warms autograd up
    took = {}
    for name, inputs in (("I", [x]), ("W", list(block.parameters())), ("B", None)):
        out = block(x)
        t0 = time.perf_counter()
        torch.autograd.backward([out], [torch.ones_like(out)], inputs=inputs)
        took[name] = time.perf_counter() - t0
    assert 0.02 <= took["I"] < 0.05 and 0.06 <= took["W"] < 0.09 and 0.08 <= took["B"] < 0.11, took


def test_torch_peer_trains():
    """Every torch schedule gives finite losses, a positive throughput, and restarts bit-exactly after a reset;
    interleaved 1F1B runs 2 chunks per rank (4 stages)."""
    parts, _ = peer_setup.build_parts(TINY)
    chunks, _ = peer_setup.build_parts(TINY, 4)
    with torch_peer.TorchPeer(parts, TINY, timeout_s=120, chunks=chunks) as tp:
        for name in torch_peer.RUN_HERE:
            seconds, losses = tp.steps(name, 2)
            assert seconds > 0 and len(losses) == 2 and all(math.isfinite(v) for v in losses)
            assert TINY.batch * 2 / seconds > 0
            kinds = "FIW" if name == "zb1p" else "FB"  # zb1p: the backward split; stage 0 has no input gradient
            assert tp.last_cpu_s["ranks"] >= 0
            stages = range(2 * peer_setup.chunks_per_rank(name))
            assert all(tp.last_busy_s[(k, kind)] > 0 for k in stages for kind in kinds if (k, kind) != (0, "I"))
            tp.reset(name)
            assert tp.steps(name, 2)[1] == losses
        assert tp.hop_s((4, 64), count=5) > 0


@pytest.mark.slow
def test_rayspec_interleaved_vs_torch_compare(ray_session):
    """rayspec's interleaved (2 chunks per stage actor, p2p) trains to torch ScheduleInterleaved1F1B's losses on the
    same 4 chunks; a transport whose actors host one stage gives a refusal row that names p2p."""
    chunks, _ = peer_setup.build_parts(TINY, 4)
    parts, _ = peer_setup.build_parts(TINY)
    with torch_peer.TorchPeer(parts, TINY, timeout_s=120, chunks=chunks) as tp:
        row = peer.compare(chunks, TINY, tp, "interleaved", "p2p", steps=2, warmup=1, repeats=1, cpus_per_stage=0.5)
        no = peer.compare(chunks, TINY, tp, "interleaved", "object_store", steps=2, warmup=1, repeats=1,
                          cpus_per_stage=0.5)
    assert row["torch"] == "interleaved" and row["like_for_like"] and row["max_loss_diff"] < 1e-5, row
    assert set(row["rayspec_busy_ms"]) == set(row["torch_busy_ms"]) == {f"{k}{kind}" for k in range(4) for kind in "FBIW"}
    assert "pipeline.transport=p2p" in no["error"]


@pytest.mark.slow
def test_rayspec_vs_torch_compare(ray_session):
    """rayspec gpipe trains to torch GPipe's losses; spectrain gives finite losses; both a positive throughput."""
    parts, _ = peer_setup.build_parts(TINY)
    with torch_peer.TorchPeer(parts, TINY, timeout_s=120) as tp:
        gp = peer.compare(parts, TINY, tp, "gpipe", "object_store", steps=2, warmup=1, repeats=1, cpus_per_stage=0.5)
        sp = peer.compare(parts, TINY, tp, "spectrain", "object_store", steps=2, warmup=1, repeats=1,
                          cpus_per_stage=0.5)
    assert gp["losses_finite"] and sp["losses_finite"]
    assert gp["max_loss_diff"] < 1e-5  # the same synchronous training on both sides
    assert sp["max_loss_diff"] >= 0 and not sp["like_for_like"]
    for row in (gp, sp):
        assert row["rayspec_samples_per_s"] > 0 and row["torch_samples_per_s"] > 0 and row["ratio"] > 0
        assert len(row["rayspec_losses"]) == len(row["torch_losses"]) == 3
        busy = row["rayspec_busy_ms"]  # per stage and kind; no split backward (I, W) in these runners
        assert all(v > 0 for k, v in busy.items() if k[1] in "FB") and all(busy[f"{k}{w}"] == 0 for k in "01" for w in "IW")
    assert one_hop.ray_hop_s("object_store", (4, 64), count=10) > 0


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    """The GPU check script's every path but CUDA placement, its ``--quick`` dry run (``--device cpu --updates 4
    --transports p2p,nccl --torch on``) at its default sizes (the feed must not run out), through the runner: Ray stage
    actors equal the local executor, a transport the placement refuses is a row, torch's GPipe runs."""
    import json
    import subprocess

    res = subprocess.run([sys.executable, "-m", "benchmarks", "run", "gpu_check", "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    p2p = [r for r in rows if r["transport"] == "p2p"]
    assert [r["method"] for r in p2p] == ["vanilla", "gpipe", "async", "pipedream", "spectrain"]
    assert all(r["equal"] is True and "error" not in r for r in p2p)
    assert all(r["samples/s"] > 0 for r in p2p if r["method"] in ("gpipe", "spectrain"))
    nccl = next(r for r in rows if r["transport"] == "nccl")
    assert nccl["error"].startswith("refused: pipeline.transport=nccl with pipeline.gpus_per_stage=0")
    torch_row = next(r for r in rows if r["transport"] == "torch gpipe")
    assert torch_row["samples/s"] > 0 and "error" not in torch_row
    assert res.stdout.count("transport ") == 1  # one table


def test_studies_table_reads_the_reports_into_the_authors_layout():
    """The README's real-data rows come from each study's ``study_results.json``: accuracy and the change against
    the same seed's sequential run in points, with the authors' row after a study whose model they report."""
    runs = [{"label": "sequential", "stages": 4, "ok": 3, "runs": 3, "diverged": 0, "val_accuracy": 0.861,
             "val_accuracy_std": 0.002},
            {"label": "pipedream", "stages": 4, "ok": 3, "runs": 3, "diverged": 0, "val_accuracy": 0.8206,
             "val_accuracy_std": 0.008, "val_accuracy_change": -0.0407, "val_accuracy_change_std": 0.0082},
            {"label": "async", "stages": 4, "ok": 0, "runs": 3, "diverged": 3}]
    report = {"table": runs, "settings": {"config": {"optim": {"lr": 0.03}}}}
    lines = studies_table.accuracy_table({"vgg16_fashion": ("vgg16_fashion", report)}, 4)
    assert lines[2] == "| vgg16_fashion (0.03) | 86.1 ± 0.2 | diverged | 82.1 (\u22124.1 ± 0.8) | – | – | – | – |"
    assert lines[3].startswith("| *authors, VGG, CIFAR-10, 4 GPUs* | *DP 91.10* | *88.31 (\u22122.79)*")
    assert studies_table.accuracy_table({"snn_fashion": ("snn_fashion", report)}, 4)[3:] == []  # no authors' row
