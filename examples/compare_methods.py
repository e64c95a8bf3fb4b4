"""Train the quickstart with every pipeline method on the same model, data and seed, and print a table.

    python examples/compare_methods.py [--executor local|ray] [--steps 300] [--stages 4] [--lr 0.01]
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import rayspec
from rayspec.config import Config

METHODS = ("vanilla", "gpipe", "1f1b", "zb1p", "async", "pipedream", "pipedream-2bw", "spectrain")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executor", default="local", choices=["local", "ray"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.01)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)  # only this table: the runs' progress lines are INFO
    rows = []
    for method in METHODS:
        config = Config(data={"name": "synthetic_image", "noise": 2.0})
        config.pipeline.method, config.pipeline.executor, config.pipeline.stages = method, args.executor, args.stages
        config.optim.lr, config.train.max_steps = args.lr, args.steps
        if method == "pipedream-2bw":  # an update per batch of at least N-1 micro-batches: a delay of one update
            config.pipeline.accumulate = next(a for a in range(max(1, args.stages - 1), config.train.batch_size + 1)
                                              if config.train.batch_size % a == 0)
        with tempfile.TemporaryDirectory() as run_dir:
            s = rayspec.run(config, run_dir)
        rows.append((method, s.final_train_loss, s.val_accuracy, s.samples_per_s))
        print(f"{method:<14} loss {rows[-1][1]:.4f}  val_accuracy {rows[-1][2]:.4f}  {rows[-1][3]:8.1f} samples/s")


if __name__ == "__main__":
    main()
