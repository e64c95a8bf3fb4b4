"""Time to a target accuracy from runs' curves: targets, per-method rows, the printed table and the plot."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rayspec.cli.study_stats import score

__all__: list[str] = []

FRACTIONS = (0.95, 0.99)
"""The targets: these shares of the sequential baseline's mean score."""


def run_score(curve: Sequence[Sequence[float]]) -> float | None:
    """A run's score as the studies take it (``rayspec.cli.study_stats.score``, which reads the accuracy column
    only): ``curve`` rows ``[update, train_s, val_accuracy]``."""
    return score({"status": "ok", "curves": {"val": curve}})


def targets(baseline: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The target accuracies from the baseline's runs: ``FRACTIONS`` of the mean of their scores."""
    scores = [s for run in baseline if "error" not in run and (s := run_score(run["curve"])) is not None]
    if not scores:
        raise RuntimeError("no baseline run finished with a score; no target accuracy can be set")
    mean = statistics.fmean(scores)
    return {"baseline_score": mean, "baseline_scores": scores,
            "targets": {_key(f): f * mean for f in FRACTIONS}}


def time_to(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """The training seconds of the first evaluation whose accuracy reaches ``target``; None when none does."""
    return next((row[1] for row in curve if row[2] >= target), None)


def median(values: Sequence[float | None]) -> float | None:
    """The median with a run that did not reach the target counted as slower than every one that did: None when the
    median falls on such a run."""
    ranked = sorted(math.inf if v is None else v for v in values)
    if not ranked:
        return None
    mid = len(ranked) // 2
    m = ranked[mid] if len(ranked) % 2 else (ranked[mid - 1] + ranked[mid]) / 2
    return None if math.isinf(m) else m


def method_row(label: str, runs: Sequence[Mapping[str, Any]], goal: Mapping[str, float]) -> dict[str, Any]:
    """One method's figures over its seeds: per target the median time, each seed's time and the runs that did not
    reach it (failed runs included); seconds per update and the score."""
    row: dict[str, Any] = {"method": label, "seeds": [run["seed"] for run in runs],
                           "errors": {run["seed"]: run["error"] for run in runs if "error" in run}}
    for key, target in goal.items():
        times = [time_to(run["curve"], target) if "error" not in run else None for run in runs]
        row[key] = {"median_s": median(times), "per_seed_s": times,
                    "not_reached": sum(t is None for t in times)}
    done = [run for run in runs if "error" not in run and run["updates"]]
    row["s_per_update"] = statistics.median(run["train_s"] / run["updates"] for run in done) if done else None
    scores = [s for run in done if (s := run_score(run["curve"])) is not None]
    row["score"] = statistics.fmean(scores) if scores else None
    return row


def add_ratios(rows: list[dict[str, Any]], keys: Sequence[str]) -> None:
    """Each row's median time over the fastest row's, per target (None where a median is not reached)."""
    for key in keys:
        best = min((r[key]["median_s"] for r in rows if r[key]["median_s"] is not None), default=None)
        for r in rows:
            r[key]["ratio_to_best"] = (r[key]["median_s"] / best if best and r[key]["median_s"] is not None
                                       else None)


def _key(fraction: float) -> str:
    return f"to_{round(fraction * 100)}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def table_rows(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> list[dict[str, str]]:
    """The printed table's cells: per target the median [each seed] in seconds, the ratio to the best and the runs
    that did not reach it; seconds per update."""
    out = []
    for r in rows:
        cells = {"method": r["method"]}
        for key in keys:
            fig = r[key]
            per_seed = ", ".join(_seconds(v) for v in fig["per_seed_s"])
            cells[f"{key} s"] = f"{_seconds(fig['median_s'])} [{per_seed}]"
            cells[f"{key} x best"] = "-" if fig["ratio_to_best"] is None else f"{fig['ratio_to_best']:.2f}"
            cells[f"{key} missed"] = f"{fig['not_reached']}/{len(fig['per_seed_s'])}"
        cells["s/update"] = "-" if r["s_per_update"] is None else f"{r['s_per_update']:.4f}"
        out.append(cells)
    return out


def plot(payload: Mapping[str, Any], path: Path) -> Path:
    """Validation accuracy against training seconds: every seed's run thin, one colour per method (the baseline,
    first, black), the targets as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.get_cmap("tab10").colors  # then dotted: more methods than colours
    for i, (label, runs) in enumerate(payload["runs"].items()):
        colour, style = ("black", "-") if i == 0 else (colours[(i - 1) % 10], "-" if i <= 10 else ":")
        for j, run in enumerate(r for r in runs if r["curve"]):
            xs, ys = [row[1] for row in run["curve"]], [row[2] for row in run["curve"]]
            ax.plot(xs, ys, color=colour, linestyle=style, linewidth=0.9, alpha=0.8, label=label if j == 0 else None)
    for key, target in payload["targets"].items():
        ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(key.replace("to_", "") + " %", (0, target), fontsize=7, color="grey", va="bottom")
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"{payload['study']}: N={payload['settings']['stages']}, seeds {payload['settings']['seeds']}")
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
