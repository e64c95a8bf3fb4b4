"""The statistics of a study's protocol: a run's score, the divergence rule, paired differences with t intervals
and updates to a target accuracy.

Everything here reads run records (``run.json``, ``rayspec.cli.study_run``) and nothing else, so the rules can be
tested on records made by hand.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["LAST_EVALUATIONS", "DIVERGENCE_FACTOR", "COLLAPSE_MARGIN", "score", "diverged_at", "collapsed", "paired",
           "t_quantile", "interval", "updates_to"]

LAST_EVALUATIONS = 3
"""A run's score is the mean validation accuracy of its last this many evaluations (less noisy than the last one)."""
DIVERGENCE_FACTOR = 3.0
"""A run whose training loss exceeds this multiple of its first logged loss (or turns non-finite) diverged."""

COLLAPSE_MARGIN = 0.01
"""A run whose score is within this of ``chance`` (the accuracy of always predicting the evaluation split's most
frequent class) collapsed: it ended no better than a constant prediction, whatever its loss did on the way."""

_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
         25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}
"""The 0.975 quantile of Student's t by degrees of freedom (two-sided 95 %); above 120: the normal's 1.960."""


def score(record: Mapping[str, Any]) -> float | None:
    """The mean validation accuracy of the last ``LAST_EVALUATIONS`` evaluations of a run that finished ``ok``."""
    val = record.get("curves", {}).get("val") or []
    if record.get("status") != "ok" or not val:
        return None
    last = [row[2] for row in val[-LAST_EVALUATIONS:]]
    return statistics.fmean(last) if all(math.isfinite(a) for a in last) else None


def diverged_at(losses: Sequence[Sequence[float]], factor: float = DIVERGENCE_FACTOR) -> tuple[int, float] | None:
    """The first ``(update, loss)`` of a loss curve ``[[update, loss], ...]`` that is non-finite or above ``factor``
    times the first logged loss; None when there is none."""
    if not losses:
        return None
    first = losses[0][1]
    for step, loss in losses:
        if not math.isfinite(loss) or (math.isfinite(first) and loss > factor * first):
            return int(step), loss
    return None


def collapsed(record: Mapping[str, Any], chance: float | None, margin: float = COLLAPSE_MARGIN) -> bool:
    """Whether a scored run ended no better than a constant prediction: its score at most ``chance + margin``
    (``chance``: None when the study does not know it; then no run collapsed)."""
    s = score(record)
    return chance is not None and s is not None and s <= chance + margin


def t_quantile(df: int) -> float:
    """Student's t 0.975 quantile at ``df`` degrees of freedom (the nearest tabulated ``df`` at or below)."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    return _T975[max(k for k in _T975 if k <= df)] if df <= 120 else 1.960


def interval(values: Sequence[float]) -> tuple[float, float] | None:
    """The 95 % confidence interval of the mean of ``values`` (t distribution, ``n - 1`` degrees of freedom); None
    for fewer than two values."""
    if len(values) < 2:
        return None
    mean, half = statistics.fmean(values), t_quantile(len(values) - 1) * statistics.stdev(values) / math.sqrt(
        len(values))
    return mean - half, mean + half


def paired(records: Sequence[Mapping[str, Any]], references: Mapping[str, Mapping[str, Any]]) -> list[float]:
    """Score differences of each ``ok`` run against its own baseline run (``record["reference"]``), where both
    have a score."""
    out = []
    for r in records:
        ref = references.get(r.get("reference") or "")
        mine, theirs = score(r), (score(ref) if ref is not None else None)
        if mine is not None and theirs is not None:
            out.append(mine - theirs)
    return out


def updates_to(curve: Sequence[Sequence[float]], target: float) -> int | None:
    """The first evaluated update whose validation accuracy (``curve`` rows ``[update, loss, accuracy]``) reaches
    ``target``; None when none does."""
    return next((int(row[0]) for row in curve if row[2] >= target), None)
