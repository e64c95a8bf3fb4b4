"""The typed sections of a run's configuration, each with its defaults and its own ``check()``.

These dataclasses are the one source of defaults: Hydra composes them as the ``rayspec`` entry of its
config store (``rayspec.config.compose``), so ``rayspec/conf`` holds only groups with alternatives
(models, data sets, optimizers, loggers, debug presets, experiments), each file only what differs from
these defaults. The choices come from the registries of the
layers below (methods, transports, predictors, learning-rate schedules, partitions).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rayspec.config.checks import choice, integer, number, optional_integer
from rayspec.core.lr import LR_SCHEDULES
from rayspec.core.methods import BACKWARDS, METHODS, TWO_VERSIONS, VARIANTS, Method
from rayspec.core.optim import OPTIMIZERS
from rayspec.core.precision import PRECISIONS
from rayspec.core.predict import PREDICTORS
from rayspec.core.schedule import ScheduleError
from rayspec.core.schedule_text import load_schedule
from rayspec.core.transports import TRANSPORTS, check_placement
from rayspec.errors import ConfigError
from rayspec.partition import PARTITIONS

__all__ = ["Section", "PipelineConfig", "OptimConfig", "TrainConfig", "CheckpointConfig", "FaultConfig", "RayConfig",
           "EXECUTORS", "PLACEMENTS"]

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # a URI's start: scheme://
_ADDRESS = re.compile(r"^(ray://)?(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}$")  # [ray://]HOST:PORT

EXECUTORS = ("local", "ray")
PLACEMENTS = ("pack", "spread")
SPLIT_TRANSPORTS = ("auto", "p2p", "p2p_nccl")
"""The transports whose stage actors run their rank's own action list: ``I`` and ``W`` actions (the split backward
of ``zb1p``) and several model chunks per actor (``interleaved``, ``pipeline.virtual_stages`` > 1)."""


class Section:
    """A typed section: keyword fields only and no attribute but its fields (``slots``: a misspelt one is an
    ``AttributeError``); it checks itself where it is made (``__post_init__``, also run by ``dataclasses.replace``),
    and ``Config.validate`` checks it again, as its fields may be set after."""

    __slots__ = ()

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ConfigError`` naming the first value that cannot work and its fix."""


@dataclass(kw_only=True, slots=True)
class PipelineConfig(Section):
    method: str = "spectrain"
    """Training method (``rayspec.core.methods``; docs/design.md §2); ``dataparallel``: ``stages`` Ray Train DDP
    workers, each the whole model."""
    variant: str = "paper"
    """SpecTrain's prediction target: ``paper`` (v1) or ``consistent`` (v2)."""
    predictor: str = "linear"
    """SpecTrain's predicted step (``rayspec.core.predict``): ``linear`` is the paper's ``W - s * lr * v``;
    ``momentum``, ``adaptive``."""
    probe: int = 4096
    """Weight coordinates per stage on which SpecTrain's predictions are scored; 0: off."""
    backward: str = "mixed"
    """``mixed``: backward at the weights in storage with the forward's activations; ``recompute``: exact."""
    stages: int = 4
    """Pipeline stages N; at most the model's number of blocks."""
    microbatches: int = 4
    """``gpipe``, ``1f1b``, ``zb1p``, ``interleaved``: micro-batches each batch is split into (accumulated per
    update, the pipeline flushed). Others: unused."""
    accumulate: int = 1
    """``vanilla``, ``async``, ``pipedream``, ``spectrain``: micro-batches each batch is split into, their
    gradients summed into the batch's one update; the 1F1B pipeline streams on across batches (no flush), so
    only micro-batches that straddle an update see a stale (or predicted) version. 1: a batch is one micro-batch."""
    executor: str = "ray"
    """``local``: all stages in this process (the reference); ``ray``: one actor per stage."""
    transport: str = "auto"
    """How activations move between stage actors (``rayspec.core.transports``; docs/design.md §4): ``auto`` =
    p2p on CPU stages and on stages that share a GPU, p2p_nccl on a GPU per stage; ``p2p``, ``p2p_nccl``,
    ``object_store``, ``gloo``, ``nccl``, ``compiled``."""
    partition: str = "uniform"
    """How blocks are split among stages when ``balance`` is not given: ``uniform``, ``parameters``, ``profile``."""
    balance: list[int] | None = None
    """Explicit block counts per stage, e.g. ``[2,2,2,1]``; wins over ``partition``."""
    cpus_per_stage: float | None = None
    """CPUs reserved per stage actor; default: the cluster's CPUs shared among the stages (at most 1)."""
    gpus_per_stage: float | None = None
    """GPUs per stage actor; default 1 when the Ray cluster has GPUs, else 0 (a stage actor given a GPU computes on it)."""
    max_in_flight: int | None = None
    """``object_store``, ``gloo``, ``nccl``: bound on micro-batches in flight; default: twice what the schedule
    needs. ``p2p`` and ``compiled`` keep what the schedule needs and the inputs of two chunks."""
    placement: str = "pack"
    """Placement-group strategy for the stage actors: ``pack`` or ``spread``."""
    virtual_stages: int = 1
    """``interleaved``: model chunks per stage actor (stage actor k holds chunks k, k+N, ...; the model is cut into
    ``stages * virtual_stages`` chunks). Others: 1."""
    schedule_file: str | None = None
    """A schedule in torch's compute-only CSV (one row per stage actor, ``2F0``/``1I3``/``0W5`` cells) run for every
    batch instead of the method's own (``rayspec.core.schedule_text``); for the synchronous methods (policy none,
    one update per batch of ``microbatches``); null: the method's schedule."""

    @property
    def group(self) -> int:
        """Micro-batches per optimizer update: ``microbatches`` for gpipe, ``accumulate`` for the others."""
        method = METHODS.get(self.method)
        return self.microbatches if method and method.group_setting == "pipeline.microbatches" else self.accumulate

    @property
    def chunks(self) -> int:
        """Model chunks the model is cut into: ``stages * virtual_stages`` (one per stage of the schedule)."""
        return self.stages * self.virtual_stages

    def check(self) -> None:
        choice("pipeline.method", self.method, METHODS)
        choice("pipeline.variant", self.variant, VARIANTS)
        choice("pipeline.predictor", self.predictor, PREDICTORS)
        integer("pipeline.probe", self.probe, 0, "use 0 to turn the prediction probe off")
        choice("pipeline.backward", self.backward, BACKWARDS)
        choice("pipeline.executor", self.executor, EXECUTORS)
        choice("pipeline.transport", self.transport, TRANSPORTS)
        choice("pipeline.partition", self.partition, PARTITIONS)
        choice("pipeline.placement", self.placement, PLACEMENTS)
        integer("pipeline.stages", self.stages, 1, "use at least one stage")
        integer("pipeline.microbatches", self.microbatches, 1, "split each batch into at least one micro-batch")
        integer("pipeline.accumulate", self.accumulate, 1, "use 1 for one micro-batch per update")
        optional_integer("pipeline.max_in_flight", self.max_in_flight, 1, "use null for the default")
        method = METHODS[self.method]
        if self.accumulate > 1 and method.group_setting != "pipeline.accumulate":
            fix = f"set {method.group_setting} instead" if method.group_setting else "remove it"
            raise ConfigError(f"pipeline.accumulate={self.accumulate} does not apply to pipeline.method={self.method}; {fix}")
        if method.predicts and self.predictor == "adaptive" and self.probe == 0:
            raise ConfigError("pipeline.predictor=adaptive damps each prediction by what the prediction probe measured, "
                              "but pipeline.probe=0 turns the probe off (every prediction would be linear's); set "
                              "pipeline.probe to a sample size (default 4096) or use pipeline.predictor=linear")
        if not method.pipelined and self.executor != "ray":
            raise ConfigError(
                f"pipeline.executor={self.executor} does not apply to pipeline.method={self.method} (it runs on Ray "
                "Train); use pipeline.executor=ray, or pipeline.method=vanilla for the single-process reference"
            )
        if method.pipelined and self.balance is not None and len(self.balance) != self.stages * self.virtual_stages:
            raise ConfigError(
                f"pipeline.balance={self.balance} has {len(self.balance)} entries but pipeline.stages={self.stages}"
                f" x pipeline.virtual_stages={self.virtual_stages}; give one block count per stage (model chunk)"
            )
        self._check_schedule(method)
        for name in ("cpus_per_stage", "gpus_per_stage"):
            v = getattr(self, name)
            if v is not None and (not number(v) or v < 0 or (name == "cpus_per_stage" and v == 0)):
                raise ConfigError(f"pipeline.{name}={v!r} must be a positive number (or null for the default)")
        # The stages' GPUs, not this process's: a job's driver may run on a CPU-only head. With
        # gpus_per_stage null the cluster decides, and the transport is checked once Ray is up.
        if self.gpus_per_stage is not None:
            check_placement(self.transport, self.gpus_per_stage)

    def _check_schedule(self, method: Method) -> None:
        """Virtual stages, a schedule file, and the executors and transports that can run split backwards."""
        integer("pipeline.virtual_stages", self.virtual_stages, 1, "use 1 unless pipeline.method=interleaved")
        if self.virtual_stages > 1 and method.schedule != "interleaved" and self.schedule_file is None:
            raise ConfigError(f"pipeline.virtual_stages={self.virtual_stages} applies to pipeline.method=interleaved "
                              "only; set it to 1 or use the interleaved method")
        if method.schedule == "interleaved" and self.microbatches % self.stages:
            raise ConfigError(f"pipeline.microbatches={self.microbatches}: interleaved 1F1B runs micro-batches in "
                              f"rounds of pipeline.stages={self.stages}; use a multiple of {self.stages}")
        if method.policy in TWO_VERSIONS and self.accumulate < self.stages - 1:
            raise ConfigError(f"pipeline.accumulate={self.accumulate}: {self.method} keeps two weight versions, so no "
                              "micro-batch may be in flight across two updates; use pipeline.accumulate >= "
                              f"{self.stages - 1} (pipeline.stages - 1)")
        virtual, splits = self.virtual_stages, method.schedule == "zb1p"
        if self.schedule_file is not None:
            if not (method.flushes and method.policy == "none" and method.group_setting == "pipeline.microbatches"):
                raise ConfigError(f"pipeline.schedule_file runs one update per batch without staleness; "
                                  f"pipeline.method={self.method} is not such a method: use 1f1b, zb1p or interleaved")
            try:
                schedule = load_schedule(self.schedule_file)
            except (OSError, ScheduleError) as err:
                raise ConfigError(f"pipeline.schedule_file={self.schedule_file}: {err}") from None
            if (schedule.ranks, schedule.microbatches, schedule.virtual) != (self.stages, self.microbatches, virtual):
                raise ConfigError(
                    f"pipeline.schedule_file={self.schedule_file} has {schedule.ranks} ranks, {schedule.microbatches} "
                    f"micro-batches and {schedule.virtual} stages per rank; set pipeline.stages={schedule.ranks} "
                    f"pipeline.microbatches={schedule.microbatches} pipeline.virtual_stages={schedule.virtual}")
            splits = schedule.splits_backward
        if self.executor == "ray" and virtual > 1 and self.transport not in SPLIT_TRANSPORTS:
            raise ConfigError(f"pipeline.virtual_stages={virtual}: with pipeline.transport={self.transport} a stage "
                              f"actor hosts one stage; use pipeline.transport={' or '.join(SPLIT_TRANSPORTS)}, whose "
                              "stage actors host several model chunks, or pipeline.executor=local")
        if self.executor == "ray" and splits and self.transport not in SPLIT_TRANSPORTS:
            raise ConfigError(f"pipeline.transport={self.transport} runs no split backward (I and W actions); use "
                              f"pipeline.transport={' or '.join(SPLIT_TRANSPORTS)}, or pipeline.executor=local")


@dataclass(kw_only=True, slots=True)
class OptimConfig(Section):
    name: str = "sgd"
    """The optimizer (``rayspec.core.optim.OPTIMIZERS``): ``sgd``, ``adam`` or ``adamw``; ``optim=adamw`` picks the
    group file ``rayspec/conf/optim/adamw.yaml`` (its learning rate and weight decay). SpecTrain predicts along the
    optimizer's own next step (``rayspec.core.predict``)."""
    lr: float = 0.01
    """Base learning rate (> 0)."""
    momentum: float = 0.9
    """SGD momentum in [0, 1); SpecTrain's smoothed gradient is its buffer."""
    weight_decay: float = 0.0
    """L2 for ``sgd`` and ``adam`` (it enters the gradient), decoupled for ``adamw``."""
    dampening: float = 0.0
    nesterov: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam's and AdamW's averaging factors of the gradient and of its square, each in [0, 1)."""
    eps: float = 1e-8
    """Adam's and AdamW's term added to the root of the second moment (> 0)."""
    fused: bool = True
    """torch's fused optimizer kernels (one pass per tensor; on CPU AdamW's is 5-7x faster); false: its foreach
    kernels, bit-exact with torch's per-tensor loops (the fused ones differ by rounding)."""
    compile: bool = False
    """SpecTrain's update and the prediction that follows it as one ``torch.compile``d pass over memory
    (``rayspec.core.fused``; ``sgd`` with momentum, ``adam``, ``adamw``): faster per micro-batch, equal to torch's
    step to rounding; each process compiles once (seconds). Other methods keep torch's step."""
    clip_grad_norm: float | None = None
    """Clip each update's gradient to this 2-norm (null: off). ``vanilla`` and ``gpipe`` clip by the norm over all
    stages, as clipping the whole model in one process; the asynchronous methods by each stage's own norm."""
    schedule: str = "constant"
    """Learning-rate schedule over updates, the same for every method and stage: ``constant``, ``poly``
    (the paper's, power 2) or ``cosine``."""
    warmup: int = 0
    """Linear warm-up updates."""
    power: float = 2.0
    """Exponent of ``poly``."""
    min_lr: float = 0.0
    """Floor of ``poly`` and ``cosine``."""

    def check(self) -> None:
        choice("optim.name", self.name, OPTIMIZERS)
        choice("optim.schedule", self.schedule, LR_SCHEDULES)
        integer("optim.warmup", self.warmup, 0, "use 0 for no warm-up")
        if not number(self.lr) or self.lr <= 0:
            raise ConfigError(f"optim.lr={self.lr!r} must be a positive number, e.g. optim.lr=0.05")
        if not number(self.momentum) or not 0 <= self.momentum < 1:
            raise ConfigError(f"optim.momentum={self.momentum!r} must be in [0, 1), e.g. optim.momentum=0.9")
        if not number(self.weight_decay) or self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={self.weight_decay!r} must be >= 0")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError("optim.nesterov=true needs optim.momentum > 0 and optim.dampening=0")
        betas = list(self.betas) if isinstance(self.betas, (list, tuple)) else None
        if betas is None or len(betas) != 2 or not all(number(b) and 0 <= b < 1 for b in betas):
            raise ConfigError(f"optim.betas={self.betas!r} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.999]")
        if not number(self.eps) or self.eps <= 0:
            raise ConfigError(f"optim.eps={self.eps!r} must be a positive number, e.g. optim.eps=1e-8")
        if not isinstance(self.fused, bool):
            raise ConfigError(f"optim.fused={self.fused!r} must be true or false")
        if not isinstance(self.compile, bool):
            raise ConfigError(f"optim.compile={self.compile!r} must be true or false")
        if self.clip_grad_norm is not None and (not number(self.clip_grad_norm) or self.clip_grad_norm <= 0):
            raise ConfigError(f"optim.clip_grad_norm={self.clip_grad_norm!r} must be a positive number, e.g. "
                              "optim.clip_grad_norm=1.0 (or null for no clipping)")


@dataclass(kw_only=True, slots=True)
class TrainConfig(Section):
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
    precision: str = "fp32"
    """``bf16``: forwards under autocast and bfloat16 activations and gradients between stages (half the bytes);
    weights, optimizer state and SpecTrain's predictions stay float32 (``rayspec.core.precision``)."""

    def check(self) -> None:
        choice("train.precision", self.precision, PRECISIONS)
        integer("train.max_steps", self.max_steps, 1, "train for at least one update")
        integer("train.batch_size", self.batch_size, 1, "use a positive batch size")
        integer("train.log_every", self.log_every, 1, "log at least every update count >= 1")
        integer("train.eval_every", self.eval_every, 0, "use 0 to evaluate only at the end")
        integer("train.eval_batch_size", self.eval_batch_size, 1, "use a positive batch size")
        for name in ("train_samples", "val_samples"):
            optional_integer(f"train.{name}", getattr(self, name), 1, "use null for the whole split")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig(Section):
    every: int = 0
    """Updates between checkpoints (0: only at the end); the pipeline drains at each (docs/design.md §7)."""
    keep: int = 3
    """Newest checkpoints kept; older ones are deleted."""
    dir: str | None = None
    """Where checkpoints go, a local folder; default ``RUN_DIR/checkpoints`` (or ``STORAGE/checkpoints``)."""
    storage: str | None = None
    """Storage every node can reach, as Ray Train's ``storage_path``: a local path (NFS) or any ``pyarrow.fs`` URI
    (``file://``, ``s3://``, ``gs://``); checkpoints go to ``STORAGE/checkpoints``, a copy of ``summary.json`` to
    ``STORAGE``, and ``resume=auto`` reads from there (``rayspec.training.storage``). null: the run directory."""
    resume: str | None = None
    """``auto`` (the newest good checkpoint in ``dir`` or ``storage``, if any), a checkpoint file, a run directory or
    a storage root (a path or URI); null: start afresh."""

    def check(self) -> None:
        integer("checkpoint.every", self.every, 0, "use 0 to checkpoint only at the end")
        integer("checkpoint.keep", self.keep, 1, "keep at least the newest checkpoint")
        for name in ("dir", "storage", "resume"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"checkpoint.{name}={getattr(self, name)!r} must be a path (or null)")
            if getattr(self, name) == "":
                raise ConfigError(f"checkpoint.{name}='' is empty; give a path, or null for the default")
        if self.dir is not None and self.storage is not None:
            raise ConfigError(
                f"checkpoint.dir={self.dir} and checkpoint.storage={self.storage} both say where checkpoints go; "
                "set one (storage puts them in STORAGE/checkpoints)"
            )
        if self.storage is not None and "://" in self.storage and not _SCHEME.match(self.storage):
            raise ConfigError(
                f"checkpoint.storage={self.storage} is not a URI (scheme://path); write e.g. file:///shared/runs/a, "
                "s3://bucket/runs/a, or a plain path"
            )


@dataclass(kw_only=True, slots=True)
class FaultConfig(Section):
    max_restarts: int = 0
    """Times a run whose stage or driver actor died is restarted from its last checkpoint (Ray executor only)."""
    elastic: bool = False
    """When a restart finds that the cluster's live nodes no longer hold a bundle for every stage (a node was lost
    and not replaced), go on with as many stages as bundles remain, at least 2, re-split from the newest checkpoint
    (logged, and in ``summary.json``'s ``layout_changes``); false: wait up to 120 s for Ray to place them again,
    then fail naming this setting. Pipeline methods on the Ray executor with ``fault.max_restarts`` > 0."""

    def check(self) -> None:
        integer("fault.max_restarts", self.max_restarts, 0, "use 0 to stop at the first failure")
        if not isinstance(self.elastic, bool):
            raise ConfigError(f"fault.elastic={self.elastic!r} must be true or false")
        if self.elastic and self.max_restarts == 0:
            raise ConfigError("fault.elastic=true acts when a run restarts after a lost stage, but fault.max_restarts=0 "
                              "allows none; set fault.max_restarts to 1 or more")


@dataclass(kw_only=True, slots=True)
class RayConfig(Section):
    address: str | None = None
    """null: start a fresh local Ray, or join the cluster in ``RAY_ADDRESS`` when that is set (a ``ray job submit``
    job); ``auto``: the head ``ray start`` recorded on this machine; ``HOST:PORT`` or ``ray://HOST:PORT``: that
    head (``rayspec.exec.ray.connect``, [Note: Ray address])."""
    num_cpus: int | None = None
    """CPUs of the local Ray that rayspec starts (null: the machine's)."""
    log_to_driver: bool = True
    """Print the actors' logs in this process."""
    connect_timeout_s: float = 30.0
    """How long to wait for the head of a cluster to join before failing with an error that names it."""

    def check(self) -> None:
        if not number(self.connect_timeout_s) or self.connect_timeout_s <= 0:
            raise ConfigError(f"ray.connect_timeout_s={self.connect_timeout_s!r} must be a positive number of seconds")
        if self.address not in (None, "local") and self.num_cpus is not None:
            raise ConfigError(
                f"ray.num_cpus={self.num_cpus} applies only when rayspec starts Ray itself; remove it when "
                f"joining the cluster at ray.address={self.address} (the cluster's nodes set their CPUs)"
            )
        optional_integer("ray.num_cpus", self.num_cpus, 1, "use null for the machine's CPUs")
        if self.address is not None and not isinstance(self.address, str):
            raise ConfigError(f"ray.address={self.address!r} must be HOST:PORT, ray://HOST:PORT, auto, local or null")
        if self.address not in (None, "local", "auto") and not _ADDRESS.match(self.address):
            scheme = self.address.split("://", 1)[0] if "://" in self.address else None
            why = f"its scheme {scheme}:// is not Ray's" if scheme else "it is not HOST:PORT"
            raise ConfigError(
                f"ray.address={self.address}: {why}; give the head's HOST:PORT (its GCS port, 6379 by default), "
                "ray://HOST:PORT for Ray Client, auto, or null for a local Ray"
            )
