"""The report of a study: mean ± std tables per method and stage count, learning-curve plots, ``study_results.json``."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rayspec.cli.study_config import BASELINE, RunSpec, Study, predicts, run_name, study_settings
from rayspec.cli.study_stats import collapsed
from rayspec.cli.study_tables import (
    check_rows,
    plot_bands,
    plot_sweep,
    protocol_cells,
    protocol_lines,
    sweep_lines,
    sweep_rows,
)
from rayspec.config import from_mapping
from rayspec.config.compose import compose
from rayspec.training.prepare import run_data

__all__ = ["cells", "markdown", "plot_curves", "write_report"]

PAPER_COLUMNS = {BASELINE: "SEQ", "async": "MP", "pipedream": "PD", "spectrain-paper": "STv1",
                 "spectrain-consistent": "STv2", "gpipe": "GP"}
"""docs/design.md §6's column names (MP: 1F1B without stashing, PD: PipeDream, ST: SpecTrain v1/v2; SEQ and GP ours)."""
METRICS = ("val_accuracy", "val_loss", "distance", "mean_distance", "prediction_quality", "prediction_best_scale",
           "prediction_quality_flipped", "prediction_quality_kept", "prediction_flipped_share")


def _labels(study: Study) -> list[str]:
    return [BASELINE, *study.methods]


def _records_of(study: Study, records: Mapping[str, dict[str, Any]], label: str, n: int) -> list[dict[str, Any]]:
    """The records of one table cell, one per seed; the baseline's cell at ``n`` holds the baseline it is compared with."""
    stages = n if label != BASELINE or study.per_stage_baseline else 1
    return [records[name] for seed in study.seeds if (name := run_name(label, stages, seed)) in records]


def cells(study: Study, records: Mapping[str, dict[str, Any]], chance: float | None = None) -> list[dict[str, Any]]:
    """One entry per method and stage count: mean and sample std over seeds of each final figure, and run counts.
    Runs that diverged or failed are counted, not averaged; runs that collapsed (``chance``:
    ``rayspec.cli.study_stats.collapsed``) are averaged in and counted, so that the table says so (the protocol's
    table leaves them out)."""
    out = []
    for label in _labels(study):
        for n in study.stages:
            runs = _records_of(study, records, label, n)
            ok = [r for r in runs if r["status"] == "ok"]
            cell: dict[str, Any] = {"label": label, "stages": n, "runs": len(runs), "ok": len(ok),
                                    "diverged": sum(r["status"] == "diverged" for r in runs),
                                    "failed": sum(r["status"] == "failed" for r in runs),
                                    "collapsed": sum(collapsed(r, chance) for r in ok)}
            # paired with the same seed's baseline: the seeds' spread (data, initial weights) cancels
            deltas = [r["final"]["val_accuracy"] - ref["final"]["val_accuracy"] for r in ok
                      if r["reference"] and (ref := records.get(r["reference"])) and ref["status"] == "ok"
                      and r["final"].get("val_accuracy") is not None and ref["final"].get("val_accuracy") is not None]
            for metric, values in [*((m, [r["final"][m] for r in ok if r["final"].get(m) is not None]) for m in METRICS),
                                   ("val_accuracy_change", deltas)]:
                cell[metric] = statistics.fmean(values) if values else None
                cell[f"{metric}_std"] = statistics.stdev(values) if len(values) > 1 else (0.0 if values else None)
            per_stage: dict[int, list[float]] = {}
            for r in ok:
                for st in r["final"].get("prediction_stages", []):
                    per_stage.setdefault(st["stage"], []).append(st["quality"])
            cell["prediction_quality_per_stage"] = {k: statistics.fmean(v) for k, v in sorted(per_stage.items())}
            out.append(cell)
    return out


def _number(value: float | None, std: float | None, scale: float = 1.0, digits: int = 2) -> str:
    if value is None:
        return "–"
    if scale == 1.0 and abs(value) and abs(value) < 1e-3:  # small distances; percentages keep their digits
        text = f"{value:.1e}"
        return text if not std else f"{text} ± {std:.0e}"
    text = f"{value * scale:.{digits}f}"
    return text if std is None else f"{text} ± {std * scale:.{digits}f}"


def _entry(cell: dict[str, Any], metric: str, scale: float = 1.0, digits: int = 2) -> str:
    if cell["runs"] == 0:
        return "–"
    if cell["ok"] == 0:
        return "diverged" if cell["diverged"] else "failed"
    text = _number(cell[metric], cell[f"{metric}_std"] if cell["ok"] > 1 else None, scale, digits)
    lost = [f"{cell[k]}/{cell['runs']} {k}" for k in ("diverged", "failed") if cell[k]]
    if cell.get("collapsed"):  # records written before the collapse count have none
        lost.append(f"{cell['collapsed']}/{cell['runs']} collapsed, in the mean")
    return text + (f" ({', '.join(lost)})" if lost else "")


def _signed(cell: dict[str, Any]) -> str:
    """The cell's mean paired accuracy change in points, with a sign."""
    entry = _entry(cell, "val_accuracy_change", 100.0)
    return f"+{entry}" if cell["ok"] and cell["val_accuracy_change"] is not None and cell["val_accuracy_change"] >= 0 \
        else entry


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _baseline_note(study: Study) -> str:
    if study.per_stage_baseline:
        return ("`sequential` is `vanilla` (sequential training), trained once per seed and stage count: the model has "
                "dropout, and each stage draws its masks from its own random stream, so every method is compared "
                "with the baseline that drew the same masks.")
    return ("`sequential` is `vanilla` (sequential training), trained once per seed on one stage: a vanilla pipeline "
            "is bit-exactly sequential training at any stage count (tests/test_stage.py), so its row is the same at "
            "every N.")


def _optimizer(o: Mapping[str, Any]) -> str:
    """The optimizer's settings in words (``sgd`` where a study's config predates ``optim.name``)."""
    name = o.get("name", "sgd")
    if name == "sgd":
        return f"SGD lr {o['lr']} momentum {o['momentum']} weight decay {o['weight_decay']}"
    betas = ", ".join(str(b) for b in o["betas"])
    kind = "decoupled" if name == "adamw" else "L2"
    return f"{'AdamW' if name == 'adamw' else 'Adam'} lr {o['lr']} betas ({betas}) eps {o['eps']} weight decay " \
           f"{o['weight_decay']} ({kind})"


def markdown(study: Study, table: Sequence[dict[str, Any]], settings: Mapping[str, Any],
             protocol: Sequence[str] = ()) -> str:
    """The study's tables in markdown, with the settings they were measured with; ``protocol``: the protocol's
    tables (``rayspec.cli.study_tables``), placed first."""
    c = settings["config"]
    t, o, p = c["train"], c["optim"], c["pipeline"]
    by = {(x["label"], x["stages"]): x for x in table}
    size = c["model"].get("size", "full")
    data = ", ".join(f"{k}={v}" for k, v in c["data"].items() if k not in ("name", "root"))
    lines = [f"## Study `{study.name}`", ""]
    if study.description:
        lines += [study.description, ""]
    lines += [
        f"{c['model']['name']} ({size}) on {c['data']['name']} ({data}); {t['max_steps']} updates of batch "
        f"{t['batch_size']}, {_optimizer(o)}"
        + (f", gradients clipped to norm {o['clip_grad_norm']}" if o.get("clip_grad_norm") else "")
        + (f", precision {t['precision']}" if t.get("precision", "fp32") != "fp32" else "")
        + f", {o['schedule']} schedule (power {o['power']}), gpipe with {p['microbatches']} micro-batches; "
        f"evaluation every {t['eval_every']} updates on the {c['data'].get('eval_split', 'test')} split; executor "
        f"{p['executor']}; seeds {study.seeds} (mean ± sample std over seeds).",
        "",
        _baseline_note(study),
        "Every evaluation drains the pipeline (like a GPipe flush) and refills it afterwards.",
        "",
        *protocol,
        "Final validation accuracy (%) and loss (the last evaluation only; diverged runs left out, collapsed runs "
        "averaged in and counted: the protocol's table above leaves them out):",
        "",
    ]
    header = ["method"] + [f"{h} N={n}" for n in study.stages for h in ("val acc %", "val loss")]
    rows = [[f"`{label}`"] + [e for n in study.stages for e in (_entry(by[label, n], "val_accuracy", 100.0),
                                                                  _entry(by[label, n], "val_loss", 1.0, 3))]
            for label in _labels(study)]
    lines += _table(header, rows)
    lines += ["", "Change of the final validation accuracy against the same seed's sequential run (points; the "
              "spread over seeds of the data and initial weights cancels):", ""]
    header = ["method"] + [f"Δ val acc N={n}" for n in study.stages]
    rows = [[f"`{label}`"] + [_signed(by[label, n]) for n in study.stages] for label in study.methods]
    lines += _table(header, rows)
    lines += ["", "Relative distance of the weights to the sequential run's, ‖W(t) − W_seq(t)‖ / ‖W_seq(t)‖ "
              "(same seed, at each evaluation): at the end, and the mean over evaluations:", ""]
    header = ["method"] + [f"{h} N={n}" for n in study.stages for h in ("final", "mean over t")]
    rows = [[f"`{label}`"] + [e for n in study.stages for e in (_entry(by[label, n], "distance", 1.0, 3),
                                                                  _entry(by[label, n], "mean_distance", 1.0, 3))]
            for label in study.methods]
    lines += _table(header, rows)
    lines += _prediction_lines(study, by)
    lines += _paper_lines(study, by, c, size)
    return "\n".join(lines) + "\n"


def _prediction_lines(study: Study, by: Mapping[tuple[str, int], dict[str, Any]]) -> list[str]:
    """The table of SpecTrain's prediction quality per method and stage count (none without a predicting method)."""
    predicting = [label for label in study.methods if predicts(label)]
    if not predicting:
        return []
    lines = ["", "SpecTrain's prediction quality, ‖W_pred − W*‖ / ‖W_stale − W*‖ against the weights W* each stage "
              "really held at the predicted version, on a fixed sample of each stage's weights (0: perfect, 1: no "
              "better than the stale weights; `rayspec.core.predict`): over the run, the mean over the predicting "
              "stages and per stage (s0/s1/...); the best scale, the multiple of the paper's step "
              "(`s` times the optimizer's next step; SGD: `s·lr·v`) that would have landed closest (below 1: the "
              "paper's step overshoots); and the quality on the flipped coordinates, whose direction (SGD: "
              "velocity) changed sign before the target version, and on the "
              "others (kept), with the flipped share of the coordinates:", ""]
    heads = ("quality", "per stage", "best scale", "flipped", "kept", "flipped share %")
    header = ["method"] + [f"{h} N={n}" for n in study.stages for h in heads]
    rows = [[f"`{label}`"] + [e for n in study.stages for e in (
                _entry(by[label, n], "prediction_quality", 1.0, 3),
                " / ".join(f"{q:.2f}" for q in by[label, n]["prediction_quality_per_stage"].values()) or "–",
                _entry(by[label, n], "prediction_best_scale", 1.0, 2),
                _entry(by[label, n], "prediction_quality_flipped", 1.0, 2),
                _entry(by[label, n], "prediction_quality_kept", 1.0, 2),
                _entry(by[label, n], "prediction_flipped_share", 100.0, 0))]
            for label in predicting]
    lines += _table(header, rows)
    return lines


def _paper_lines(study: Study, by: Mapping[tuple[str, int], dict[str, Any]], c: Mapping[str, Any],
                 size: str) -> list[str]:
    """The study's accuracies in the layout of the authors' table (docs/design.md §6), where its methods are there."""
    columns = [(label, n) for n in study.stages for label in _labels(study) if label in PAPER_COLUMNS]
    if not columns:
        return []
    lines = ["", "In docs/design.md §6's layout (val accuracy %; MP = `async`, PD = `pipedream`, STv1/STv2 = "
              "`spectrain-paper`/`-consistent`, GP = `gpipe`, SEQ = `sequential`):", ""]
    header = ["workload"] + [f"{PAPER_COLUMNS[label]}_{n}" if "ST" in PAPER_COLUMNS[label] else f"{PAPER_COLUMNS[label]}{n}"
                            for label, n in columns]
    row = [f"{c['model']['name']} {size}"] + [_entry(by[k], "val_accuracy", 100.0, 1).split(" (")[0]
                                              + ("†" if by[k].get("collapsed") else "") for k in columns]
    lines += _table(header, [row])
    if any(by[k].get("collapsed") for k in columns):
        lines += ["", "† averages runs that collapsed (counted in the final-figures table above)."]
    return lines


def _mean_curve(series: Sequence[Sequence[Sequence[float]]], column: int) -> tuple[list[float], list[float]]:
    """Steps and the mean over runs of ``column``, at the steps every run has."""
    if not series:
        return [], []
    steps = sorted(set.intersection(*({row[0] for row in s} for s in series)))
    values = [{row[0]: row[column] for row in s} for s in series]
    return steps, [statistics.fmean(v[step] for v in values) for step in steps]


def plot_curves(study: Study, records: Mapping[str, dict[str, Any]], directory: Path) -> list[Path]:
    """``learning_curves.png`` (val accuracy and train loss against updates, a panel per stage count) and
    ``distance.png`` (relative weight distance to the sequential run), means over the seeds that finished."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = _labels(study)
    colors = {label: plt.get_cmap("tab10")(i) for i, label in enumerate(labels)}
    width = 5.0 * len(study.stages)
    fig, axes = plt.subplots(2, len(study.stages), figsize=(width, 7.5), squeeze=False, sharex=True)
    dist_fig, dist_axes = plt.subplots(1, len(study.stages), figsize=(width, 3.8), squeeze=False, sharey=True)
    for j, n in enumerate(study.stages):
        for label in labels:
            ok = [r for r in _records_of(study, records, label, n) if r["status"] == "ok"]
            style = {"color": "black" if label == BASELINE else colors[label], "lw": 1.6 if label == BASELINE else 1.2,
                     "ls": "--" if label == BASELINE else "-", "label": f"{label} ({len(ok)} seeds)"}
            for row, (key, column) in enumerate((("val", 2), ("loss", 1))):
                steps, mean = _mean_curve([r["curves"][key] for r in ok], column)
                if steps:
                    axes[row][j].plot(steps, [100 * v for v in mean] if key == "val" else mean, **style)
            steps, mean = _mean_curve([r["curves"]["distance"] for r in ok], 1)
            if steps and label != BASELINE:
                dist_axes[0][j].plot(steps, mean, **style)
        axes[0][j].set_title(f"{study.name}: N={n} stages")
        axes[0][j].set_ylabel("val accuracy (%)")
        axes[1][j].set_ylabel("train loss")
        axes[1][j].set_yscale("log")
        axes[1][j].set_xlabel("update")
        dist_axes[0][j].set_title(f"{study.name}: N={n} stages")
        dist_axes[0][j].set_xlabel("update")
        dist_axes[0][j].set_yscale("log")
        for ax in (axes[0][j], axes[1][j], dist_axes[0][j]):
            ax.grid(alpha=0.3)
    dist_axes[0][0].set_ylabel("‖W − W_seq‖ / ‖W_seq‖")
    for ax, where in ((axes[0][0], "lower right"), (dist_axes[0][0], "best")):
        if ax.get_legend_handles_labels()[0]:  # nothing to name when every run diverged
            ax.legend(fontsize=8, loc=where)
    fig.tight_layout()
    dist_fig.tight_layout()
    paths = [directory / "learning_curves.png", directory / "distance.png"]
    fig.savefig(paths[0], dpi=110)
    dist_fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    plt.close(dist_fig)
    return paths + _plot_prediction(study, records, directory, colors, plt)


def _plot_prediction(study: Study, records: Mapping[str, dict[str, Any]], directory: Path, colors: Mapping[str, Any],
                     plt: Any) -> list[Path]:
    """``prediction.png``: SpecTrain's prediction quality and best scale over training, a column per stage count."""
    predicting = [label for label in study.methods if predicts(label)]
    if not predicting:
        return []
    fig, axes = plt.subplots(2, len(study.stages), figsize=(5.0 * len(study.stages), 6.5), squeeze=False, sharex=True)
    for j, n in enumerate(study.stages):
        for label in predicting:
            ok = [r for r in _records_of(study, records, label, n) if r["status"] == "ok"]
            for row, column in enumerate((1, 2)):
                steps, mean = _mean_curve([r["curves"].get("prediction", []) for r in ok], column)
                if steps:
                    axes[row][j].plot(steps, mean, color=colors[label], lw=1.2, label=f"{label} ({len(ok)} seeds)")
        axes[0][j].axhline(1.0, color="black", lw=0.8, ls=":")
        axes[1][j].axhline(1.0, color="black", lw=0.8, ls=":")
        axes[0][j].set_title(f"{study.name}: N={n} stages")
        axes[0][j].set_ylabel("‖W_pred − W*‖ / ‖W_stale − W*‖")
        axes[1][j].set_ylabel("best scale of s·lr·v")
        axes[1][j].set_xlabel("update")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = directory / "prediction.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def chance_level(study: Study) -> float | None:
    """The accuracy of always predicting the most frequent class of the study's evaluation split: a run that ends
    there learned nothing it kept (``rayspec.cli.study_stats.collapsed``). None when the split has no labels."""
    val = run_data(from_mapping(study.base or compose(study.overrides))).val
    size = 0 if val is None else len(val)  # type: ignore[arg-type]
    if val is None or not size:
        return None
    counts = Counter(int(val[i][1]) for i in range(size))
    return max(counts.values()) / sum(counts.values())


def write_report(study: Study, runs: Sequence[RunSpec], records: Mapping[str, dict[str, Any]],
                 directory: Path) -> dict[str, Any]:
    """Write ``study.md``, ``study_results.json`` and the plots into ``directory``; return the JSON's contents."""
    settings = study_settings(study)
    chance = chance_level(study)
    table = cells(study, records, chance)
    sweep = sweep_rows(study, records, chance)
    text = markdown(study, table, settings, [*protocol_lines(study, records, chance), *sweep_lines(study, sweep)])
    (directory / "study.md").write_text(text)
    plot_curves(study, records, directory)
    plot_bands(study, records, directory)
    plot_sweep(study, sweep, directory)
    payload = {
        "study": study.name, "settings": settings, "baseline": _baseline_note(study), "table": table,
        "chance": chance, "protocol": list(protocol_cells(study, records, chance).values()), "lr_sweep": sweep,
        "checks": check_rows(study, records), "runs": [{"name": spec.name, **records[spec.name]} for spec in runs if spec.name in records],
        "markdown": text,
    }
    tmp = directory / "study_results.json.tmp"
    tmp.write_text(json.dumps(_finite(payload), indent=1, default=str))
    tmp.replace(directory / "study_results.json")
    return payload
