"""Checkpoints: every stage's resumable state at a drained pipeline, written atomically, read back safely.

[Note: consistent point] (docs/design.md §7) Every method checkpoints where the pipeline is drained: the end of a
segment, when no micro-batch is in flight. There a stage's whole state is its weights and
buffers, its optimizer's state (from which SpecTrain's direction comes), its version counter and
its random stream; PipeDream's stashes are empty, since each stashed version is freed by the
backward that used it. The data position is the number of updates done (one batch each).
Asynchronous methods therefore drain at every checkpoint, as at every evaluation: a run's
trajectory depends on ``checkpoint.every``, and a resumed run equals an uninterrupted one with the
same settings exactly. It can also be resumed on another partition of the stages: its state is then re-split
by parameter name (``rayspec.training.resplit``).

A checkpoint is one ``torch.save`` file holding only tensors, numbers, strings, lists and dicts,
so ``torch.load(weights_only=True)`` reads it without running pickled code. It is written to a
temporary name in the same folder, flushed to disk and renamed: a crash leaves the previous
checkpoints intact and never a partial file under a checkpoint's name.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from rayspec.config import Config
from rayspec.core.methods import METHODS
from rayspec.errors import ConfigError

__all__ = ["CheckpointStore", "load_checkpoint", "resolve_resume", "check_compatible", "payload", "FORMAT"]

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^step_(\d{8,})\.pt$")

# Settings a checkpoint's state depends on; resuming with another value of any of them is refused.
# Everything else (max_steps, logging, evaluation, executor, transport, resources) may change, and so may the
# layout of a pipeline (pipeline.stages, balance, partition): its state is re-split (rayspec.training.resplit).
_FIXED = (
    ("model",), ("data",), ("seed",), ("pipeline", "method"), ("pipeline", "variant"), ("pipeline", "predictor"),
    ("pipeline", "backward"),
    ("pipeline", "microbatches"), ("pipeline", "accumulate"), ("train", "batch_size"),
    ("train", "train_samples"),
    ("optim", "name"), ("optim", "momentum"), ("optim", "weight_decay"), ("optim", "dampening"), ("optim", "nesterov"),
    ("optim", "betas"), ("optim", "eps"), ("optim", "fused"), ("optim", "clip_grad_norm"), ("train", "precision"),
)


class CheckpointStore:
    """The checkpoint folder of a run: ``step_XXXXXXXX.pt`` files, the newest ``keep`` kept."""

    def __init__(self, folder: str | os.PathLike, keep: int = 3) -> None:
        self.folder = Path(folder)
        self.keep = keep
        self.last_saved: Path | None = None
        """The newest checkpoint this store wrote (a run's own, whatever else the folder holds)."""

    def paths(self) -> list[Path]:
        """Complete checkpoints, oldest first (temporary files of an interrupted write are ignored)."""
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        paths = self.paths()
        return paths[-1] if paths else None

    def save(self, step: int, payload: dict[str, Any]) -> Path:
        """Write ``payload`` as the checkpoint of ``step`` atomically, then drop all but the newest ``keep``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"step_{step:08d}.pt"
        tmp = self.folder / f".{path.name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                torch.save({"format": FORMAT, "step": step, **payload}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.folder)
        self.last_saved = path
        for old in self.paths()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``; raise ``ConfigError`` for a file that is not one."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(f"checkpoint.resume: {path} is not a readable rayspec checkpoint ({err})") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"checkpoint.resume: {path} is not a rayspec checkpoint of format {FORMAT}")
    return state


def resolve_resume(resume: str | None, folder: Path | None) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names: None; ``auto`` (the newest in ``folder``, None if there is none);
    a checkpoint file; or a folder holding checkpoints (a run directory or its ``checkpoints/``)."""
    if resume is None:
        return None
    if resume == "auto":
        return None if folder is None else CheckpointStore(folder).latest()
    path = Path(os.path.expanduser(resume))
    if path.is_file():
        return path
    for candidate in (path, path / "checkpoints"):
        latest = CheckpointStore(candidate).latest()
        if latest is not None:
            return latest
    raise ConfigError(
        f"checkpoint.resume={resume} is neither a checkpoint file nor a folder holding step_*.pt checkpoints; "
        "give a checkpoint file, a run directory, or checkpoint.resume=auto"
    )


def check_compatible(saved: dict[str, Any], config: Config, path: Path) -> None:
    """Refuse to resume when a setting the saved state depends on differs (the message names it)."""
    now = json.loads(json.dumps(asdict(config), default=str))
    defaults = json.loads(json.dumps(asdict(Config()), default=str))  # for settings added after a checkpoint
    for key in _FIXED:
        a, b = _get(saved, key, _get(defaults, key)), _get(now, key)
        if a != b:
            name = ".".join(key)
            raise ConfigError(
                f"checkpoint.resume: {path} was written with {name}={a!r} but this run has {name}={b!r}; "
                f"resume with the same {name} (only max_steps, logging, evaluation, resources and the pipeline's "
                "layout may change)"
            )
    stages = _get(saved, ("pipeline", "stages"))
    if not METHODS[config.pipeline.method].pipelined and stages != config.pipeline.stages:
        raise ConfigError(
            f"checkpoint.resume: {path} was written by {stages} {config.pipeline.method} workers but this run has "
            f"pipeline.stages={config.pipeline.stages}; resume with pipeline.stages={stages} (each worker's random "
            "stream is in the checkpoint)"
        )


def payload(config: Config, balance: list[int], stages: list[dict[str, Any]], train_s: float,
            evals: dict[str, float], layout_changes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What a checkpoint holds besides its format and step: the run's settings (as JSON), the partition,
    every stage's state (``Stage.checkpoint_state``), the training seconds so far, the last evaluation, the
    run's changes of partition on resuming (``rayspec.training.resplit``) and the W&B run id (``logger.id``,
    None without W&B), which a resumed run continues."""
    return {"config": json.dumps(asdict(config), default=str), "balance": list(balance), "stages": stages,
            "train_s": train_s, "evals": json.dumps(evals), "layout_changes": list(layout_changes or []),
            "wandb_id": (config.logger or {}).get("id")}


def _get(tree: dict[str, Any], key: tuple[str, ...], missing: Any = None) -> Any:
    """``tree[k0][k1]...``; ``missing`` where a level lacks the key (a ``None`` value stays ``None``)."""
    for k in key:
        if not isinstance(tree, dict) or k not in tree:
            return missing
        tree = tree[k]
    return tree


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some file systems cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
