"""A training run: prepare, the run loop and its restarts, the driver actor, data parallelism on Ray Train,
checkpoints, progress, traces and loggers. ``run_training`` is the entry; ``run`` and ``fit`` the Python front doors."""

from rayspec.training.api import fit, run
from rayspec.training.failures import RunFailed
from rayspec.training.runner import run_training

__all__ = ["run_training", "run", "fit", "RunFailed"]
