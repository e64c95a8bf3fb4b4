"""Where a run's lines go: rayspec speaks through ``logging``; a console handler when nobody set one up.

[Note: console] Every line a run shows (the run's header, the partition table, progress, evaluations,
restarts, the closing summary) is an INFO record of a ``rayspec.*`` logger. The program that runs rayspec
chooses where they go. The entry points (``python -m rayspec.train`` and the other commands, ``rayspec.run``,
``rayspec.fit``) call ``ensure_console``: when no handler would receive the records (none on the ``rayspec``
logger or above it), it adds one that prints each line as it is, to stdout, at INFO. A program that set up
logging (``logging.basicConfig``, Hydra's job logging, pytest's capture) keeps its handlers and levels; if
those drop INFO, it sees only warnings. ``logging.lastResort`` is no substitute: it shows WARNING and above
only, on stderr.

A driver actor's lines are made in another process: ``relayed_to`` hands them to a handler of its own while
the run goes, which streams them back to the caller, and the caller logs them again under the same names.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ROOT", "ensure_console", "relayed_to"]

ROOT = "rayspec"
"""The logger every module's logger (``logging.getLogger(__name__)``) hangs under."""


def ensure_console() -> None:
    """Print the ``rayspec`` loggers' INFO lines to stdout unless a handler is set up for them already."""
    logger = logging.getLogger(ROOT)
    if logger.hasHandlers():
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


@contextmanager
def relayed_to(handler: logging.Handler, level: int = logging.INFO) -> Iterator[None]:
    """Send the ``rayspec`` loggers' records from ``level`` up to ``handler`` alone while the block runs (a
    driver actor's event stream, a study's per-run log file): not to the logger's own handlers (``ensure_console``'s)
    nor above it; the logger's setup is restored after it."""
    logger = logging.getLogger(ROOT)
    kept_level, kept_propagate, kept_handlers = logger.level, logger.propagate, list(logger.handlers)
    for other in kept_handlers:
        logger.removeHandler(other)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        for other in kept_handlers:
            logger.addHandler(other)
        logger.setLevel(kept_level)  # not `logger.level = `: setLevel clears the loggers' cached levels
        logger.propagate = kept_propagate
