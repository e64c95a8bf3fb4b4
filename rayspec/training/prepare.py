"""Everything a run needs that can be built and checked before Ray starts: data, model, partition, stages."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Subset, TensorDataset

from rayspec.config import Config
from rayspec.core.lr import LRSchedule
from rayspec.core.methods import METHODS
from rayspec.core.optim import OptimSpec
from rayspec.core.stage_spec import StageSpec
from rayspec.data import DataBundle, DataInfo, build_data
from rayspec.data.custom import build_target_data
from rayspec.data.loader import eval_batches
from rayspec.errors import ConfigError
from rayspec.models import build_model, model_options
from rayspec.models.custom import build_target_model
from rayspec.partition import (
    BlockProfile,
    PartitionPlan,
    check_balance,
    choose_partition,
    profile_blocks,
    uniform,
)
from rayspec.targets import TARGET
from rayspec.training.checkpoint import CheckpointStore, check_compatible, checkpoint_folder, resolve_resume
from rayspec.training.storage import Location

__all__ = ["Prepared", "prepare", "profile_sample", "replan", "lr_schedule", "stage_spec"]


@dataclass
class Prepared:
    """Everything a run needs that can be built and checked before Ray starts."""

    config: Config
    data: DataBundle
    model: nn.Sequential
    balance: list[int]
    plan: PartitionPlan | None = None
    checkpoints: Location | None = None
    """The run's checkpoint folder (``checkpoint.dir``, ``STORAGE/checkpoints`` or ``RUN_DIR/checkpoints``); None
    without a run directory."""
    resume: dict[str, Any] | None = None
    """The checkpoint to continue from (``rayspec.training.checkpoint.load_checkpoint``), if any."""
    resume_path: Location | None = None


def prepare(config: Config, run_dir: str | os.PathLike | None = None, model: nn.Sequential | None = None,
            data: DataBundle | None = None) -> Prepared:
    """Validate the config, build data and model, read the checkpoint to resume from and choose the partition;
    raises before any Ray work.

    Args:
        config: the run's settings.
        run_dir: the run directory; ``checkpoint.resume=auto`` looks in its ``checkpoints/`` unless
            ``checkpoint.dir`` or ``checkpoint.storage`` is set.
        model: the blocks to train instead of building ``config.model`` (``rayspec.fit``); trained from their
            current weights.
        data: the data to train on instead of building ``config.data`` (``rayspec.fit``).
    """
    config.validate()
    ck = config.checkpoint
    folder = checkpoint_folder(ck, run_dir)
    found = resolve_resume(ck.resume, folder)
    if ck.resume is None and folder is not None and (earlier := CheckpointStore(folder).latest()) is not None:
        raise ConfigError(
            f"{folder} already holds checkpoints of an earlier run ({earlier}); continue it with "
            "checkpoint.resume=auto, or start afresh in another hydra.run.dir, checkpoint.dir or checkpoint.storage"
        )
    resume, resume_path, kept = None, None, None
    if found is not None:
        resume_path, resume = found
        saved = json.loads(resume["config"])
        check_compatible(saved, config, resume_path)
        kept = _kept_balance(resume, saved, config)
        if resume["step"] >= config.train.max_steps:
            raise ConfigError(
                f"checkpoint.resume: {resume_path} is at update {resume['step']}, which already reaches "
                f"train.max_steps={config.train.max_steps}; raise train.max_steps to train on"
            )
    torch.manual_seed(config.seed)
    data = run_data(config, data)
    torch.manual_seed(config.seed)  # the model's initial weights depend on the seed only
    model = model if model is not None else _build_model(config, data.info)
    n_train = len(data.train)  # type: ignore[arg-type]
    if config.train.batch_size > n_train:
        raise ConfigError(
            f"train.batch_size={config.train.batch_size} exceeds the training set ({n_train} samples); lower it"
        )
    if not METHODS[config.pipeline.method].pipelined:  # whole-model replicas: nothing to partition
        return Prepared(config, data, model, [len(model)], None, folder, resume, resume_path)
    planned = _partition(model, data, config, balance=kept)
    return Prepared(config, data, model, list(planned.balance), planned, folder, resume, resume_path)


def run_data(config: Config, data: DataBundle | None = None) -> DataBundle:
    """The data a run trains and evaluates on: ``data``, or the set ``config.data`` names, cut to
    ``train.train_samples`` and ``train.val_samples``."""
    data = _build_data(config) if data is None else data
    return DataBundle(_first(data.train, config.train.train_samples), _first(data.val, config.train.val_samples),
                      data.info)


def _build_data(config: Config) -> DataBundle:
    """The data set ``config.data`` names: a registry entry (``name``) or a builder of one's own (``_target_``)."""
    if TARGET in config.data:
        return build_target_data(config.data, config.seed)
    options = {k: v for k, v in config.data.items() if k not in ("name", "root")}
    return build_data(config.data["name"], root=config.data.get("root"), seed=config.seed, **options)


def _build_model(config: Config, info: DataInfo | None) -> nn.Sequential:
    """The model ``config.model`` names: a registry entry (``name``) or a builder of one's own (``_target_``)."""
    if TARGET in config.model:
        return build_target_model(config.model, info)
    if info is None:
        raise ConfigError(f"model={config.model['name']} needs the data's DataInfo, but data._target_="
                          f"{config.data.get(TARGET)} returned none; return (train, val, DataInfo(...)) from it")
    return build_model(config.model["name"], info, config.model.get("size", "full"), **model_options(config.model))


def _kept_balance(resume: dict[str, Any], saved: dict[str, Any], config: Config) -> list[int] | None:
    """The checkpoint's partition when this run keeps it: no ``pipeline.balance`` given, and the checkpoint's
    stage count and ``pipeline.partition``. Else None: the partition is chosen as configured and the
    checkpoint's state re-split onto it (``rayspec.training.resplit``)."""
    p, balance = config.pipeline, list(resume["balance"])
    if p.balance is not None or len(balance) != p.chunks:
        return None
    partition = saved.get("pipeline", {}).get("partition", "uniform")
    return balance if partition == p.partition else None


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
    (a resumed checkpoint's that the run keeps) wins over the config's.
    """
    p = config.pipeline
    uniform(len(model), p.chunks)  # the same clear error for too many stages, whatever the partition
    balance = balance if balance is not None else p.balance
    if balance is not None:
        check_balance(balance, len(model), p.chunks)
    profiled = p.partition == "profile" and balance is None
    profiles = profile_blocks(model, profile_sample(data, config), warmup=1, repeats=3 if profiled else 1)
    return choose_partition(model, p.chunks, partition=p.partition, balance=balance, profiles=profiles)


def profile_sample(data: DataBundle, config: Config) -> Any:
    """The input of one micro-batch, which blocks are profiled on."""
    size = max(1, min(config.train.batch_size // config.pipeline.group, len(data.train)))  # type: ignore[arg-type]
    return next(iter(eval_batches(data.train, size)))[0]


def replan(prepared: Prepared, profiles: list[BlockProfile]) -> Prepared:
    """``prepared`` with its partition chosen again from ``profiles`` measured elsewhere (on the stages' GPU): a
    ``profile`` partition may move; a given or resumed balance stays, with the new times in its table."""
    c = prepared.config
    balance = prepared.balance if (prepared.resume is not None or c.pipeline.balance is not None) else None
    plan = choose_partition(prepared.model, c.pipeline.chunks, partition=c.pipeline.partition, balance=balance,
                            profiles=profiles)
    return dataclasses.replace(prepared, balance=list(plan.balance), plan=plan)


def lr_schedule(config: Config) -> LRSchedule:
    """The learning rate per update count, the same for every method and stage."""
    o = config.optim
    return LRSchedule(o.lr, o.schedule, config.train.max_steps, o.warmup, o.power, o.min_lr)


def stage_spec(config: Config) -> StageSpec:
    """How every stage of the run trains, from the config: learning rate, optimizer, clipping, precision, the
    accumulation group, the staleness settings and the random seed (every executor and ``dataparallel`` build
    stages from it; ``make_stages`` adds the method's policy)."""
    o, p = config.optim, config.pipeline
    optim = OptimSpec(o.name, o.momentum, o.weight_decay, o.dampening, o.nesterov,
                      (float(o.betas[0]), float(o.betas[1])), o.eps, o.fused, o.compile)
    return StageSpec(lr=lr_schedule(config), optim=optim, clip_grad_norm=o.clip_grad_norm,
                     precision=config.train.precision, group=p.group, backward=p.backward, seed=config.seed,
                     trace=config.trace, predictor=p.predictor, probe=p.probe)
