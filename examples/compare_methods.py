"""Train the quickstart with every pipeline method on the same model, data and seed, and print a table.

    python examples/compare_methods.py [--executor local|ray] [--steps 300] [--stages 4] [--lr 0.01]
"""

from __future__ import annotations

import argparse
import tempfile

from rayspec.config import Config
from rayspec.training import train

METHODS = ("vanilla", "gpipe", "async", "pipedream", "spectrain")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executor", default="local", choices=["local", "ray"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.01)
    args = ap.parse_args()
    rows = []
    for method in METHODS:
        config = Config(data={"name": "synthetic_image", "noise": 2.0})
        config.pipeline.method, config.pipeline.executor, config.pipeline.stages = method, args.executor, args.stages
        config.optim.lr, config.train.max_steps = args.lr, args.steps
        with tempfile.TemporaryDirectory() as run_dir:
            s = train(config, run_dir, echo=lambda _: None)
        rows.append((method, s["final_train_loss"], s["val_accuracy"], s["samples_per_s"]))
        print(f"{method:<10} loss {rows[-1][1]:.4f}  val_accuracy {rows[-1][2]:.4f}  {rows[-1][3]:8.1f} samples/s")


if __name__ == "__main__":
    main()
