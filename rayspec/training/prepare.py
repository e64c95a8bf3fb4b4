"""Everything a run needs that can be built and checked before Ray starts: data, model, partition, stages."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Subset, TensorDataset

from rayspec.config import Config
from rayspec.core.lr import LRSchedule
from rayspec.core.methods import METHODS
from rayspec.core.stage import Stage, make_stages
from rayspec.data import DataBundle, build_data
from rayspec.data.loader import eval_batches
from rayspec.errors import ConfigError
from rayspec.models import build_model, model_options
from rayspec.partition import PartitionPlan, check_balance, choose_partition, profile_blocks, split, uniform
from rayspec.training.checkpoint import CheckpointStore, check_compatible, load_checkpoint, resolve_resume

__all__ = ["Prepared", "prepare", "lr_schedule", "stage_settings", "build_stages", "split_batches"]


@dataclass
class Prepared:
    """Everything a run needs that can be built and checked before Ray starts."""

    config: Config
    data: DataBundle
    model: nn.Sequential
    balance: list[int]
    plan: PartitionPlan | None = None
    checkpoints: Path | None = None
    """The run's checkpoint folder (``checkpoint.dir`` or ``RUN_DIR/checkpoints``); None without a run directory."""
    resume: dict[str, Any] | None = None
    """The checkpoint to continue from (``rayspec.training.checkpoint.load_checkpoint``), if any."""
    resume_path: Path | None = None


def prepare(config: Config, run_dir: str | os.PathLike | None = None) -> Prepared:
    """Validate the config, build data and model, read the checkpoint to resume from and choose the partition;
    raises before any Ray work.

    Args:
        config: the run's settings.
        run_dir: the run directory; ``checkpoint.resume=auto`` looks in its ``checkpoints/`` unless
            ``checkpoint.dir`` is set.
    """
    config.validate()
    ck = config.checkpoint
    folder = Path(os.path.expanduser(ck.dir)) if ck.dir else (Path(run_dir) / "checkpoints" if run_dir else None)
    resume_path = resolve_resume(ck.resume, folder)
    if ck.resume is None and folder is not None and (earlier := CheckpointStore(folder).latest()) is not None:
        raise ConfigError(
            f"{folder} already holds checkpoints of an earlier run ({earlier.name}); continue it with "
            "checkpoint.resume=auto, or start afresh in another hydra.run.dir or checkpoint.dir"
        )
    resume = None
    if resume_path is not None:
        resume = load_checkpoint(resume_path)
        check_compatible(json.loads(resume["config"]), config, resume_path)
        saved = list(resume["balance"])
        if config.pipeline.balance is not None and list(config.pipeline.balance) != saved:
            raise ConfigError(
                f"pipeline.balance={config.pipeline.balance} differs from the balance {saved} that {resume_path} "
                "was written with; drop pipeline.balance to resume with the checkpoint's"
            )
        if resume["step"] >= config.train.max_steps:
            raise ConfigError(
                f"checkpoint.resume: {resume_path} is at update {resume['step']}, which already reaches "
                f"train.max_steps={config.train.max_steps}; raise train.max_steps to train on"
            )
    torch.manual_seed(config.seed)
    data_opts = {k: v for k, v in config.data.items() if k not in ("name", "root")}
    data = build_data(config.data["name"], root=config.data.get("root"), seed=config.seed, **data_opts)
    data = DataBundle(_first(data.train, config.train.train_samples), _first(data.val, config.train.val_samples),
                      data.info)
    torch.manual_seed(config.seed)  # the model's initial weights depend on the seed only
    model = build_model(config.model["name"], data.info, config.model.get("size", "full"), **model_options(config.model))
    n_train = len(data.train)  # type: ignore[arg-type]
    if config.train.batch_size > n_train:
        raise ConfigError(
            f"train.batch_size={config.train.batch_size} exceeds the training set ({n_train} samples); lower it"
        )
    if not METHODS[config.pipeline.method].pipelined:  # whole-model replicas: nothing to partition
        return Prepared(config, data, model, [len(model)], None, folder, resume, resume_path)
    planned = _partition(model, data, config, balance=None if resume is None else list(resume["balance"]))
    return Prepared(config, data, model, list(planned.balance), planned, folder, resume, resume_path)


def _first(dataset: Any, count: int | None) -> Any:
    """The first ``count`` samples of ``dataset`` (all of it for None)."""
    if dataset is None or count is None or count >= len(dataset):
        return dataset
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(t[:count] for t in dataset.tensors))
    return Subset(dataset, range(count))


def _partition(model: nn.Sequential, data: DataBundle, config: Config, balance: list[int] | None = None
               ) -> PartitionPlan:
    """Choose the partition and profile each block once on a micro-batch, for the per-stage table.

    ``profile`` times every block (a warm-up and the median of three runs); the other partitions
    time one run after a warm-up, enough for the table's time and activation columns. ``balance``
    (a resumed checkpoint's) wins over the config's.
    """
    p = config.pipeline
    uniform(len(model), p.stages)  # the same clear error for too many stages, whatever the partition
    balance = balance if balance is not None else p.balance
    if balance is not None:
        check_balance(balance, len(model), p.stages)
    size = max(1, min(config.train.batch_size // p.group, len(data.train)))  # type: ignore[arg-type]
    sample = next(iter(eval_batches(data.train, size)))[0]
    profiled = p.partition == "profile" and balance is None
    profiles = profile_blocks(model, sample, warmup=1, repeats=3 if profiled else 1)
    return choose_partition(model, p.stages, partition=p.partition, balance=balance, profiles=profiles)


def lr_schedule(config: Config) -> LRSchedule:
    """The learning rate per update count, the same for every method and stage."""
    o = config.optim
    return LRSchedule(o.lr, o.schedule, config.train.max_steps, o.warmup, o.power, o.min_lr)


def stage_settings(config: Config) -> dict[str, Any]:
    """``Stage``'s keyword arguments that come from the config: learning rate, optimizer, clipping, precision,
    the staleness settings and the random seed (every executor and ``dataparallel`` build stages from them)."""
    o, p = config.optim, config.pipeline
    return {"lr": lr_schedule(config), "optimizer": o.name, "momentum": o.momentum, "weight_decay": o.weight_decay,
            "dampening": o.dampening, "nesterov": o.nesterov, "betas": tuple(o.betas), "eps": o.eps, "fused": o.fused,
            "clip_grad_norm": o.clip_grad_norm, "precision": config.train.precision, "backward": p.backward,
            "seed": config.seed, "trace": config.trace, "predictor": p.predictor, "probe": p.probe}


def build_stages(prepared: Prepared, device: str = "cpu", record: bool = False) -> list[Stage]:
    """Cut the model along the balance into stages with the method's policy and the optimizer settings."""
    c = prepared.config
    parts = split(copy.deepcopy(prepared.model), prepared.balance)
    return make_stages(parts, c.pipeline.method, group=c.pipeline.group, device=device, record=record,
                       **stage_settings(c))


def split_batches(batches: Iterator[tuple[torch.Tensor, ...]], group: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each batch as ``group`` equal micro-batches, in order."""
    for x, y in batches:
        if group == 1:
            yield x, y
        else:
            yield from zip(x.chunk(group), y.chunk(group))
