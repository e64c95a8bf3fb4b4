"""The plot of bytes per update, data against model parallelism per paper model (``communication.png``).

    python -m benchmarks.communication.plot [--stages 4] [--quick]     # after python -m benchmarks.communication

Writes ``communication.png`` beside the results file it reads: ``benchmarks/results/``, or with ``--quick`` the
scratch folder a ``--quick`` run of the benchmark wrote to.
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

MIB = 2**20


def communication(folder: Path, stages: str = "4") -> Path:
    data = json.loads((folder / "communication.json").read_text())
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
    path = folder / "communication.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="4", help="the stage count N to draw")
    ap.add_argument("--quick", action="store_true", help="draw the --quick run's results, in its scratch folder")
    args = ap.parse_args(argv)
    print(f"wrote {communication(results_dir(args.quick), args.stages)}")


if __name__ == "__main__":
    main()
