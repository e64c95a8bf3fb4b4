"""Executors run a schedule's actions over the stages: ``LocalExecutor`` in one process (the reference),
``RayExecutor`` (``rayspec.exec.ray``) one actor per stage; both compute the same numbers."""

from rayspec.exec.base import Executor
from rayspec.exec.local import LocalExecutor

__all__ = ["Executor", "LocalExecutor"]
