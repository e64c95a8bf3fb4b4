"""The Python entry points: ``run`` (a ``Config`` or Hydra overrides, as ``python -m rayspec.train``) and ``fit``
(blocks and data sets of your own). Both run the same trainer (``rayspec.training.run_training``): the driver actor,
checkpoints, restarts, ``metrics.jsonl``, ``summary.json``, ``model.pt`` and the W&B logger of ``logger``; both
return the run's ``RunSummary``."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from rayspec.config import Config, PipelineConfig, from_mapping
from rayspec.config.compose import compose
from rayspec.config.settings import apply_settings
from rayspec.data import DataBundle
from rayspec.data.custom import as_dataset
from rayspec.errors import ConfigError
from rayspec.models.custom import as_blocks
from rayspec.training.callbacks import Callbacks
from rayspec.training.console import ensure_console
from rayspec.training.loggers import build_callbacks
from rayspec.training.runner import run_training
from rayspec.training.summary import RunSummary

__all__ = ["run", "fit", "new_run_dir"]


def run(config: Config | Sequence[str] = (), run_dir: str | os.PathLike | None = None, *,
        callbacks: Sequence[Any] = ()) -> RunSummary:
    """Train as ``python -m rayspec.train`` would; returns the run's summary (``summary.json``).

    Args:
        config: a ``Config``, or Hydra overrides as on the command line (``["model=vgg16", "optim.lr=0.05"]``;
            ``hydra.searchpath=[file:///abs/dir]`` adds a config directory of your own).
        run_dir: where the run's files go; default ``outputs/DATE/TIME`` under the working directory, as Hydra's.
        callbacks: more callbacks: objects with any of the hooks of ``rayspec.Callback``, after the logger's.

    The run's lines go to the ``rayspec`` loggers; to stdout unless logging is set up (``rayspec.training.console``).

    Raises:
        ConfigError: a setting that cannot work, or a callback with a misspelt hook; before anything runs.
    """
    hooks = Callbacks(callbacks)
    if isinstance(config, (str, bytes)):
        raise ConfigError(f"rayspec.run({config!r}): give a Config or a list of overrides, e.g. [{config!r}]")
    if not isinstance(config, Config):
        overrides = list(config)
        config = from_mapping(compose(overrides))
    run_dir = Path(run_dir) if run_dir is not None else new_run_dir()
    ensure_console()
    summary = run_training(config, run_dir, callbacks=[_SaveConfig(run_dir), *build_callbacks(config, run_dir), *hooks])
    return RunSummary.from_dict(summary)


def fit(blocks: Any, train_data: Any, val_data: Any = None, *, method: str = "spectrain", stages: int = 4,
        run_dir: str | os.PathLike | None = None, callbacks: Sequence[Any] = (), **settings: Any) -> RunSummary:
    """Train ``blocks`` on ``train_data`` with ``method`` over ``stages`` pipeline stages; returns the run's summary
    (``summary.json``).

    The blocks end with the run's final weights (also in ``run_dir/model.pt``). The loss is cross-entropy of the
    last block's logits against integer class labels; ``val_accuracy`` is measured on ``val_data``.

    Args:
        blocks: an ``nn.Sequential`` of blocks, a list or ``nn.ModuleList`` of them, or a module whose ``blocks``
            attribute is one (``rayspec.models.custom``, [Note: blocks]); at least ``stages`` blocks.
        train_data: a map-style data set of ``(input, label)`` pairs, or a pair of tensors ``(inputs, labels)``.
        val_data: the same for evaluation; None: no evaluation.
        method: ``spectrain``, ``pipedream``, ``gpipe``, ``async``, ``vanilla`` or ``dataparallel``.
        stages: pipeline stages (data-parallel workers for ``dataparallel``).
        run_dir: where the run's files go; default ``outputs/DATE/TIME``.
        callbacks: more callbacks: objects with any of the hooks of ``rayspec.Callback``.
        settings: any other setting: a section as a mapping (``optim={"lr": 0.05}``, ``train={"max_steps": 200}``,
            ``pipeline={"executor": "local"}``), a field of a section by its own name where only one section has
            it (``lr=0.05``, ``max_steps=200``, ``executor="local"``, ``every=50`` for checkpoints), ``seed``,
            ``trace`` or ``logger`` (``"wandb"`` or a mapping of its keys); ``rayspec.config.settings``.

    Raises:
        ConfigError: an unknown or ambiguous setting, a value that cannot work, or a callback with a misspelt
            hook; before anything runs.
    """
    hooks = Callbacks(callbacks)
    model = as_blocks(blocks, "rayspec.fit(blocks)")
    train_set = as_dataset(train_data, "rayspec.fit(train_data)")
    val_set = None if val_data is None else as_dataset(val_data, "rayspec.fit(val_data)")
    described = Config(
        model={"name": "blocks" if isinstance(blocks, (list, tuple)) else type(blocks).__qualname__, "blocks": len(model),
               "parameters": sum(p.numel() for p in model.parameters())},
        data={"name": type(train_set).__qualname__, "train_size": len(train_set),  # type: ignore[arg-type]
              "val_size": None if val_set is None else len(val_set)},  # type: ignore[arg-type]
        pipeline=PipelineConfig(method=method, stages=stages),
    )
    config = apply_settings(described, settings)
    run_dir = Path(run_dir) if run_dir is not None else new_run_dir()
    ensure_console()
    summary = run_training(config, run_dir, callbacks=[_SaveConfig(run_dir), *build_callbacks(config, run_dir), *hooks],
                           model=model, data=DataBundle(train_set, val_set, None))
    model.load_state_dict(torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True))
    return RunSummary.from_dict(summary)


def new_run_dir(root: str | os.PathLike = "outputs") -> Path:
    """``root/DATE/TIME`` (Hydra's layout), with ``-1``, ``-2``, ... added if a run started there in the same second."""
    base = Path(root) / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")
    path, n = base, 0
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


class _SaveConfig:
    """Saves the config as run (``_save_config``) once the run has been checked: bad input writes nothing."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def on_start(self, config: Config) -> None:
        _save_config(config, self.run_dir)


def _save_config(config: Config, run_dir: Path) -> None:
    """The resolved config in ``run_dir/.hydra/config.yaml``, where a ``python -m rayspec.train`` run keeps it."""
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    values = dataclasses.asdict(config)
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(_plain(values), sort_keys=False))


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)
