"""Result files and printed tables: ``benchmarks/results/NAME.json``, or a scratch folder for a ``--quick`` run."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"
"""The committed results: a full run's file per benchmark (``NAME.json``), the studies' reports in ``studies/``."""
QUICK_RESULTS = Path(tempfile.gettempdir()) / "rayspec-benchmarks"
"""Where a ``--quick`` run writes, so that a smoke run never overwrites the committed results."""


def results_dir(quick: bool) -> Path:
    """The folder a run writes to: ``QUICK_RESULTS`` for a ``--quick`` run, else ``RESULTS``."""
    return QUICK_RESULTS if quick else RESULTS


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {gpu}, torch {torch.__version__}"


def commit() -> str | None:
    """The checkout's commit (``git describe``: short hash, ``-dirty`` with local changes); None outside git."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=RESULTS.parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def write(name: str, payload: dict, *, quick: bool = False) -> Path:
    """Write ``NAME.json`` with the machine, date and commit in front of ``payload``; ``quick``: to ``QUICK_RESULTS``."""
    folder = results_dir(quick)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    payload = {"benchmark": name, "machine": machine(), "date": time.strftime("%Y-%m-%d"), "commit": commit(),
               **payload}
    path.write_text(json.dumps(payload, indent=2))
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(f"{r[c]}") for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(f"{r[c]}".ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)
