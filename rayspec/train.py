"""``python -m rayspec.train``: the Hydra entry point (``conf/config.yaml``)."""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rayspec.config import ConfigError, from_mapping
from rayspec.data import DataError
from rayspec.models import ModelError
from rayspec.partition import PartitionError
from rayspec.schedule import ScheduleError

log = logging.getLogger("rayspec")

USER_ERRORS = (ConfigError, DataError, ModelError, PartitionError, ScheduleError)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from rayspec.loggers import build_callbacks
    from rayspec.trainer import RunFailed, train

    try:
        config = from_mapping(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
        run_dir = HydraConfig.get().runtime.output_dir
        train(config, run_dir, echo=log.info, callbacks=build_callbacks(config, run_dir, echo=log.info))
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except (FloatingPointError, RunFailed) as err:  # diverged, or a failure beyond fault.max_restarts
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
