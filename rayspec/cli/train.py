"""``rayspec train`` and ``python -m rayspec.train``: the Hydra entry point (``rayspec/conf/config.yaml``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rayspec.config import from_mapping
from rayspec.config.compose import CONF
from rayspec.errors import RayspecError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m rayspec.train ARGV`` (default: this process's arguments); returns the exit code.

    Hydra reads every argument itself (overrides, ``--help``, ``--cfg job``, ``-m``, ``--config-dir``) from
    ``sys.argv``, so ``argv`` stands in for ``sys.argv[1:]`` during the call. Bad input exits with 2, a run that
    diverged or failed beyond ``fault.max_restarts`` with 1, an error Hydra reports itself with 1.
    """
    if argv is None:
        _train()
        return 0
    saved = sys.argv
    sys.argv = [saved[0], *argv]
    try:
        _train()
    finally:
        sys.argv = saved
    return 0


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
def _train(cfg: DictConfig) -> None:
    from rayspec.training import RunFailed, run_training
    from rayspec.training.console import ensure_console
    from rayspec.training.loggers import build_callbacks

    try:
        config = from_mapping(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
        run_dir = HydraConfig.get().runtime.output_dir
        ensure_console()  # Hydra's job logging shows the run's lines; this only if it is turned off
        run_training(config, run_dir, callbacks=build_callbacks(config, run_dir))
    except RayspecError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except (FloatingPointError, RunFailed) as err:  # diverged, or a failure beyond fault.max_restarts
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
