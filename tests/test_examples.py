"""The scripts in examples/ run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_compare_methods_runs():
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_methods.py"), "--steps", "20"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if "val_accuracy" in line]
    assert [line.split()[0] for line in lines] == ["vanilla", "gpipe", "async", "pipedream", "spectrain"]
