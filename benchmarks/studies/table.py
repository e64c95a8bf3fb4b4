"""The README's tables of the real-data accuracy studies, from their reports in ``results/studies/``.

    python -m benchmarks.studies.table [--stages 2,4]

Reads ``study_results.json`` of every label of ``benchmarks.studies.bench.runs(REAL)`` that has one (each study
at its swept rate and at a third of it) and prints, per stage count, the accuracy table in the layout of the
authors' (docs/design.md §6) with their 4-GPU numbers beside it, then SpecTrain's prediction figures.
Nothing is trained or written, so ``--quick`` is this same run.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from benchmarks._shared.results import RESULTS
from benchmarks.studies.bench import REAL, runs
from rayspec.cli.study_config import BASELINE
from rayspec.cli.study_report import PAPER_COLUMNS

_NAMES = {**PAPER_COLUMNS, "spectrain-paper-adaptive": "STv1 adaptive"}
COLUMNS = [(label, _NAMES[label]) for label in (BASELINE, "async", "pipedream", "spectrain-paper",
                                                "spectrain-paper-adaptive", "spectrain-consistent", "gpipe")]
"""Method labels and their columns: the study report's names for the authors' columns (docs/design.md §6), and
STv1 adaptive."""
PREDICTING = [(label, _NAMES[label]) for label in ("spectrain-paper", "spectrain-paper-adaptive", "spectrain-consistent")]
AUTHORS = {
    # docs/design.md §6, 4 GPUs: DP (2 GPUs), MP4, PD4, STv1_4, STv2_4; the study whose model it is
    "vgg16_fashion": ("VGG, CIFAR-10", [91.10, 88.31, 88.91, 88.11, 89.38]),
    "transformer_rt": ("Transformer, IMDb", [81.12, 77.26, 78.11, 79.71, 78.79]),
    "lstm_rt": ("LSTM, IMDb", [81.74, 78.11, 78.24, 81.24, 79.48]),
}


def _load(label: str) -> dict[str, Any] | None:
    path = RESULTS / "studies" / label / "study_results.json"
    return json.loads(path.read_text()) if path.exists() else None


def signed(value: float, digits: int = 1) -> str:
    """``value`` with its sign, a minus sign for negatives (as the README's tables write them)."""
    return f"{value:+.{digits}f}".replace("-", "\u2212")


def _cell(cell: dict[str, Any], baseline: bool) -> str:
    """``acc (Δ ± std)`` in %, points; the baseline's accuracy ± std."""
    if cell["ok"] == 0:
        return "diverged" if cell["diverged"] else "–"
    lost = f" ({cell['ok']}/{cell['runs']} ok)" if cell["ok"] < cell["runs"] else ""
    acc = 100 * cell["val_accuracy"]
    if baseline:
        return f"{acc:.1f} ± {100 * cell['val_accuracy_std']:.1f}{lost}"
    change, std = 100 * cell["val_accuracy_change"], 100 * cell["val_accuracy_change_std"]
    return f"{acc:.1f} ({signed(change)} ± {std:.1f}){lost}"


def _authors(name: str) -> list[str]:
    """The authors' 4-GPU row for the study's model, each method's change against their DP."""
    if name not in AUTHORS:
        return []
    what, (dp, *methods) = AUTHORS[name]
    mp, pd, st1, st2 = (f"*{v:.2f} ({signed(v - dp, 2)})*" for v in methods)
    return [f"| *authors, {what}, 4 GPUs* | *DP {dp:.2f}* | {mp} | {pd} | {st1} | – | {st2} | – |"]


def accuracy_table(reports: dict[str, tuple[str, dict[str, Any]]], n: int) -> list[str]:
    """One row per study and rate at ``n`` stages, the authors' row after each study's rows."""
    lines = ["| study (lr) | " + " | ".join(head for _, head in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    last = None
    for name, report in reports.values():
        if last is not None and name != last:
            lines += _authors(last)
        by = {(c["label"], c["stages"]): c for c in report["table"]}
        lr = report["settings"]["config"]["optim"]["lr"]
        row = [_cell(by[key, n], key == BASELINE) if (key, n) in by else "–" for key, _ in COLUMNS]
        lines.append(f"| {name} ({lr:.4g}) | " + " | ".join(row) + " |")
        last = name
    if last is not None:
        lines += _authors(last)
    return lines


def prediction_table(reports: dict[str, tuple[str, dict[str, Any]]], stages: list[int]) -> list[str]:
    """SpecTrain's prediction figures per study, rate and stage count (means over the predicting stages and seeds)."""
    heads = " / ".join(head for _, head in PREDICTING)
    lines = [f"| study (lr) | N | quality, {heads} | best scale of the paper's step | flipped coordinates | "
             f"quality on them, {heads} |", "|---|---|---|---|---|---|"]
    for name, report in reports.values():
        by = {(c["label"], c["stages"]): c for c in report["table"]}
        lr = report["settings"]["config"]["optim"]["lr"]
        for n in stages:
            cells = [by.get((key, n)) for key, _ in PREDICTING]
            if not any(c and c["ok"] and c["prediction_quality"] is not None for c in cells):
                continue

            def figure(c: dict[str, Any] | None, key: str, scale: float = 1.0, digits: int = 2) -> str:
                return "–" if not c or c.get(key) is None else f"{scale * c[key]:.{digits}f}"

            paper = cells[0]
            lines.append(f"| {name} ({lr:.4g}) | {n} | {' / '.join(figure(c, 'prediction_quality') for c in cells)} | "
                         f"{figure(paper, 'prediction_best_scale')} | "
                         f"{figure(paper, 'prediction_flipped_share', 100.0, 0)} % | "
                         f"{' / '.join(figure(c, 'prediction_quality_flipped') for c in cells)} |")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="2,4", help="comma-separated stage counts, a table each")
    ap.add_argument("--quick", action="store_true", help="the same: nothing is trained or written")
    args = ap.parse_args(argv)
    reports = {label: (name, report) for label, (name, _) in runs(REAL).items() if (report := _load(label))}
    for n in (int(x) for x in args.stages.split(",")):
        print(f"N={n}: final validation accuracy (%) and its change against the same seed's sequential run "
              "(points, mean ± std over 3 seeds)\n")
        print("\n".join(accuracy_table(reports, n)) + "\n")
    print("\n".join(prediction_table(reports, [int(x) for x in args.stages.split(",")])))


if __name__ == "__main__":
    main()
