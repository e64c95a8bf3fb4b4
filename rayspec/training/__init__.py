"""A training run: prepare, the run loop and its restarts, the driver actor, data parallelism on Ray Train,
checkpoints, progress, traces and loggers. ``train`` is the entry; ``run`` and ``fit`` the Python front doors."""

from rayspec.training.api import fit, run
from rayspec.training.failures import RunFailed
from rayspec.training.trainer import train

__all__ = ["train", "run", "fit", "RunFailed"]
