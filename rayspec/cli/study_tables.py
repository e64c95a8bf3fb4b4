"""The protocol's tables and plots of a study report: scores with paired 95 % intervals, the noise-floor row, the
divergence counts, merged methods, updates to 95 % of the sequential accuracy, accuracy against the learning rate
and learning curves with a band over seeds.

The rules themselves (score, divergence, intervals) are ``rayspec.cli.study_stats``'s.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rayspec.cli.study_config import BASELINE, Study, run_name, sweep_rates
from rayspec.cli.study_stats import COLLAPSE_MARGIN, LAST_EVALUATIONS, collapsed, interval, paired, score, updates_to

__all__ = ["TARGET", "NOISE_FLOOR", "protocol_cells", "identical_groups", "check_rows", "protocol_lines", "sweep_rows",
           "sweep_lines", "plot_sweep", "plot_bands"]

TARGET = 0.95
"""Updates-to-target: the first evaluation at which a run reaches this share of the sequential mean score."""
NOISE_FLOOR = "gpipe"
"""The method whose difference to sequential training is rounding alone (same batches, same updates): its row
measures how far two runs of the same math drift apart, the floor below which no difference means anything."""


def _runs(study: Study, records: Mapping[str, dict[str, Any]], label: str, n: int,
          lr: float | None = None) -> list[dict[str, Any]]:
    stages = n if label != BASELINE or study.per_stage_baseline else 1
    return [records[name] for seed in study.seeds if (name := run_name(label, stages, seed, lr)) in records]


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def protocol_cells(study: Study, records: Mapping[str, dict[str, Any]],
                   chance: float | None = None) -> dict[tuple[str, int], dict[str, Any]]:
    """Per method and stage count: scores over seeds (diverged and collapsed runs counted, not averaged), paired
    differences to the same seed's sequential run with their 95 % t interval, and updates to ``TARGET`` of the
    sequential score. ``chance``: the accuracy of a constant prediction on the evaluation split (``collapsed``)."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for n in study.stages:
        base = [s for r in _runs(study, records, BASELINE, n) if (s := score(r)) is not None]
        target = TARGET * statistics.fmean(base) if base else None
        for label in [BASELINE, *study.methods]:
            every = _runs(study, records, label, n)
            runs = [r for r in every if not collapsed(r, chance)]
            scores = [s for r in runs if (s := score(r)) is not None]
            deltas = paired(runs, records) if label != BASELINE else []
            reached = [updates_to(r["curves"]["val"], target) for r in every if score(r) is not None] \
                if target is not None else []
            out[label, n] = {
                "label": label, "stages": n, "runs": len(every), "scored": len(scores),
                "diverged": sum(r["status"] == "diverged" for r in every),
                "collapsed": len(every) - len(runs), "chance": chance,
                "failed": sum(r["status"] == "failed" for r in every),
                "score": _mean(scores), "score_std": statistics.stdev(scores) if len(scores) > 1 else None,
                "delta": _mean(deltas), "delta_ci": interval(deltas), "pairs": len(deltas),
                "target": target, "updates_to_target": [u for u in reached if u is not None],
                "not_reached": sum(u is None for u in reached),
            }
    return out


def identical_groups(study: Study, records: Mapping[str, dict[str, Any]], n: int) -> list[list[str]]:
    """The methods grouped where their runs are identical on every seed at ``n`` stages (the same loss and
    validation curves, to the last bit): they compute the same updates there by construction (e.g. ``async`` and
    ``pipedream`` where the first stage's backward does not read its weights), so the report shows them as one."""
    groups: list[list[str]] = []
    for label in study.methods:
        mine = _runs(study, records, label, n)
        home = next((g for g in groups if _same(_runs(study, records, g[0], n), mine)), None)
        if home is None:
            groups.append([label])
        else:
            home.append(label)
    return groups


def _same(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> bool:
    return bool(a) and len(a) == len(b) and all(
        x["status"] == y["status"] != "failed" and x["seed"] == y["seed"] and x["curves"]["loss"] == y["curves"]["loss"]
        and x["curves"]["val"] == y["curves"]["val"] for x, y in zip(a, b))


def check_rows(study: Study, records: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The study's ``checks``, one row per checked method, stage count and seed: ``identical`` is True where its run
    equals ``same_as``'s run of that seed to the last bit (``_same``), False where it differs, None where either run
    is missing or failed."""
    if not study.checks:
        return []
    same, rows = study.checks["same_as"], []
    for label in study.checks["methods"]:
        for n in study.stages:
            for seed in study.checks["seeds"]:
                mine, theirs = records.get(run_name(label, n, seed)), records.get(run_name(same, n, seed))
                identical = None
                if mine and theirs and "failed" not in (mine["status"], theirs["status"]):
                    identical = _same([mine], [theirs])
                rows.append({"method": label, "same_as": same, "stages": n, "seed": seed, "identical": identical})
    return rows


def _check_line(rows: Sequence[dict[str, Any]], n: int) -> list[str]:
    """The protocol's sentence on the checks (``check_rows``) at ``n`` stages (none without checks)."""
    mine = [r for r in rows if r["stages"] == n]
    if not mine:
        return []
    same, seeds = mine[0]["same_as"], sorted({r["seed"] for r in mine})
    passed = sorted({r["method"] for r in mine} - {r["method"] for r in mine if r["identical"] is not True})
    lines = [""]
    if passed:
        names = " and ".join(f"`{m}`" for m in passed)
        lines.append(f"Checked: {names} trained at seed{'s' if len(seeds) > 1 else ''} "
                     f"{', '.join(map(str, seeds))} only, and their runs are `{same}`'s to the last bit at N={n} (the "
                     f"same updates by construction), so `{same}`'s row stands for them.")
    lines += [f"**Check failed**: `{r['method']}` at N={n}, seed {r['seed']} is not `{same}`'s run, so `{same}`'s row "
              "does not stand for it: train it at every seed (add it to methods)." for r in mine if r["identical"] is False]
    lines += [f"Not checked: `{r['method']}` at N={n}, seed {r['seed']} (a run missing or failed)." for r in mine
              if r["identical"] is None]
    return lines


def _pct(value: float | None, std: float | None = None) -> str:
    if value is None:
        return "–"
    return f"{100 * value:.2f}" + (f" ± {100 * std:.2f}" if std is not None else "")


def _delta(cell: Mapping[str, Any]) -> str:
    if cell["delta"] is None:
        return "–"
    ci = cell["delta_ci"]
    span = f" [{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}]" if ci else ""
    return f"{100 * cell['delta']:+.2f}{span}"


def _reach(cell: Mapping[str, Any]) -> str:
    got = cell["updates_to_target"]
    text = f"{statistics.median(got):.0f}" if got else "–"
    return text + (f" ({cell['not_reached']} not)" if cell["not_reached"] else "")


def protocol_lines(study: Study, records: Mapping[str, dict[str, Any]], chance: float | None = None) -> list[str]:
    """The protocol's table per stage count, in markdown (``chance``: ``protocol_cells``)."""
    cells = protocol_cells(study, records, chance)
    checks = check_rows(study, records)
    fell = "" if chance is None else (
        f"; collapsed: runs whose score ended within {100 * COLLAPSE_MARGIN:.0f} point of always predicting the "
        f"evaluation split's most frequent class ({100 * chance:.1f} %), counted and never averaged")
    lines = [f"Score: the mean validation accuracy of the last {LAST_EVALUATIONS} evaluations (%), mean ± sample std "
             "over seeds; Δ: the paired difference to the same seed's sequential run (points) with its 95 % t "
             f"interval; diverged: runs whose training loss turned non-finite or exceeded 3x its first value (counted,"
             f" never averaged){fell}; updates to {100 * TARGET:.0f} %: the median first evaluated update at which a "
             f"run reached {100 * TARGET:.0f} % of the sequential mean score. `{NOISE_FLOOR}` computes sequential "
             "SGD's updates and differs only by rounding: its row is the noise floor.", ""]
    for n in study.stages:
        groups = identical_groups(study, records, n)
        lines += [f"N = {n} stages:", "", "| method | score % | Δ vs sequential [95 % CI] | diverged | "
                  + ("collapsed | " if fell else "") + f"updates to {100 * TARGET:.0f} % |",
                  "|---|---|---|---|---|" + ("---|" if fell else "")]
        rows = [[BASELINE]] + sorted(groups, key=lambda g: g[0] != NOISE_FLOOR)
        for group in rows:
            c = cells[group[0], n]
            name = " = ".join(f"`{g}`" for g in group) + (" (noise floor)" if group[0] == NOISE_FLOOR else "")
            fallen = f"{c['collapsed']} of {c['runs']} | " if fell else ""
            lines.append(f"| {name} | {_pct(c['score'], c['score_std'])} | {_delta(c)} | {c['diverged']} of "
                         f"{c['runs']} | {fallen}{_reach(c)} |")
        merged = [g for g in groups if len(g) > 1]
        if merged:
            lines += ["", "Merged: " + "; ".join(" = ".join(g) for g in merged) + f" at N={n}: their runs are "
                      "identical on every seed (the same updates by construction), so they are one row."]
        lines += _check_line(checks, n)
        lines.append("")
    return lines


def sweep_rows(study: Study, records: Mapping[str, dict[str, Any]],
               chance: float | None = None) -> list[dict[str, Any]]:
    """The rate sweep: per method and rate, the mean score over the sweep's seeds (collapsed runs included: at a
    rate, collapsing is the outcome) and the diverged and collapsed counts."""
    sweep = study.lr_sweep
    if sweep is None:
        return []
    rows = []
    for label in [BASELINE, *study.methods]:
        for factor, lr in zip(sweep["factors"], sweep_rates(study)):
            stages = sweep["stages"] if label != BASELINE or study.per_stage_baseline else 1
            runs = [records[name] for seed in sweep["seeds"] if (name := run_name(label, stages, seed, lr)) in records]
            scores = [s for r in runs if (s := score(r)) is not None]
            rows.append({"label": label, "factor": factor, "lr": runs[0]["lr"] if runs else lr, "runs": len(runs),
                         "score": _mean(scores), "diverged": sum(r["status"] == "diverged" for r in runs),
                         "collapsed": sum(collapsed(r, chance) for r in runs)})
    return rows


def sweep_lines(study: Study, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The sweep's table: a row per method, a column per rate."""
    if not rows or study.lr_sweep is None:
        return []
    sweep = study.lr_sweep
    factors = list(sweep["factors"])
    by = {(r["label"], r["factor"]): r for r in rows}
    lines = [f"Accuracy against the learning rate at N = {sweep['stages']} (score %, mean over seeds "
             f"{sweep['seeds']}; `d`: diverged runs, `c`: collapsed runs, in the mean), rates as multiples of the "
             "study's ([`accuracy_vs_lr.png`]"
             "(accuracy_vs_lr.png)):", "", "| method | " + " | ".join(f"{f:g}x" for f in factors) + " |",
             "|---|" + "---|" * len(factors)]
    for label in dict.fromkeys(r["label"] for r in rows):
        cells = [by[label, f] for f in factors]
        marks = [" ".join(f"{c[k]} {k[0]}" for k in ("diverged", "collapsed") if c.get(k)) for c in cells]
        lines.append(f"| `{label}` | " + " | ".join(_pct(c["score"]) + (f" ({m})" if m else "")
                                                    for c, m in zip(cells, marks)) + " |")
    return [*lines, ""]


def plot_sweep(study: Study, rows: Sequence[Mapping[str, Any]], directory: Path) -> list[Path]:
    """``accuracy_vs_lr.png``: each method's mean score against the learning rate (log axis)."""
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, label in enumerate(dict.fromkeys(r["label"] for r in rows)):
        mine = [r for r in rows if r["label"] == label and r["score"] is not None]
        ax.plot([r["lr"] for r in mine], [100 * r["score"] for r in mine], marker="o", lw=1.2,
                color="black" if label == BASELINE else plt.get_cmap("tab10")(i), label=label,
                ls="--" if label == BASELINE else "-")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel(f"score (mean of last {LAST_EVALUATIONS} evaluations, %)")
    ax.set_title(f"{study.name}: N={study.lr_sweep['stages'] if study.lr_sweep else '?'}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = directory / "accuracy_vs_lr.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_bands(study: Study, records: Mapping[str, dict[str, Any]], directory: Path) -> list[Path]:
    """``learning_curves_n{N}.png`` per stage count: validation accuracy against updates per method, the mean over
    seeds and a band from the lowest to the highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for n in study.stages:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for i, label in enumerate([BASELINE, *study.methods]):
            curves = [r["curves"]["val"] for r in _runs(study, records, label, n) if r["status"] == "ok"]
            if not curves:
                continue
            steps = sorted(set.intersection(*({row[0] for row in c} for c in curves)))
            values = [[{row[0]: 100 * row[2] for row in c}[s] for c in curves] for s in steps]
            color = "black" if label == BASELINE else plt.get_cmap("tab10")(i)
            ax.plot(steps, [statistics.fmean(v) for v in values], color=color, lw=1.2, label=f"{label} ({len(curves)})",
                    ls="--" if label == BASELINE else "-")
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.12)
        ax.set_xlabel("update")
        ax.set_ylabel("val accuracy (%)")
        ax.set_title(f"{study.name}: N={n} stages (band: lowest to highest seed)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        paths.append(directory / f"learning_curves_n{n}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
