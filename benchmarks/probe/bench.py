"""The cost of scoring SpecTrain's predictions: training time with the probe on against off, in one process.

    python -m benchmarks.probe [--quick] [--repeats 5] [--coordinates 4096]

Trains SpecTrain (paper variant, 4 stages, the local executor, one torch thread) on the tiny residual
LSTM and the small SNN of the accuracy studies, with ``pipeline.probe`` off and on, interleaved
``--repeats`` times. Reported per model: the median wall time of each and the ratio on / off, and the
probe's memory (one float64 sample of the weights per prediction in flight, three per pending one).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence

import torch

from benchmarks._shared.results import table, write
from rayspec.config import from_mapping
from rayspec.config.compose import compose
from rayspec.training import run_training

WORKLOADS = {
    "residual_lstm tiny": ["+experiment=lstm_imdb", "data=synthetic_text", "data.seq_len=32", "model.size=tiny",
                           "+model.dropout=0.0", "train.batch_size=64", "optim.lr=0.1"],
    "snn small": ["+experiment=snn_cifar10", "data=synthetic_image", "data.image_size=8", "model.size=small",
                  "+model.dropout=0.0", "train.batch_size=64", "optim.lr=0.01"],
}


def one_run(overrides: list[str], probe: int, steps: int) -> float:
    cfg = compose([*overrides, "pipeline.executor=local", "pipeline.method=spectrain", "pipeline.stages=4",
                   f"pipeline.probe={probe}", f"train.max_steps={steps}", f"train.eval_every={steps}",
                   f"train.log_every={steps}"])
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        run_training(from_mapping(cfg), run_dir)
        return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--coordinates", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--quick", action="store_true", help="1 repeat of 20 updates (a smoke test of this script)")
    args = ap.parse_args(argv)
    repeats, steps = (1, 20) if args.quick else (args.repeats, args.steps)
    torch.set_num_threads(1)
    rows = []
    for name, overrides in WORKLOADS.items():
        times: dict[int, list[float]] = {0: [], args.coordinates: []}
        for _ in range(repeats):
            for probe in times:  # interleaved: drifts of a shared machine hit both
                times[probe].append(one_run(overrides, probe, steps))
        off, on = statistics.median(times[0]), statistics.median(times[args.coordinates])
        rows.append({"model": name, "updates": steps, "off_s": round(off, 2), "on_s": round(on, 2),
                     "ratio_on_off": round(on / off, 3)})
    print(table(rows, ["model", "updates", "off_s", "on_s", "ratio_on_off"]))
    path = write("probe", {"coordinates": args.coordinates, "repeats": repeats, "rows": rows}, quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
