"""The README's plots, drawn from the benchmark results in ``benchmarks/results/``.

    python -m benchmarks.plots      # after python -m benchmarks.communication and python -m benchmarks.memory

Writes ``benchmarks/results/communication.png`` (bytes per update of data against model
parallelism per paper model, N = 4) and ``benchmarks/results/memory.png`` (weight + optimizer
memory per stage, PipeDream against SpecTrain, N = 4 and 8).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20


def communication(stages: str = "4") -> Path:
    data = json.loads((RESULTS / "communication.json").read_text())
    models = [m for m in data["models"] if stages in m["stages"]]
    names = [m["model"] for m in models]
    dp = [m["stages"][stages]["dp_ring_total"] / MIB for m in models]
    mp = [m["stages"][stages]["mp_bytes_per_update"] / MIB for m in models]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], dp, 0.4, label="data parallelism (ring, all workers)")
    ax.bar([i + 0.2 for i in x], mp, 0.4, label="model parallelism (all boundaries)")
    ax.set_yscale("log")
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylabel("MiB per update")
    ax.set_title(f"Bytes moved per update, N = {stages} ({data['machine'].split(',')[0]}, uniform partition)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS / "communication.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory(model: str = "resnet50") -> Path:
    data = json.loads((RESULTS / "memory.json").read_text())
    runs = [r for r in data["results"] if r["model"] == model and r["stages"] in (4, 8)]
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
    path = RESULTS / "memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    for draw in (communication, memory):
        print(f"wrote {draw()}")


if __name__ == "__main__":
    main()
