"""The shipped accuracy studies, each at its swept learning rate and at one lower rate, with their reports.

    python -m benchmarks.studies [--only lstm_text,snn_image-lr0.01]

Runs ``rayspec.study`` for every entry of ``RUNS`` into ``outputs/studies/<label>`` (finished runs are
kept and skipped, as ``python -m rayspec.study`` does), then copies each study's ``study.md``,
``study_results.json`` and plots to ``benchmarks/results/studies/<label>/`` for the README.

The lower rates are not tuned to any outcome: they are the next rate below the swept one in
``benchmarks/study_lr.py``'s grid (snn_image, whose swept rate made every asynchronous method
diverge) and the rate of the paper's lstm_imdb experiment (lstm_text, 0.1).
"""

from __future__ import annotations

import argparse
import shutil
import time

from benchmarks._common import RESULTS
from rayspec.study import load_study, run_study
from rayspec.tune import ROOT

RUNS: dict[str, tuple[str, list[str]]] = {
    "lstm_text": ("lstm_text", []),
    "lstm_text-lr0.1": ("lstm_text", ["optim.lr=0.1"]),
    "transformer_text": ("transformer_text", []),
    "vgg16_image": ("vgg16_image", []),
    "snn_image": ("snn_image", []),
    "snn_image-lr0.01": ("snn_image", ["optim.lr=0.01"]),
}
"""Report label -> (study name, training overrides of the command line)."""
FILES = ("study.md", "study_results.json", "learning_curves.png", "distance.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(RUNS), help="comma-separated labels of RUNS")
    args = ap.parse_args()
    labels = args.only.split(",")
    unknown = [label for label in labels if label not in RUNS]
    if unknown:
        ap.error(f"--only {','.join(unknown)}: unknown; choose from {', '.join(RUNS)}")
    for label in labels:
        name, overrides = RUNS[label]
        t0 = time.perf_counter()
        study = load_study(name, overrides, output_dir=str(ROOT / "outputs" / "studies" / label))
        run_study(study)
        target = RESULTS / "studies" / label
        target.mkdir(parents=True, exist_ok=True)
        for file in FILES:
            shutil.copy2(study.directory / file, target / file)
        print(f"{label}: {time.perf_counter() - t0:.0f} s; copied the report to {target}", flush=True)


if __name__ == "__main__":
    main()
