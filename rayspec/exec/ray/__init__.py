"""The Ray executor: one actor per stage in a placement group, and the transports between them."""

from rayspec.exec.ray.actor import StageActor
from rayspec.exec.ray.executor import RayExecutor

__all__ = ["RayExecutor", "StageActor"]
