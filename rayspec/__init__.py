"""rayspec: pipelined model parallelism on Ray with SpecTrain weight prediction.

What a user calls: ``fit`` (train blocks and data sets of one's own) and ``run`` (train from a ``Config`` or
Hydra overrides, as the command ``python -m rayspec.train`` does), which return the run's ``RunSummary`` and call
``Callback`` hooks; ``Config``; the method registry ``METHODS``; the errors ``RayspecError`` (the base of every
error for input that cannot work, a ``ValueError``), ``ConfigError`` (a setting, or an unknown name) and
``RunFailed`` (a run that failed past its restarts); and the lower-level pieces the trainer is built from:
``Stage``, ``build_schedule``, ``LocalExecutor`` and ``RayExecutor``.

The names load on first use, so that importing one part (a stage actor imports ``rayspec.exec.ray``)
does not import the others (the trainer, the data sets, Ray).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rayspec.config import Config
    from rayspec.core.methods import METHODS
    from rayspec.core.schedule import Schedule, build_schedule
    from rayspec.core.stage import Stage
    from rayspec.errors import ConfigError, RayspecError
    from rayspec.exec import LocalExecutor
    from rayspec.exec.ray import RayExecutor
    from rayspec.training import fit, run
    from rayspec.training.callbacks import Callback
    from rayspec.training.failures import RunFailed
    from rayspec.training.summary import RunSummary

_EXPORTS = {
    "fit": ("rayspec.training", "fit"),
    "run": ("rayspec.training", "run"),
    "RunSummary": ("rayspec.training.summary", "RunSummary"),
    "Callback": ("rayspec.training.callbacks", "Callback"),
    "Config": ("rayspec.config", "Config"),
    "RayspecError": ("rayspec.errors", "RayspecError"),
    "ConfigError": ("rayspec.errors", "ConfigError"),
    "RunFailed": ("rayspec.training.failures", "RunFailed"),
    "METHODS": ("rayspec.core.methods", "METHODS"),
    "Stage": ("rayspec.core.stage", "Stage"),
    "Schedule": ("rayspec.core.schedule", "Schedule"),
    "build_schedule": ("rayspec.core.schedule", "build_schedule"),
    "LocalExecutor": ("rayspec.exec", "LocalExecutor"),
    "RayExecutor": ("rayspec.exec.ray", "RayExecutor"),
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rayspec' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    return getattr(importlib.import_module(module), attr)


__all__ = ["fit", "run", "RunSummary", "Callback", "Config", "RayspecError", "ConfigError", "RunFailed", "METHODS",
           "Stage", "Schedule", "build_schedule", "LocalExecutor", "RayExecutor"]
__version__ = "0.1.0"
