"""A run's progress as it streams in: per-update records, console lines, ``metrics.jsonl`` and the callbacks."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rayspec.config import Config
from rayspec.training.callbacks import Callbacks
from rayspec.training.prepare import lr_schedule

__all__ = ["Progress", "duration", "keep_metrics"]

log = logging.getLogger(__name__)


def duration(seconds: float) -> str:
    """``3725`` -> ``1:02:05``; ``65`` -> ``1:05``."""
    m, sec = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """Turns per-micro-batch losses into per-update records, logged progress lines and ``metrics.jsonl``.

    Args:
        config: the run's settings.
        metrics: the open ``metrics.jsonl``.
        callbacks: get every record (``on_metrics``).
    """

    def __init__(self, config: Config, metrics: Any, callbacks: Sequence[Any] = ()) -> None:
        self.c, self.metrics, self.callbacks = config, metrics, Callbacks.of(callbacks)
        self.group = config.pipeline.group
        self.lr = lr_schedule(config)
        self.t0 = time.perf_counter()
        self.updates = 0
        self.window: list[float] = []
        self.partial: list[float] = []
        self.last_loss = float("nan")

    def loss(self, _m: int, value: float) -> None:
        """Take one micro-batch's loss (scaled by ``1/group`` as trained)."""
        self.partial.append(value)
        if len(self.partial) < self.group:
            return
        update_loss, self.partial = sum(self.partial), []  # losses are scaled by 1/group already
        self.updates += 1
        self.window.append(update_loss)
        if self.updates % self.c.train.log_every == 0 or self.updates == self.c.train.max_steps:
            self.flush()

    def flush(self) -> None:
        """Write the record of the updates since the last one, and log its progress line."""
        if not self.window:
            return
        elapsed = time.perf_counter() - self.t0
        rate = self.updates * self.c.train.batch_size / max(elapsed, 1e-9)
        self.last_loss = sum(self.window) / len(self.window)
        eta = (self.c.train.max_steps - self.updates) * self.c.train.batch_size / max(rate, 1e-9)
        rec = {"step": self.updates, "loss": self.last_loss, "lr": self.lr(self.updates - 1), "samples_per_s": rate,
               "elapsed_s": elapsed}
        self.write(rec)
        total = self.c.train.max_steps
        filled = int(20 * self.updates / total)
        log.info("step %6d/%d [%s] %3.0f%%  loss %.4f  %8.1f samples/s  eta %s", self.updates, total,
                 "#" * filled + "." * (20 - filled), self.updates / total * 100, self.last_loss, rate, duration(eta))
        self.window = []

    def write(self, rec: dict) -> None:
        """One record into ``metrics.jsonl`` and to the callbacks."""
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        self.callbacks.on_metrics(rec)


def keep_metrics(path: Path, step: int) -> None:
    """Keep only the records of ``metrics.jsonl`` up to update ``step`` (a resumed run rewrites what follows)."""
    if step == 0 or not path.exists():
        path.write_text("")
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))
