"""Train a model defined in this script with ``rayspec.fit``, in one process and on Ray, and compare the two.

    python examples/custom_model.py [--executor local|ray|both] [--steps 60] [--stages 3] [--method spectrain]

The model is a module of its own with a ``blocks`` list (the partitioner cuts between blocks); the data are
tensors made here. With ``pipeline.executor=ray`` (``executor="ray"``) a driver actor runs the loop and every
stage is a Ray actor; Ray ships the classes of this script to them. Both runs start from the same weights and
see the same batches, so their final weights are equal.
"""

from __future__ import annotations

import argparse
import copy
import logging
import tempfile

import torch
from torch import nn

import rayspec


class Residual(nn.Module):
    """``x + f(x)``: one block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(width, width), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


class SpiralNet(nn.Module):
    """An input layer, residual blocks and a classifier, held in ``blocks``: rayspec trains their chain."""

    def __init__(self, width: int = 32, depth: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(2, width), nn.Tanh())]
                                    + [Residual(width) for _ in range(depth)] + [nn.Linear(width, classes)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # what rayspec computes too, block after block
        for block in self.blocks:
            x = block(x)
        return x


def spirals(n: int, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points on ``classes`` interleaved spiral arms: inputs ``(n, 2)``, labels ``(n,)``."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (n,), generator=g)
    radius = torch.rand(n, generator=g)
    angle = labels * (2 * torch.pi / classes) + 4 * radius + 0.2 * torch.randn(n, generator=g)
    return torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1), labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executor", default="both", choices=["local", "ray", "both"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--method", default="spectrain")
    args = ap.parse_args()
    logging.getLogger("rayspec").setLevel(logging.WARNING)  # the runs' own lines stay quiet; this prints one each
    torch.manual_seed(0)
    model = SpiralNet()
    train, val = spirals(4096), spirals(1024, seed=1)
    executors = ["local", "ray"] if args.executor == "both" else [args.executor]
    trained = {}
    for executor in executors:
        net = copy.deepcopy(model)  # the same starting weights for every run
        with tempfile.TemporaryDirectory() as run_dir:
            summary = rayspec.fit(net, train, val, method=args.method, stages=args.stages, run_dir=run_dir,
                                  executor=executor, max_steps=args.steps, batch_size=64, lr=0.1, log_every=20,
                                  cpus_per_stage=0.5 if executor == "ray" else None)
        trained[executor] = net  # fit leaves the run's final weights in the model
        print(f"{executor:<6} {args.method} on {args.stages} stages: loss {summary.final_train_loss:.4f}  "
              f"val_accuracy {summary.val_accuracy:.4f}")
    if len(trained) == 2:
        same = all(torch.equal(a, b) for a, b in zip(trained["local"].state_dict().values(),
                                                      trained["ray"].state_dict().values()))
        print(f"local and ray weights equal: {same}")


if __name__ == "__main__":
    main()
