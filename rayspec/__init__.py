"""rayspec: pipelined model parallelism on Ray with SpecTrain weight prediction."""

from rayspec.executor import LocalExecutor
from rayspec.schedule import Schedule, build_schedule
from rayspec.stage import Stage


def __getattr__(name: str):  # RayExecutor imports Ray; load it only when asked for
    if name == "RayExecutor":
        from rayspec.ray_executor import RayExecutor

        return RayExecutor
    raise AttributeError(name)


__all__ = ["Stage", "Schedule", "build_schedule", "LocalExecutor", "RayExecutor"]
__version__ = "0.1.0"
