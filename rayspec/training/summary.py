"""``RunSummary``: what ``rayspec.fit`` and ``rayspec.run`` return, the run's ``summary.json`` as typed fields."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunSummary"]


@dataclass(kw_only=True, slots=True)
class RunSummary:
    """A finished run, as its ``summary.json`` (docs/design.md §5) says: ``to_dict()`` is that file's mapping,
    key for key; the keys every run writes are typed fields, any others are in ``extra``."""

    method: str
    """``pipeline.method``."""
    variant: str
    """SpecTrain's prediction target (``pipeline.variant``)."""
    stages: int
    """Pipeline stages (data-parallel workers for ``dataparallel``)."""
    model: str
    """The model's registry name, ``_target_`` or, for ``rayspec.fit``, the blocks' class."""
    model_size: str | None
    """``model.size``; None for a model of one's own without one."""
    dataset: str
    """The data set's registry name, ``_target_`` or class."""
    executor: str
    """``local`` or ``ray``."""
    transport: str
    """How activations moved between stages (``none`` on the local executor)."""
    balance: list[int]
    """Blocks per stage."""
    updates: int
    """Optimizer updates run."""
    final_train_loss: float
    """Mean training loss of the last logged updates."""
    val_loss: float | None
    """Loss on the validation split at the end; None without one."""
    val_accuracy: float | None
    """Accuracy on the validation split at the end; None without one."""
    samples_per_s: float
    """Training samples per second while training (evaluations excluded)."""
    train_s: float
    """Seconds spent training."""
    wall_s: float
    """Seconds from start to end."""
    bubble_fraction: float
    """Idle share of the stages' time while the pipeline ran."""
    bytes_per_update: float
    """Bytes sent between stages (all-reduced for ``dataparallel``) per update."""
    seed: int
    restarts: list[dict[str, Any]]
    """One record per restart after a failure (``fault.max_restarts``)."""
    checkpoint: str
    """The last checkpoint written."""
    resumed_from: int | None
    """The update of the checkpoint the run resumed from; None: it started afresh."""
    layout_changes: list[dict[str, Any]]
    """Re-splits of the run's state onto another partition, oldest first (empty when none): ``update`` (the
    checkpoint's), ``from_stages``, ``to_stages``, ``reason`` (a resume on another layout, or ``fault.elastic``
    after a lost node), the partitions ``from`` and ``to`` (blocks per stage) and ``train_s`` at the change."""
    stage_stats: list[dict[str, Any]]
    """Per stage (worker): busy time, actions, bytes sent, weight version, prediction quality."""
    config: dict[str, Any]
    """The config as run, as plain values."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The other keys of ``summary.json`` (``stage_nodes``, ``driver_node`` on a cluster), in its order."""
    _order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def from_dict(cls, summary: Mapping[str, Any]) -> RunSummary:
        """The summary of a ``summary.json`` mapping (as read, or as the trainer returns it: it is taken through
        JSON as the file is written, so ``to_dict()`` equals the file's content)."""
        values = json.loads(json.dumps(dict(summary), default=str))
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "_order"}
        missing = sorted(names - set(values))
        if missing:
            raise ValueError(f"a run summary lacks {', '.join(missing)}; is this a summary.json of rayspec?")
        return cls(**{k: values[k] for k in names}, extra={k: v for k, v in values.items() if k not in names},
                   _order=tuple(values))

    @classmethod
    def read(cls, run_dir: str | os.PathLike) -> RunSummary:
        """The summary of the run in ``run_dir`` (its ``summary.json``)."""
        return cls.from_dict(json.loads((Path(run_dir) / "summary.json").read_text()))

    def to_dict(self) -> dict[str, Any]:
        """The ``summary.json`` mapping, in the file's key order."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "_order")}
        values.update(self.extra)
        order = [k for k in self._order if k in values] + [k for k in values if k not in self._order]
        return {k: values[k] for k in order}
