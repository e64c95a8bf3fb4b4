"""A training run: prepare, the run loop and its restarts, the driver actor, data parallelism on Ray Train,
checkpoints, progress, traces and loggers. ``run_training`` is the entry; ``run`` and ``fit`` the Python front doors,
which return a ``RunSummary`` and call ``Callback`` hooks."""

from rayspec.training.api import fit, run
from rayspec.training.callbacks import Callback
from rayspec.training.failures import RunFailed
from rayspec.training.runner import run_training
from rayspec.training.summary import RunSummary

__all__ = ["run_training", "run", "fit", "RunSummary", "Callback", "RunFailed"]
