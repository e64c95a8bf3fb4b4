"""The ``rayspec`` console script: each command equals ``python -m rayspec.COMMAND``, and every command reads
Hydra-style ``key=value`` arguments."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from rayspec.cli.common import parse_overrides
from rayspec.cli.main import COMMANDS, main


def python_m(command: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"rayspec.{command}", *args], capture_output=True, text=True,
                          timeout=300)


def test_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name}" in out for name in ("train", "tune", "study", "schedule")) and set(COMMANDS) == {
        "train", "tune", "study", "schedule"}


@pytest.mark.parametrize("argv", [[], ["fit"], ["--stages", "4"]])
def test_no_command_or_an_unknown_one_prints_usage_and_exits_2(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("usage: rayspec COMMAND") == 1 and ("unknown command" in err) == bool(argv)


def test_schedule_equals_python_m(capsys):
    args = ["schedule=1f1b", "stages=3", "microbatches=4", "method=spectrain", "variant=consistent"]
    assert main(["schedule", *args]) == 0
    assert capsys.readouterr().out == python_m("schedule", *args).stdout
    assert main(["schedule", "stages=2", "microbatches=2", "json=true"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2 * 2 * 2
    assert main(["schedule", "stages=0"]) == 2
    assert "stages=0" in capsys.readouterr().err
    assert main(["schedule", "--stages", "4"]) == 2  # one style: key=value, as every command
    assert "write stages=VALUE" in capsys.readouterr().err
    assert main(["schedule", "stage=4"]) == 2
    assert "unknown key 'stage'; did you mean stages?" in capsys.readouterr().err
    assert main(["schedule", "schedule=zb1"]) == 2  # an unknown name: a ConfigError, reported as bad input
    assert "schedule='zb1' is unknown; choose one of vanilla" in capsys.readouterr().err


@pytest.mark.parametrize("command, kind, listed, choices", [
    ("tune", "sweep", "available sweeps: lr_method", "choose one of lr_method"),
    ("study", "study", "available studies: fashion, lstm_rt, lstm_text", "choose one of fashion, lstm_rt, lstm_text")])
def test_tune_and_study_help_and_bad_input(capsys, command, kind, listed, choices):
    assert main([command, "--help"]) == 0
    assert listed in capsys.readouterr().out
    assert main([command, f"{kind}=no_such_file"]) == 2
    err = capsys.readouterr().err
    assert f"{kind}='no_such_file' is unknown in" in err and choices in err
    assert main([command, f"{kind}=no_such_file.yaml"]) == 2
    assert f"{kind}=no_such_file.yaml not found" in capsys.readouterr().err


def test_train_runs_as_python_m_does(tmp_path, capsys):
    """``rayspec train`` hands every argument to Hydra: ``--cfg job`` prints what ``python -m rayspec.train``
    prints, a smoke run writes its run directory, bad input exits with 2."""
    args = ["--cfg", "job", "+experiment=lstm_imdb", "debug=smoke", "pipeline.stages=2"]
    assert main(["train", *args]) == 0
    printed = capsys.readouterr().out
    assert printed == python_m("train", *args).stdout and "residual_lstm" in printed
    assert main(["train", "debug=smoke", "pipeline.executor=local", f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["updates"] == 4
    with pytest.raises(SystemExit) as exited:
        main(["train", "pipeline.stages=9", "model.size=tiny", f"hydra.run.dir={tmp_path / 'bad'}"])
    assert exited.value.code == 2


def test_arguments_are_hydra_overrides():
    keys, text = ("study", "stages", "resume", "output_dir", "limit"), ("study", "output_dir")
    options, overrides = parse_overrides(
        ["study=2024", "stages=[2, 4]", "resume=false", "output_dir='a b'", "limit=null", "+model.dropout=0.1",
         "~train.clip", "optim.lr=1e-3"], keys, text, "usage", ValueError)
    assert options == {"study": "2024", "stages": [2, 4], "resume": False, "output_dir": "a b", "limit": None}
    assert overrides == ["+model.dropout=0.1", "~train.clip", "optim.lr=1e-3"]  # as written, for Hydra to compose
    for bad, message in [("stages", "is not a Hydra override key=value"), ("--resume", "write resume=VALUE"),
                         ("+resume=true", "give the option resume as resume=VALUE"),
                         ("stages=2,4", "give the option stages as stages=VALUE, one value or a list [a,b]")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_overrides([bad], keys, text, "usage", ValueError)
