"""``python -m rayspec.train``: the Hydra entry point (``rayspec/conf/config.yaml``)."""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rayspec.cli.common import USER_ERRORS
from rayspec.config import from_mapping
from rayspec.config.compose import CONF

__all__ = ["main"]


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
def main(cfg: DictConfig) -> None:
    from rayspec.training import RunFailed, run_training
    from rayspec.training.console import ensure_console
    from rayspec.training.loggers import build_callbacks

    try:
        config = from_mapping(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
        run_dir = HydraConfig.get().runtime.output_dir
        ensure_console()  # Hydra's job logging shows the run's lines; this only if it is turned off
        run_training(config, run_dir, callbacks=build_callbacks(config, run_dir))
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except (FloatingPointError, RunFailed) as err:  # diverged, or a failure beyond fault.max_restarts
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
