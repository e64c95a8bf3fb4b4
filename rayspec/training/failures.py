"""What a run does when a process dies: restart from the newest checkpoint, up to ``fault.max_restarts`` times.

Stage-actor deaths are handled by the run loop (``rayspec.training.loop``), driver-actor deaths by
the process that relays the driver (``rayspec.training.driver``); both go through one ``Restarts``,
so they share ``fault.max_restarts`` and write the same records into ``summary.json``'s ``restarts``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

from rayspec.training.checkpoint import load_checkpoint
from rayspec.training.storage import Location

__all__ = ["RunFailed", "StageDied", "Restarts", "death", "reraise"]

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """A run stopped by a failure it could not recover from (``fault.max_restarts`` used up)."""


def death(who: str, err: BaseException, updates: int) -> str:
    """``"<who> died after update N (ErrorType: its first line)"``."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"{who} died after update {updates} ({type(err).__name__}: {first})"


class StageDied(RuntimeError):
    """A stage actor died during a run (its process was killed, its node was lost) after ``updates`` updates."""

    def __init__(self, cause: BaseException, updates: int) -> None:
        super().__init__(death("a stage actor", cause, updates))
        self.updates = updates


class Restarts:
    """The restarts of one run, checked against ``fault.max_restarts``.

    Args:
        max_restarts: restarts allowed in all (``fault.max_restarts``).
        records: the restarts so far (``summary.json``'s ``restarts``), extended in place; none by default.
    """

    def __init__(self, max_restarts: int, records: list[dict[str, Any]] | None = None) -> None:
        self.max_restarts = max_restarts
        self.records: list[dict[str, Any]] = [] if records is None else records

    def restart(self, kind: str, why: str, failed_at_update: int, latest: Location | None, cause: BaseException,
                where: str = "") -> dict[str, Any] | None:
        """Record a restart after ``why`` and return the checkpoint at ``latest`` to resume from (None: the
        start); raises ``RunFailed`` naming the last checkpoint when no restart is left.

        Args:
            kind: what died, ``stage`` or ``driver``.
            where: appended to the logged line (e.g. `` in a new driver actor``).
        """
        failed_at = time.time()
        if len(self.records) >= self.max_restarts:
            raise RunFailed(
                f"{why}; stopping after {len(self.records)} restart(s) (fault.max_restarts={self.max_restarts}); "
                f"the last checkpoint is {latest or 'none'}: rerun with checkpoint.resume=auto"
            ) from cause
        resume = load_checkpoint(latest) if latest is not None else None
        step = resume["step"] if resume is not None else 0
        # The caller hears of updates late (losses arrive in chunks): a checkpoint proves the run got that far.
        failed_at_update = max(failed_at_update, step)
        self.records.append({"kind": kind, "failed_at_update": failed_at_update, "resumed_from": step,
                             "lost_updates": failed_at_update - step, "error": why, "failed_at": failed_at})
        log.info("restart %d/%d: %s; resuming from update %d (%s)%s", len(self.records), self.max_restarts, why, step,
                 latest or "the start", where)
        return resume


def reraise(err: Exception, updates: int, last: Location | None = None) -> NoReturn:
    """Raise ``StageDied`` for a dead stage actor; a stage's non-finite loss or gradient as ``FloatingPointError``
    naming the last good checkpoint; anything else as it is."""
    from rayspec.exec.ray.cluster import actor_died, task_cause  # Ray only where a Ray run failed

    if actor_died(err):
        raise StageDied(err, updates) from err
    cause = task_cause(err)
    if isinstance(cause, FloatingPointError):
        raise FloatingPointError(
            f"{cause}; the last good checkpoint is {last or 'none (set checkpoint.every to write them)'}"
        ) from None
    raise err
