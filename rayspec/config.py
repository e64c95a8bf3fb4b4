"""Typed run configuration, built from Hydra's config and validated before Ray starts."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rayspec.optim import SCHEDULES as LR_SCHEDULES
from rayspec.predict import PREDICTORS
from rayspec.schedule import METHOD_SCHEDULE, VARIANTS

__all__ = ["TRANSPORTS", "ConfigError", "Config", "PipelineConfig", "OptimConfig", "TrainConfig", "CheckpointConfig", "FaultConfig", "from_mapping", "METHODS"]

METHODS = ("dataparallel", *METHOD_SCHEDULE)  # dataparallel has no pipeline schedule: rayspec.dataparallel
PARTITIONS = ("uniform", "parameters", "profile")
TRANSPORTS = ("auto", "object_store", "gloo", "nccl", "compiled", "p2p")
LOGGERS = ("none", "wandb")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the value and the fix."""


@dataclass
class PipelineConfig:
    method: Literal["dataparallel", "vanilla", "gpipe", "async", "pipedream", "spectrain"] = "spectrain"
    """Training method (DESIGN §2); ``dataparallel``: ``stages`` Ray Train DDP workers, each the whole model."""
    variant: Literal["paper", "consistent"] = "paper"
    """SpecTrain's prediction target: ``paper`` (v1) or ``consistent`` (v2)."""
    predictor: Literal["linear", "momentum", "adaptive"] = "linear"
    """SpecTrain's predicted step (``rayspec.predict``): ``linear`` is the paper's ``W - s * lr * v``."""
    probe: int = 4096
    """Weight coordinates per stage on which SpecTrain's predictions are scored (``rayspec.predict``); 0: off."""
    backward: Literal["mixed", "recompute"] = "mixed"
    """``mixed``: backward at the weights in storage with the forward's activations; ``recompute``: exact."""
    stages: int = 4
    """Pipeline stages N; at most the model's number of blocks."""
    microbatches: int = 4
    """``gpipe``: micro-batches each batch is split into (accumulated per update). Others: unused."""
    accumulate: int = 1
    """``vanilla``, ``async``, ``pipedream``, ``spectrain``: micro-batches each batch is split into, their
    gradients summed into the batch's one update; the 1F1B pipeline streams on across batches (no flush), so
    only micro-batches that straddle an update see a stale (or predicted) version. 1: a batch is one micro-batch."""
    executor: Literal["local", "ray"] = "ray"
    """``local``: all stages in this process (the reference); ``ray``: one actor per stage."""
    transport: Literal["auto", "object_store", "gloo", "nccl", "compiled", "p2p"] = "auto"
    """How activations move: ``auto`` = nccl RDT on GPUs, ``p2p`` on CPU; ``p2p`` (CPU stages): each stage runs
    its actions chunk by chunk and sends to its neighbours over gloo; ``object_store``: one Ray actor call per
    action, tensors through the zero-copy object store; ``compiled``: a Ray Compiled Graph (shared-memory
    channels on a node, NCCL between GPUs)."""
    partition: Literal["uniform", "parameters", "profile"] = "uniform"
    """How blocks are split among stages when ``balance`` is not given."""
    balance: list[int] | None = None
    """Explicit block counts per stage; wins over ``partition``."""
    cpus_per_stage: float | None = None
    """CPUs reserved per stage actor; default: the cluster's CPUs shared among the stages (at most 1)."""
    gpus_per_stage: float | None = None
    """GPUs per stage actor; default 1 when the Ray cluster has GPUs, else 0 (a stage actor given a GPU computes on it)."""
    max_in_flight: int | None = None
    """``object_store``, ``gloo``, ``nccl``: bound on micro-batches in flight; default: twice what the schedule
    needs. ``p2p`` and ``compiled`` keep what the schedule needs and the inputs of two chunks."""
    placement: Literal["pack", "spread"] = "pack"
    """Placement-group strategy for the stage actors."""

    @property
    def group(self) -> int:
        """Micro-batches per optimizer update: ``microbatches`` for gpipe, ``accumulate`` for the others."""
        return self.microbatches if self.method == "gpipe" else self.accumulate


@dataclass
class OptimConfig:
    lr: float = 0.01
    """Base learning rate (> 0)."""
    momentum: float = 0.9
    """SGD momentum in [0, 1); SpecTrain's smoothed gradient is its buffer."""
    weight_decay: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    schedule: Literal["constant", "poly", "cosine"] = "constant"
    """Learning-rate schedule over updates, the same for every method and stage."""
    warmup: int = 0
    """Linear warm-up updates."""
    power: float = 2.0
    """Exponent of ``poly`` (the paper's: 2)."""
    min_lr: float = 0.0


@dataclass
class TrainConfig:
    max_steps: int = 300
    """Optimizer updates to run (each consumes one batch)."""
    batch_size: int = 64
    """Samples per update (gpipe splits it into ``pipeline.microbatches``, the others into ``pipeline.accumulate``)."""
    log_every: int = 25
    """Updates between progress lines and metrics records."""
    eval_every: int = 0
    """Updates between evaluations on the validation split (0: only at the end); the pipeline drains there."""
    eval_batch_size: int = 512
    train_samples: int | None = None
    """Use only the first this many training samples (a smoke run); None: all."""
    val_samples: int | None = None
    """Evaluate on only the first this many validation samples; None: all."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Updates between checkpoints (0: only at the end); the pipeline drains at each (``rayspec.checkpoint``)."""
    keep: int = 3
    """Newest checkpoints kept; older ones are deleted."""
    dir: str | None = None
    """Where checkpoints go; default ``RUN_DIR/checkpoints``."""
    resume: str | None = None
    """``auto`` (the newest checkpoint in ``dir``, if any), a checkpoint file or a run directory; null: start afresh."""


@dataclass
class FaultConfig:
    max_restarts: int = 0
    """Times a run whose stage actor died is restarted from its last checkpoint (Ray executor only)."""


@dataclass
class Config:
    model: dict[str, Any] = field(default_factory=lambda: {"name": "mlp", "size": "small"})
    data: dict[str, Any] = field(default_factory=lambda: {"name": "synthetic_image"})
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ray: dict[str, Any] = field(default_factory=dict)
    logger: dict[str, Any] = field(default_factory=lambda: {"name": "none"})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    seed: int = 0
    trace: bool = False
    """Record every action's start and end; write ``trace.json`` (Chrome/Perfetto) and ``timeline.png``."""

    def validate(self) -> Config:
        """Check every value that needs no model or data; raise ``ConfigError`` naming the value and the fix."""
        p, o, t = self.pipeline, self.optim, self.train
        _choice("pipeline.method", p.method, METHODS)
        _choice("pipeline.variant", p.variant, VARIANTS)
        _choice("pipeline.predictor", p.predictor, PREDICTORS)
        _int("pipeline.probe", p.probe, 0, "use 0 to turn the prediction probe off")
        _choice("pipeline.backward", p.backward, ("mixed", "recompute"))
        _choice("pipeline.executor", p.executor, ("local", "ray"))
        _choice("pipeline.transport", p.transport, TRANSPORTS)
        _choice("pipeline.partition", p.partition, PARTITIONS)
        _choice("pipeline.placement", p.placement, ("pack", "spread"))
        _choice("optim.schedule", o.schedule, LR_SCHEDULES)
        _int("pipeline.stages", p.stages, 1, "use at least one stage")
        _int("pipeline.microbatches", p.microbatches, 1, "split each batch into at least one micro-batch")
        _int("pipeline.accumulate", p.accumulate, 1, "use 1 for one micro-batch per update")
        _int("train.max_steps", t.max_steps, 1, "train for at least one update")
        _int("train.batch_size", t.batch_size, 1, "use a positive batch size")
        _int("train.log_every", t.log_every, 1, "log at least every update count >= 1")
        _int("train.eval_every", t.eval_every, 0, "use 0 to evaluate only at the end")
        _int("optim.warmup", o.warmup, 0, "use 0 for no warm-up")
        _int("train.eval_batch_size", t.eval_batch_size, 1, "use a positive batch size")
        for name in ("train_samples", "val_samples"):
            if getattr(t, name) is not None:
                _int(f"train.{name}", getattr(t, name), 1, "use null for the whole split")
        _int("seed", self.seed, 0, "use a non-negative integer seed")
        ck = self.checkpoint
        _int("checkpoint.every", ck.every, 0, "use 0 to checkpoint only at the end")
        _int("checkpoint.keep", ck.keep, 1, "keep at least the newest checkpoint")
        _int("fault.max_restarts", self.fault.max_restarts, 0, "use 0 to stop at the first failure")
        for name in ("dir", "resume"):
            if getattr(ck, name) is not None and not isinstance(getattr(ck, name), str):
                raise ConfigError(f"checkpoint.{name}={getattr(ck, name)!r} must be a path (or null)")
        _choice("logger", (self.logger or {}).get("name", "none"), LOGGERS)
        if self.ray.get("address") and (self.ray.get("num_cpus") is not None):
            raise ConfigError(
                f"ray.num_cpus={self.ray['num_cpus']} applies only when rayspec starts Ray itself; remove it when "
                f"joining the cluster at ray.address={self.ray['address']} (the cluster's nodes set their CPUs)"
            )
        if not isinstance(self.trace, bool):
            raise ConfigError(f"trace={self.trace!r} must be true or false, e.g. +trace=true")
        if not _number(o.lr) or o.lr <= 0:
            raise ConfigError(f"optim.lr={o.lr!r} must be a positive number, e.g. optim.lr=0.05")
        if not _number(o.momentum) or not 0 <= o.momentum < 1:
            raise ConfigError(f"optim.momentum={o.momentum!r} must be in [0, 1), e.g. optim.momentum=0.9")
        if not _number(o.weight_decay) or o.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={o.weight_decay!r} must be >= 0")
        if o.nesterov and (o.momentum <= 0 or o.dampening != 0):
            raise ConfigError("optim.nesterov=true needs optim.momentum > 0 and optim.dampening=0")
        if p.accumulate > 1 and p.method in ("gpipe", "dataparallel"):
            fix = "set pipeline.microbatches instead" if p.method == "gpipe" else "remove it"
            raise ConfigError(
                f"pipeline.accumulate={p.accumulate} does not apply to pipeline.method={p.method}; {fix}"
            )
        if t.batch_size % p.group:
            key = "pipeline.microbatches" if p.method == "gpipe" else "pipeline.accumulate"
            raise ConfigError(
                f"train.batch_size={t.batch_size} is not divisible by {key}={p.group}; each batch is split into "
                f"equal micro-batches: pick a multiple of {key}"
            )
        if p.method == "dataparallel":
            if t.batch_size % p.stages:
                raise ConfigError(
                    f"train.batch_size={t.batch_size} is not divisible by pipeline.stages={p.stages}; dataparallel "
                    "splits each batch into equal shards, one per worker: pick a multiple of pipeline.stages"
                )
            if p.executor != "ray":
                raise ConfigError(
                    f"pipeline.executor={p.executor} does not apply to pipeline.method=dataparallel (it runs on Ray "
                    "Train); use pipeline.executor=ray, or pipeline.method=vanilla for the single-process reference"
                )
        elif p.balance is not None and len(p.balance) != p.stages:
            raise ConfigError(
                f"pipeline.balance={p.balance} has {len(p.balance)} entries but pipeline.stages={p.stages}; "
                "give one block count per stage"
            )
        for name in ("cpus_per_stage", "gpus_per_stage"):
            v = getattr(p, name)
            if v is not None and (not _number(v) or v < 0 or (name == "cpus_per_stage" and v == 0)):
                raise ConfigError(f"pipeline.{name}={v!r} must be a positive number (or null for the default)")
        if p.transport == "p2p" and p.gpus_per_stage:
            raise ConfigError(
                f"pipeline.transport=p2p moves CPU tensors over gloo, but pipeline.gpus_per_stage={p.gpus_per_stage:g}; "
                "use pipeline.transport=nccl or compiled for stages on GPUs, or pipeline.gpus_per_stage=0"
            )
        if p.transport == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(
                    "pipeline.transport=nccl needs GPUs but CUDA is not available; "
                    "use pipeline.transport=auto (p2p on CPU) or gloo"
                )
        for key in ("name",):
            if not isinstance(self.model.get(key), str):
                raise ConfigError(f"model.{key} must be set, e.g. model=mlp")
            if not isinstance(self.data.get(key), str):
                raise ConfigError(f"data.{key} must be set, e.g. data=synthetic_image")
        return self


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is unknown; choose one of {', '.join(choices)}")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(name: str, value: Any, low: int, fix: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be an integer; {fix}")
    if value < low:
        raise ConfigError(f"{name}={value} must be >= {low}; {fix}")


def _section(cls: type, name: str, values: Mapping[str, Any] | None) -> Any:
    values = dict(values or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(name + '.' + k for k in unknown)}; known: {', '.join(sorted(known))}")
    return cls(**values)


def merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``top``'s values on top, nested mappings merged key by key."""
    out = dict(base)
    for k, v in top.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def from_mapping(cfg: Mapping[str, Any]) -> Config:
    """Build and validate a ``Config`` from a plain mapping (e.g. ``OmegaConf.to_container(cfg)``).

    A ``debug`` section (the ``debug=...`` config group) is merged over everything else last, so a
    smoke-run setting shrinks any experiment whatever order the groups were chosen in.
    """
    cfg = dict(cfg)
    debug = cfg.pop("debug", None)
    if debug:
        if not isinstance(debug, Mapping):
            raise ConfigError(f"debug={debug!r} must be a config section; choose one from conf/debug/, e.g. debug=smoke")
        cfg = merge(cfg, debug)
    extra = sorted(set(cfg) - {f.name for f in dataclasses.fields(Config)} - {"hydra", "experiment"})
    if extra:
        raise ConfigError(f"unknown top-level key(s) {', '.join(extra)}")
    pipeline = dict(cfg.get("pipeline") or {})
    if pipeline.get("balance") is not None:
        pipeline["balance"] = list(pipeline["balance"])
    config = Config(
        model=dict(cfg.get("model") or {}),
        data=dict(cfg.get("data") or {}),
        pipeline=_section(PipelineConfig, "pipeline", pipeline),
        optim=_section(OptimConfig, "optim", cfg.get("optim")),
        train=_section(TrainConfig, "train", cfg.get("train")),
        checkpoint=_section(CheckpointConfig, "checkpoint", cfg.get("checkpoint")),
        fault=_section(FaultConfig, "fault", cfg.get("fault")),
        ray=dict(cfg.get("ray") or {}),
        logger=dict(cfg.get("logger") or {"name": "none"}),
        seed=cfg.get("seed", 0),
        trace=cfg.get("trace", False),
    )
    return config.validate()
