"""A run's whole configuration: the typed sections, the free-form ``model``/``data``/``logger`` sections,
and the checks that span sections; built from Hydra's composed config and validated before Ray starts."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rayspec.config.checks import choice, integer
from rayspec.config.sections import (
    CheckpointConfig,
    FaultConfig,
    OptimConfig,
    PipelineConfig,
    RayConfig,
    TrainConfig,
)
from rayspec.core.methods import METHODS
from rayspec.core.transports import check_global_norm
from rayspec.errors import ConfigError
from rayspec.targets import TARGET

__all__ = ["Config", "LOGGERS", "SECTIONS", "from_mapping", "merge", "defaults"]

LOGGERS = ("none", "wandb")
SECTIONS = {"pipeline": PipelineConfig, "optim": OptimConfig, "train": TrainConfig, "checkpoint": CheckpointConfig,
            "fault": FaultConfig, "ray": RayConfig}
"""The typed sections by name."""
_GROUPS = ("model", "data", "logger")
"""Free-form sections chosen as Hydra config groups (``rayspec/conf``): their keys belong to the model builder,
the data set and the logger."""
_SWITCHES = ("trace",)
"""Settings a command line adds with ``+`` (``+trace=true``): not in Hydra's composed defaults."""


@dataclass(kw_only=True, slots=True)
class Config:
    """A run's configuration: the typed sections, each checked where it is made, the free-form ``model``, ``data``
    and ``logger`` sections and the top-level settings. No attribute but these (a misspelt one is an
    ``AttributeError``); ``validate`` checks the sections again (a field may be set after) and across sections."""

    model: dict[str, Any] = field(default_factory=lambda: {"name": "mlp", "size": "small"})
    """``name`` (``rayspec.models``), ``size`` (``full``, ``small``, ``tiny``) and the builder's options; or, for a
    model of your own, ``_target_`` (``mypkg.models.build``) and its arguments (``rayspec.models.custom``)."""
    data: dict[str, Any] = field(default_factory=lambda: {"name": "synthetic_image"})
    """``name`` (``rayspec.data``), ``root`` and the data set's options; or ``_target_`` and its arguments
    (``rayspec.data.custom``)."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    logger: dict[str, Any] = field(default_factory=lambda: {"name": "none"})
    """``name`` (``none`` or ``wandb``) and the logger's options (``rayspec.training.loggers``)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    seed: int = 0
    trace: bool = False
    """Record every action's start and end; write ``trace.json`` (Chrome/Perfetto) and ``timeline.png``."""

    def validate(self) -> Config:
        """Check every value that needs no model or data; raise ``ConfigError`` naming the value and the fix."""
        for name in SECTIONS:
            getattr(self, name).check()
        p, t = self.pipeline, self.train
        integer("seed", self.seed, 0, "use a non-negative integer seed")
        choice("logger", (self.logger or {}).get("name", "none"), LOGGERS)
        if not isinstance(self.trace, bool):
            raise ConfigError(f"trace={self.trace!r} must be true or false, e.g. +trace=true")
        if t.batch_size % p.group:
            key = METHODS[p.method].group_setting
            raise ConfigError(
                f"train.batch_size={t.batch_size} is not divisible by {key}={p.group}; each batch is split into "
                f"equal micro-batches: pick a multiple of {key}"
            )
        if not METHODS[p.method].pipelined and t.batch_size % p.stages:
            raise ConfigError(
                f"train.batch_size={t.batch_size} is not divisible by pipeline.stages={p.stages}; {p.method} "
                "splits each batch into equal shards, one per worker: pick a multiple of pipeline.stages"
            )
        if self.optim.clip_grad_norm is not None and METHODS[p.method].flushes and p.executor == "ray" \
                and p.transport != "auto":
            check_global_norm(p.transport, p.method)
        if self.fault.elastic and p.schedule_file is not None:
            raise ConfigError(f"fault.elastic=true may change the stage count, but pipeline.schedule_file={p.schedule_file} "
                              "fixes it; drop one of them")
        _check_builder("model", self.model, "model=mlp")
        _check_builder("data", self.data, "data=synthetic_image")
        return self

    @property
    def model_name(self) -> str:
        """The model's registry name, or its ``_target_``."""
        return str(self.model.get("name") or self.model.get(TARGET))

    @property
    def data_name(self) -> str:
        """The data set's registry name, or its ``_target_``."""
        return str(self.data.get("name") or self.data.get(TARGET))


def _check_builder(section: str, cfg: dict[str, Any], example: str) -> None:
    """A ``model`` or ``data`` section names a registry entry (``name``) or a builder of one's own (``_target_``)."""
    name, target = cfg.get("name"), cfg.get(TARGET)
    if target is not None and name is not None:
        raise ConfigError(
            f"{section}._target_={target} and {section}.name={name} are both set ({section}.name comes from the "
            f"group {section}={name}); pick {section}=custom {section}._target_={target}, or a {section}/NAME.yaml "
            "of your own that sets _target_"
        )
    if target is not None:
        if not isinstance(target, str) or target in ("", "???"):
            raise ConfigError(f"{section}._target_={target!r} must be the dotted path of a builder, "
                              f"e.g. {section}._target_=mypkg.{section}.build")
    elif not isinstance(name, str):
        raise ConfigError(f"{section}.name (or {section}._target_) must be set, e.g. {example}")


def defaults() -> dict[str, Any]:
    """The typed sections' defaults and the top-level settings, as Hydra's ``rayspec`` config-store entry
    (the free-form sections come from their config groups, the switches from ``+key=value``)."""
    values = dataclasses.asdict(Config())
    return {k: v for k, v in values.items() if k not in _GROUPS + _SWITCHES}


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
    smoke-run setting shrinks any experiment whatever order the groups were chosen in. A model of one's own
    (``model._target_``) takes only the debug keys its config already has (``model.size`` if it has a ``size``).
    """
    cfg = dict(cfg)
    debug = cfg.pop("debug", None)
    if debug:
        if not isinstance(debug, Mapping):
            raise ConfigError(f"debug={debug!r} must be a config section; choose one from rayspec/conf/debug/, "
                              "e.g. debug=smoke")
        for section in _GROUPS:
            own = cfg.get(section)
            if isinstance(own, Mapping) and TARGET in own and isinstance(debug.get(section), Mapping):
                debug = {**debug, section: {k: v for k, v in debug[section].items() if k in own}}
        cfg = merge(cfg, debug)
    extra = sorted(set(cfg) - {f.name for f in dataclasses.fields(Config)} - {"hydra", "experiment"})
    if extra:
        raise ConfigError(f"unknown top-level key(s) {', '.join(extra)}; the top-level keys are "
                          f"{', '.join(f.name for f in dataclasses.fields(Config))} (check the spelling)")
    pipeline = dict(cfg.get("pipeline") or {})
    if pipeline.get("balance") is not None:
        pipeline["balance"] = list(pipeline["balance"])
    sections = {name: _section(cls, name, pipeline if name == "pipeline" else cfg.get(name))
                for name, cls in SECTIONS.items()}
    config = Config(
        model=dict(cfg.get("model") or {}),
        data=dict(cfg.get("data") or {}),
        logger=dict(cfg.get("logger") or {"name": "none"}),
        seed=cfg.get("seed", 0),
        trace=cfg.get("trace", False),
        **sections,
    )
    return config.validate()
