"""The scripts in examples/ run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # eight trainings in a subprocess
def test_compare_methods_runs():
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_methods.py"), "--steps", "20"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if "val_accuracy" in line]
    assert [line.split()[0] for line in lines] == ["vanilla", "gpipe", "1f1b", "zb1p", "async", "pipedream", "pipedream-2bw",
                                                       "spectrain"]


def test_custom_model_trains_in_one_process():
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_model.py"), "--executor", "local",
                          "--steps", "20"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "local  spectrain on 3 stages" in res.stdout and "val_accuracy" in res.stdout


@pytest.mark.slow  # a local Ray with a driver actor and three stage actors: 1-2 minutes on 2 busy cores
def test_custom_model_trains_on_ray_as_in_one_process(tmp_path):
    """The model's classes live in the script's ``__main__``: Ray ships them to the driver and stage actors."""
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_model.py"), "--steps", "20"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ray    spectrain on 3 stages" in res.stdout and "local and ray weights equal: True" in res.stdout
