"""Accuracy studies: a tiny study end to end through the CLI (table, JSON, plots, resume), divergence, bad studies."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayspec.cli.study import (
    BASELINE,
    DEFAULT_METHODS,
    StudyError,
    available,
    load_study,
    main,
    parse_args,
    plan_runs,
    run_study,
)
from rayspec.data import DataError
from rayspec.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model=mlp", "model.size=tiny", "data.train_size=512", "data.val_size=128", "data.noise=1.0",
    "train.max_steps=8", "train.batch_size=32", "train.eval_every=4", "train.log_every=2",
    "optim.lr=0.1", "optim.schedule=poly",
]
PNG = b"\x89PNG\r\n\x1a\n"


def write_study(path: Path, **settings) -> Path:
    path.write_text(yaml.safe_dump({"overrides": TINY, "stages": [2, 4], "seeds": [0], **settings}))
    return path


def finite_numbers(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_numbers(v) for v in value.values())
    if isinstance(value, list):
        return all(finite_numbers(v) for v in value)
    return True


def study_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayspec.study", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_tiny_study_end_to_end(tmp_path, caplog):
    """Every method at 2 and 4 stages through the real entry point; then the same command resumes and skips all."""
    study, out = write_study(tmp_path / "tiny.yaml"), tmp_path / "out"
    res = study_cli(f"study={study}", f"output_dir={out}")
    assert res.returncode == 0, res.stderr[-3000:]
    runs = 1 + 2 * len(DEFAULT_METHODS)  # one baseline, every method at N = 2 and 4
    assert f"[1/{runs}] {BASELINE} N=1 seed 0" in res.stdout and f"[{runs}/{runs}] gpipe N=4 seed 0" in res.stdout
    assert "eta" in res.stdout and "bit-exactly sequential training" in res.stdout

    table = (out / "study.md").read_text()
    assert table in res.stdout  # printed at the end
    for label in [BASELINE, *DEFAULT_METHODS]:
        assert f"| `{label}` |" in table
    assert "val acc % N=2" in table and "val loss N=4" in table and "SEQ2" in table and "STv1_4" in table

    results = json.loads((out / "study_results.json").read_text())
    assert {"study", "settings", "baseline", "table", "runs"} <= set(results)
    assert finite_numbers(results)
    names = sorted(r["name"] for r in results["runs"])
    expected = [f"{BASELINE}-n1-seed0"] + [f"{m}-n{n}-seed0" for m in DEFAULT_METHODS for n in (2, 4)]
    assert names == sorted(expected)
    by = {r["name"]: r for r in results["runs"]}
    for r in results["runs"]:
        assert r["status"] == "ok", r
        assert [row[0] for row in r["curves"]["val"]] == [4, 8]
        assert 0 <= r["final"]["val_accuracy"] <= 1 and r["final"]["val_loss"] > 0
        assert [row[0] for row in r["curves"]["loss"]] == [2, 4, 6, 8]
        if r["reference"] is not None:
            assert r["reference"] == f"{BASELINE}-n1-seed0" and len(r["curves"]["distance"]) == 2
    # gpipe is SGD on the same batch (float summation order aside); stale 1F1B is not
    assert by["gpipe-n4-seed0"]["final"]["distance"] < 1e-5
    assert by["async-n4-seed0"]["final"]["distance"] > 100 * by["gpipe-n4-seed0"]["final"]["distance"]
    cells = {(c["label"], c["stages"]): c for c in results["table"]}
    assert len(cells) == len(results["table"]) == 2 * (1 + len(DEFAULT_METHODS))
    assert cells[BASELINE, 2]["val_accuracy"] == cells[BASELINE, 4]["val_accuracy"] == \
        by[f"{BASELINE}-n1-seed0"]["final"]["val_accuracy"]
    assert cells["async", 4]["ok"] == 1 and cells["async", 4]["val_accuracy"] == by["async-n4-seed0"]["final"]["val_accuracy"]
    base_acc = by[f"{BASELINE}-n1-seed0"]["final"]["val_accuracy"]
    for label in DEFAULT_METHODS:  # paired with the same seed's baseline
        change = by[f"{label}-n4-seed0"]["final"]["val_accuracy"] - base_acc
        assert cells[label, 4]["val_accuracy_change"] == pytest.approx(change, abs=1e-12)
        assert f"{100 * change:+.2f}" in table.split("Change of the final validation accuracy")[1].split("Relative")[0]

    # SpecTrain runs are scored: over the run per stage (the last stage never predicts), and at each evaluation
    for label in ("spectrain-paper", "spectrain-consistent"):
        final = by[f"{label}-n4-seed0"]["final"]
        assert [st["stage"] for st in final["prediction_stages"]] == ([0, 1, 2, 3] if label == "spectrain-paper"
                                                                      else [0, 1, 2])
        assert 0 < final["prediction_quality"] < 1 and final["prediction_best_scale"] > 0
        assert [row[0] for row in by[f"{label}-n4-seed0"]["curves"]["prediction"]] == [4, 8]
        row = next(line for line in table.split("prediction quality")[1].splitlines() if line.startswith(f"| `{label}` |"))
        assert f"{cells[label, 4]['prediction_quality']:.3f}" in row
    assert "prediction_quality" not in by["async-n4-seed0"]["final"]
    import matplotlib.image

    for name in ("learning_curves.png", "distance.png", "prediction.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
        height, width, _ = matplotlib.image.imread(out / name).shape
        assert width > 500 and height > 300

    # the same command again (the function the entry point calls) trains nothing and reports the same table; its
    # lines are the rayspec loggers' records (pytest's logging setup stands in for the console on stdout above)
    (out / "study_results.json").unlink()
    caplog.set_level(logging.INFO, logger="rayspec")
    assert main([f"study={study}", f"output_dir={out}"]) == 0
    again = "\n".join(caplog.messages)
    assert again.count("(finished earlier, skipped)") == runs and "eta" not in again
    assert json.loads((out / "study_results.json").read_text())["table"] == results["table"]


def test_a_diverged_run_is_recorded_and_the_study_goes_on(tmp_path, caplog):
    study = load_study(str(write_study(tmp_path / "hot.yaml")), ["optim.lr=1e6"], methods=["async"], stages=[2],
                       output_dir=str(tmp_path / "out"))
    caplog.set_level(logging.INFO, logger="rayspec")
    payload = run_study(study)
    assert [r["status"] for r in payload["runs"]] == ["diverged", "diverged"]
    assert any("DIVERGED" in line for line in caplog.messages)
    assert "| `async` | diverged | diverged |" in payload["markdown"]
    assert finite_numbers(json.loads((tmp_path / "out" / "study_results.json").read_text()))


def test_dropout_gives_one_baseline_per_stage_count(tmp_path):
    text = ["model=transformer", "model.size=tiny", "data=synthetic_text", "data.train_size=64", "data.val_size=32",
            "data.seq_len=16", "train.max_steps=12", "train.batch_size=16", "train.eval_every=4"]
    path = tmp_path / "drop.yaml"
    path.write_text(yaml.safe_dump({"overrides": text, "stages": [2, 4], "seeds": [0]}))
    overrides: list[str] = []
    study = load_study(str(path), overrides, methods=["spectrain-paper"])
    assert study.per_stage_baseline  # the transformer has dropout 0.1
    runs = {r.name: r for r in plan_runs(study)}
    assert set(runs) == {f"{BASELINE}-n2-seed0", f"{BASELINE}-n4-seed0", "spectrain-paper-n2-seed0",
                         "spectrain-paper-n4-seed0"}
    assert runs["spectrain-paper-n4-seed0"].reference == f"{BASELINE}-n4-seed0"
    assert not load_study(str(path), [*overrides, "+model.dropout=0.0"]).per_stage_baseline


@pytest.mark.parametrize("settings, overrides, message", [
    ({"method": ["async"]}, [], "unknown key 'method'; did you mean methods?"),
    ({"stages": [2, 9]}, [], "pipeline.stages=9 but the model has 7 blocks"),
    ({}, ["train.eval_every=0"], "train.eval_every=0 gives no evaluations"),
    ({}, ["pipeline.stages=2"], "give methods=, stages= or seeds="),
    ({"seeds": []}, [], "seeds=[] must be a non-empty list"),
])
def test_bad_studies_stop_before_training(tmp_path, settings, overrides, message):
    with pytest.raises(StudyError, match=message.replace("[", r"\[").replace("]", r"\]").replace("?", r"\?")):
        load_study(str(write_study(tmp_path / "bad.yaml", **settings)), overrides)


def test_an_unknown_method_label_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"method='spectrain' is unknown in study bad; choose one of .*spectrain-paper"
                                          r".* \(did you mean 'spectrain-2bw'\?\)"):
        load_study(str(write_study(tmp_path / "bad.yaml", methods=["spectrain"])))


def test_cli_errors_exit_2(capsys):
    assert main(["study=no_such_study"]) == 2
    assert "study='no_such_study' is unknown in" in capsys.readouterr().err
    assert main(["study=lstm_text", "resume=maybe"]) == 2
    assert "resume='maybe' must be true or false" in capsys.readouterr().err


@pytest.mark.parametrize("name", available())
def test_every_shipped_study_loads(name):
    try:
        study = load_study(name)
    except StudyError as err:
        if isinstance(err.__cause__, DataError):  # a study on real data where `make data` has not run
            pytest.skip(str(err))
        raise
    assert study.stages and set(study.stages) <= {2, 4} and len(study.seeds) >= 3
    assert {m for m in DEFAULT_METHODS if m != "gpipe"} <= set(study.methods)  # the stale methods and SpecTrain
    # the benchmarks train a subset (one method, a seed, no rate sweep, no checks): the study's keys must allow it
    subset = load_study(name, methods=["vanilla"], stages=[2], seeds=[1], lr_sweep=False, checks=False)
    assert subset.methods == ["vanilla"] and subset.seeds == [1] and not subset.checks


@pytest.mark.slow  # a study's runs on Ray actors
def test_a_study_on_the_ray_executor_gives_the_local_table(tmp_path, ray_session):
    """executor=ray trains every run through stage actors; accuracies, losses and weight distances equal local's."""
    path = write_study(tmp_path / "tiny.yaml", stages=[4])
    payloads = {}
    for executor in ("local", "ray"):
        study = load_study(str(path), methods=["spectrain-consistent"], executor=executor,
                           output_dir=str(tmp_path / executor))
        payloads[executor] = run_study(study)
    runs = {e: {r["name"]: r for r in p["runs"]} for e, p in payloads.items()}
    assert set(runs["ray"]) == set(runs["local"]) == {f"{BASELINE}-n1-seed0", "spectrain-consistent-n4-seed0"}
    for name, local in runs["local"].items():
        ray_run = runs["ray"][name]
        assert ray_run["status"] == local["status"] == "ok"
        assert ray_run["overrides"] != local["overrides"] and "pipeline.executor=ray" in ray_run["overrides"]
        for key in ("val_accuracy", "val_loss", "train_loss", "distance", "prediction_quality",
                    "prediction_best_scale"):
            if local["final"].get(key) is not None:
                assert ray_run["final"][key] == pytest.approx(local["final"][key], rel=1e-5, abs=1e-7), (name, key)
    assert runs["local"]["spectrain-consistent-n4-seed0"]["final"]["distance"] > 1e-4  # not two identical runs
    assert runs["ray"]["spectrain-consistent-n4-seed0"]["final"]["prediction_quality"] is not None


def test_the_rate_sweep_plans_reports_and_plots(tmp_path):
    """lr_sweep: every method and the baseline at each multiple of optim.lr (factor 1: the study's own runs)."""
    sweep = {"stages": 2, "seeds": [0, 1], "factors": [0.5, 1, 2]}
    path = write_study(tmp_path / "sweep.yaml", seeds=[0, 1], stages=[2], methods=["async"], lr_sweep=sweep)
    study = load_study(str(path), output_dir=str(tmp_path / "out"))
    runs = {r.name: r for r in plan_runs(study)}
    assert len(runs) == 4 + 2 * 2 * 2
    assert runs["async-n2-seed1-lr0.2"].reference == f"{BASELINE}-n1-seed1-lr0.2"
    assert "optim.lr=0.05" in runs["async-n2-seed0-lr0.05"].overrides
    payload = run_study(study)
    assert {r["status"] for r in payload["runs"]} == {"ok"} and len(payload["lr_sweep"]) == 2 * 3
    assert "Accuracy against the learning rate at N = 2" in payload["markdown"]
    assert "| `async` | " in payload["markdown"] and "Δ vs sequential [95 % CI]" in payload["markdown"]
    for png in ("accuracy_vs_lr.png", "learning_curves_n2.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == PNG
    assert all(r["eval_split"] == "test" and r["score"] is not None for r in payload["runs"])


def test_lr_sweep_false_on_the_command_line_drops_the_files_sweep(tmp_path):
    sweep = {"stages": 2, "seeds": [0, 1], "factors": [0.5, 1, 2]}
    path = write_study(tmp_path / "sweep.yaml", seeds=[0, 1], stages=[2], methods=["async"], lr_sweep=sweep)
    ref, options, overrides = parse_args([f"study={path}", "lr_sweep=false", "resume=false"])
    options.pop("resume")
    study = load_study(ref, overrides, output_dir=str(tmp_path / "out"), **options)
    assert study.lr_sweep is None and len(plan_runs(study)) == 4  # two baselines, two async runs; no rate sweep
    assert len(plan_runs(load_study(str(path), output_dir=str(tmp_path / "out")))) == 4 + 2 * 2 * 2


@pytest.mark.parametrize("sweep, message", [
    ({"stages": 4, "seeds": [0]}, "must name stages, seeds, factors"),
    ({"stages": 3, "seeds": [0], "factors": [1, 2]}, "stages=3 must be one of stages"),
    ({"stages": 4, "seeds": [7], "factors": [1, 2]}, "among seeds"),
    ({"stages": 4, "seeds": [0], "factors": [0.5, 2]}, "include 1"),
])
def test_bad_rate_sweeps_stop_before_training(tmp_path, sweep, message):
    with pytest.raises(StudyError, match=message):
        load_study(str(write_study(tmp_path / "bad.yaml", lr_sweep=sweep)))


def test_checked_methods_train_at_the_check_seeds_and_are_compared_bit_for_bit(tmp_path, capsys):
    """checks: 1f1b and zb1p compute gpipe's updates, so they train at seed 0 only and the report checks that their
    runs are gpipe's; a checked method that is not the same (spectrain against async) fails the check and the
    command's exit code."""
    out = str(tmp_path / "out")
    checks = {"methods": ["1f1b", "zb1p"], "same_as": "gpipe", "seeds": [0]}
    path = write_study(tmp_path / "checks.yaml", seeds=[0, 1], stages=[2], methods=["gpipe", "async"], checks=checks)
    study = load_study(str(path), output_dir=out)
    names = [r.name for r in plan_runs(study)]
    assert len(names) == 2 + 2 * 2 + 2 and "zb1p-n2-seed0" in names and "zb1p-n2-seed1" not in names
    payload = run_study(study)
    assert [(r["method"], r["stages"], r["seed"], r["identical"]) for r in payload["checks"]] == [
        ("1f1b", 2, 0, True), ("zb1p", 2, 0, True)]
    assert "Checked: `1f1b` and `zb1p` trained at seed 0 only, and their runs are `gpipe`'s" in payload["markdown"]
    assert "| `1f1b`" not in payload["markdown"]  # gpipe's row stands for them
    wrong = {"methods": ["spectrain-paper"], "same_as": "async", "seeds": [0]}
    write_study(path, seeds=[0, 1], stages=[2], methods=["gpipe", "async"], checks=wrong)
    assert main([f"study={path}", f"output_dir={out}"]) == 1  # the other runs resume; spectrain trains
    err = capsys.readouterr().err
    assert "check failed, not the same runs as async: spectrain-paper N=2 seed 0" in err
    report = (tmp_path / "out" / "study.md").read_text()
    assert "**Check failed**: `spectrain-paper` at N=2, seed 0 is not `async`'s run" in report
    assert main([f"study={path}", f"output_dir={out}", "checks=false"]) == 0


@pytest.mark.parametrize("checks, message", [
    ({"methods": ["1f1b"], "seeds": [0]}, "must name methods, same_as, seeds"),
    ({"methods": ["async"], "same_as": "gpipe", "seeds": [0]}, "must not be"),
    ({"methods": ["1f1b"], "same_as": "zb1p", "seeds": [0]}, "must be one of methods"),
    ({"methods": ["1f1b"], "same_as": "gpipe", "seeds": [3]}, "among seeds"),
])
def test_bad_checks_stop_before_training(tmp_path, checks, message):
    with pytest.raises(StudyError, match=message):
        load_study(str(write_study(tmp_path / "bad.yaml", methods=["gpipe", "async"], checks=checks)))
    with pytest.raises(ConfigError, match="nosuch"):
        load_study(str(write_study(tmp_path / "bad.yaml", methods=["gpipe"],
                                   checks={"methods": ["nosuch"], "same_as": "gpipe", "seeds": [0]})))
