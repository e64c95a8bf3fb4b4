"""A run's configuration: typed sections with their own checks; ``rayspec.config.compose`` composes it with Hydra
from ``rayspec/conf``."""

from rayspec.config.schema import LOGGERS, Config, from_mapping, merge
from rayspec.config.sections import (
    CheckpointConfig,
    FaultConfig,
    OptimConfig,
    PipelineConfig,
    RayConfig,
    TrainConfig,
)
from rayspec.errors import ConfigError

__all__ = ["Config", "ConfigError", "PipelineConfig", "OptimConfig", "TrainConfig", "CheckpointConfig",
           "FaultConfig", "RayConfig", "LOGGERS", "from_mapping", "merge"]
