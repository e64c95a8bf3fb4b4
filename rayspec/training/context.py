"""``RunContext``: what one run needs while it goes, built once by ``run_training`` and handed down whole."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayspec.config import Config
from rayspec.training.callbacks import Callbacks
from rayspec.training.checkpoint import CheckpointStore, load_checkpoint
from rayspec.training.failures import Restarts
from rayspec.training.prepare import Prepared
from rayspec.training.storage import Location

__all__ = ["RunContext"]


@dataclass
class RunContext:
    """One run's settings, prepared pieces, run directory, checkpoints, restart policy and callbacks.

    The run loop (``rayspec.training.loop.run``), the driver relay (``rayspec.training.driver.run_in_driver``)
    and the data-parallel run (``rayspec.training.dataparallel.run_dataparallel``) take it whole. Where lines
    go is not a field: every module logs to its own ``logging.getLogger(__name__)`` under ``rayspec``, and the
    program running rayspec picks the handlers ([Note: console] in ``rayspec.training.console``).
    """

    prepared: Prepared
    """The validated config, data, model, partition and the checkpoint the run was asked to resume from."""
    run_dir: Path
    """Where ``metrics.jsonl``, ``summary.json``, ``model.pt`` and the trace go (exists)."""
    store: CheckpointStore
    """The run's checkpoints; ``store.last_saved`` is the newest the run wrote or went on from."""
    restarts: Restarts
    """The restarts so far, checked against ``fault.max_restarts`` (stage and driver restarts alike)."""
    callbacks: Callbacks = field(default_factory=lambda: Callbacks(()))
    """The run's callbacks, checked, with a method per hook (``rayspec.training.callbacks``)."""
    placement_group: Any = None
    """A Ray placement group to place the stage actors in (a Tune trial's); None: the executor reserves its own."""
    bundle_offset: int = 0
    """The first stage bundle in ``placement_group``; the driver actor takes the bundle before it."""
    bundles: list[int] | None = None
    """The bundles of ``placement_group`` the stages run in, stage ``k`` in ``bundles[k]``; None: in
    ``bundle_offset + k``. Set when a run goes on with fewer stages after a lost node (``fault.elastic``)."""
    own_group: bool = False
    """Whether the run reserved ``placement_group`` itself (not a Tune trial's): then an elastic run replaces it by
    a smaller one rather than keep a group that Ray cannot place whole."""
    reserved: Any = None
    """A placement group the run loop reserved itself (an elastic run's smaller one), removed when the loop ends."""
    resume: dict[str, Any] | None = None
    """The checkpoint the run loop starts from (``load_checkpoint``); None: from the start."""
    started: float = field(default_factory=time.time)
    """``time.time()`` at the run's start, for ``summary.json``'s ``wall_s`` across driver restarts."""

    @classmethod
    def create(cls, prepared: Prepared, run_dir: Path, callbacks: Sequence[Any] = (), placement_group: Any = None,
               bundle_offset: int = 0) -> RunContext:
        """The context of a run starting now, from ``prepared.resume`` if it resumes."""
        if prepared.checkpoints is None:
            raise ValueError("a run needs its checkpoint folder: prepare() it with the run directory")
        c = prepared.config
        return cls(prepared, Path(run_dir), CheckpointStore(prepared.checkpoints, c.checkpoint.keep),
                   Restarts(c.fault.max_restarts), Callbacks.of(callbacks), placement_group, bundle_offset,
                   resume=prepared.resume)

    @property
    def config(self) -> Config:
        return self.prepared.config

    def stage_bundles(self) -> list[int]:
        """The bundle of each stage in ``placement_group``, stage 0 first."""
        if self.bundles is not None:
            return list(self.bundles)
        return [self.bundle_offset + k for k in range(self.config.pipeline.stages)]

    def go_on_from(self, path: Location | None) -> None:
        """Start the run loop from the checkpoint at ``path`` (a lost driver actor's newest), or from the start."""
        self.store.last_saved = path
        self.resume = load_checkpoint(path) if path is not None else None

    def last_checkpoint(self) -> Location | None:
        """The checkpoint this run would continue from: its newest own one, else the one it resumed from."""
        return self.store.last_saved or self.prepared.resume_path
