"""The plot of weight + optimizer memory per stage, PipeDream against SpecTrain, N = 4 and 8 (``memory.png``).

    python -m benchmarks.memory.plot [--model resnet50] [--quick]     # after python -m benchmarks.memory

Writes ``memory.png`` beside the results file it reads: ``benchmarks/results/``, or with ``--quick`` the scratch
folder a ``--quick`` run of the benchmark wrote to (whose models are tiny: ``--quick`` draws its ``vgg16``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks._shared.results import results_dir  # noqa: E402


def memory(folder: Path, model: str = "resnet50") -> Path:
    data = json.loads((folder / "memory.json").read_text())
    runs = [r for r in data["results"] if r["model"] == model and r["stages"] in (4, 8)]
    if not runs:
        raise SystemExit(f"{folder / 'memory.json'} has no {model} run at 4 or 8 stages; pick another --model")
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        stages = run["per_stage"]
        x = [s["stage"] for s in stages]
        ax.bar([i - 0.2 for i in x], [s["pipedream_mib"] for s in stages], 0.4, label="pipedream (stash)")
        ax.bar([i + 0.2 for i in x], [s["spectrain_mib"] for s in stages], 0.4, label="spectrain (prediction)")
        ax.set_xticks(x)
        ax.set_xlabel("stage")
        ax.set_title(f"{model}, N = {run['stages']}")
    axes[0][0].set_ylabel("weights + optimizer MiB")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = folder / "memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the model to draw (default resnet50; --quick: vgg16)")
    ap.add_argument("--quick", action="store_true", help="draw the --quick run's results, in its scratch folder")
    args = ap.parse_args(argv)
    model = args.model or ("vgg16" if args.quick else "resnet50")
    print(f"wrote {memory(results_dir(args.quick), model)}")


if __name__ == "__main__":
    main()
