"""The shipped accuracy studies at their swept learning rate and at a third of it, with their reports.

    python -m benchmarks.studies [--only lstm_text,snn_image-third] [--quick]
    python -m benchmarks.studies --real [--only lstm_rt-third]

Runs ``rayspec.cli.study`` for every entry of ``runs()`` into ``outputs/studies/<label>`` (finished runs are
kept and skipped, as ``python -m rayspec.study`` does), then copies each study's ``study.md``,
``study_results.json`` and plots to ``benchmarks/results/studies/<label>/`` for the README. ``--quick``: the first
label only (unless ``--only``), 2 stages, one stale method and SpecTrain, one seed, 20 updates, all in a scratch folder.

The synthetic studies run at 4 stages, the stale methods and every SpecTrain predictor
(``rayspec.core.predict``), 3 seeds. The studies on real data (``--real``) run what their files name: 2 and
4 stages, gpipe, the stale methods and SpecTrain's paper (linear and adaptive) and consistent variants,
3 seeds. The swept rate (``benchmarks/studies/lr.py``: the largest the sequential baseline takes without
losing accuracy) puts every stale method at the edge of its stability; the third of it is
fixed by that rule too, not chosen for any outcome. The same run by hand:

    python -m rayspec.study study=lstm_text 'methods=[async,pipedream,...]' 'stages=[4]' optim.lr=0.333
    python -m rayspec.study study=lstm_rt optim.lr=...     # a real-data study: its file's methods and stages
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks._shared.results import results_dir
from rayspec.cli.common import read_settings
from rayspec.cli.study import load_study, run_study
from rayspec.cli.study_config import STUDIES
from rayspec.training.console import ensure_console

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("lstm_text", "transformer_text", "vgg16_image", "snn_image")
METHODS = ["async", "pipedream", "spectrain-paper", "spectrain-consistent", "spectrain-paper-momentum",
           "spectrain-consistent-momentum", "spectrain-paper-adaptive", "spectrain-consistent-adaptive"]
STAGES = [4]
REAL = ("vgg16_fashion", "snn_fashion", "lstm_rt", "transformer_rt")
"""The studies on real data; each runs its file's methods, stage counts and seeds."""


def swept_lr(name: str) -> float:
    """The ``optim.lr`` override of a shipped study file."""
    raw = read_settings(STUDIES / f"{name}.yaml", ValueError, "a study")
    return next(float(o.split("=", 1)[1]) for o in raw["overrides"] if o.startswith("optim.lr="))


def runs(names: tuple[str, ...] = NAMES) -> dict[str, tuple[str, list[str]]]:
    """Report label -> (study name, training overrides): each study at its swept rate and at a third of it."""
    out: dict[str, tuple[str, list[str]]] = {}
    for name in names:
        out[name] = (name, [])
        out[f"{name}-third"] = (name, [f"optim.lr={swept_lr(name) / 3:.4g}"])
    return out


FILES = ("study.md", "study_results.json", "learning_curves.png", "distance.png", "prediction.png")
QUICK = {"methods": ["async", "spectrain-paper"], "stages": [2], "seeds": [0], "checks": False}
QUICK_TRAINING = ["train.max_steps=20", "train.eval_every=10", "train.log_every=10"]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", action="store_true", help=f"the studies on real data: {', '.join(REAL)}")
    ap.add_argument("--only", default=None, help="comma-separated report labels (default: every one)")
    ap.add_argument("--quick", action="store_true", help="one small study run in a scratch folder (a smoke test)")
    args = ap.parse_args(argv)
    ensure_console()  # the studies' progress lines, as rayspec study prints them
    table = runs(REAL if args.real else NAMES)
    args.only = args.only or (next(iter(table)) if args.quick else ",".join(table))
    outputs = results_dir(True) / "study_runs" if args.quick else ROOT / "outputs" / "studies"
    labels = args.only.split(",")
    unknown = [label for label in labels if label not in table]
    if unknown:
        ap.error(f"--only {','.join(unknown)}: unknown; choose from {', '.join(table)}")
    for label in labels:
        name, overrides = table[label]
        t0 = time.perf_counter()
        # a real-data study runs its own file's methods and stage counts
        shape = QUICK if args.quick else {} if args.real else {"methods": METHODS, "stages": STAGES}
        training = [*overrides, *(QUICK_TRAINING if args.quick else [])]
        study = load_study(name, training, output_dir=str(outputs / label), **shape)
        run_study(study)
        target = results_dir(args.quick) / "studies" / label
        target.mkdir(parents=True, exist_ok=True)
        for file in FILES:
            shutil.copy2(study.directory / file, target / file)
        print(f"{label}: {time.perf_counter() - t0:.0f} s; copied the report to {target}", flush=True)


if __name__ == "__main__":
    main()
