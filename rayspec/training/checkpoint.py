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
temporary name in the same folder, flushed to disk and renamed: a crash (a writer killed between
write and rename included) leaves the previous checkpoints intact and never a partial file under a
checkpoint's name. The folder is a local path or any ``pyarrow.fs`` URI ([Note: storage] in
``rayspec.training.storage``). A file under a checkpoint's name that does not load (truncated by its
storage, or another program's) is refused with its name; ``checkpoint.resume=auto`` then takes the
newest checkpoint that loads.
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
from pyarrow import fs as pafs

from rayspec.config import CheckpointConfig, Config
from rayspec.core.methods import METHODS
from rayspec.errors import ConfigError
from rayspec.training.storage import Location, is_uri, join, open_folder, write_atomic

__all__ = ["CheckpointStore", "checkpoint_folder", "load_checkpoint", "resolve_resume", "check_compatible", "payload", "FORMAT"]

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^step_(\d{8,})\.pt$")
_TMP = re.compile(r"^\.step_(\d{8,})\.pt\.\d+\.tmp$")  # a write under way, or one a killed writer left
_KEYS = {"format", "step"}

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
    """The checkpoint folder of a run: ``step_XXXXXXXX.pt`` files, the newest ``keep`` kept.

    Args:
        folder: a local path or a ``pyarrow.fs`` URI (rayspec.training.storage, [Note: storage]).
        keep: checkpoints kept; older ones are deleted after each write.
    """

    def __init__(self, folder: Location, keep: int = 3) -> None:
        self.folder: Location = folder if is_uri(folder) else Path(folder)
        self.keep = keep
        self.last_saved: Location | None = None
        """The newest checkpoint this store wrote (a run's own, whatever else the folder holds)."""
        self._fs: pafs.FileSystem | None = None
        self._path = ""

    @property
    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        """The file system and the folder's path in it (opened once, when first needed)."""
        if self._fs is None:
            self._fs, self._path = open_folder(self.folder)
        return self._fs, self._path

    def _names(self) -> list[str]:
        filesystem, path = self.filesystem
        found = filesystem.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return [info.base_name for info in found if info.type == pafs.FileType.File]

    def paths(self) -> list[Location]:
        """Complete checkpoints, oldest first (temporary files of an interrupted write are ignored)."""
        found = [(int(m.group(1)), name) for name in self._names() if (m := _NAME.match(name))]
        return [join(self.folder, name) for _, name in sorted(found)]

    def latest(self) -> Location | None:
        paths = self.paths()
        return paths[-1] if paths else None

    def newest_good(self) -> tuple[Location, dict[str, Any]] | None:
        """The newest checkpoint that loads, and its state; a newer file that does not (truncated by a crash of
        its storage, or not a checkpoint) is passed over with a warning naming it. None: no good one."""
        for path in reversed(self.paths()):
            try:
                return path, load_checkpoint(path)
            except ConfigError as err:
                log.warning("%s; taking the checkpoint before it", err)
        return None

    def save(self, step: int, payload: dict[str, Any]) -> Location:
        """Write ``payload`` as the checkpoint of ``step`` atomically, then drop all but the newest ``keep``
        (and temporary files that a killed writer left)."""
        filesystem, folder = self.filesystem
        filesystem.create_dir(folder, recursive=True)
        name = f"step_{step:08d}.pt"
        write_atomic(filesystem, f"{folder}/{name}", lambda f: torch.save({"format": FORMAT, "step": step, **payload}, f))
        path = join(self.folder, name)
        self.last_saved = path
        for old in self.paths()[: -self.keep]:
            filesystem.delete_file(f"{folder}/{_name(old)}")
        for stale in self._names():
            if (m := _TMP.match(stale)) and int(m.group(1)) <= step:
                filesystem.delete_file(f"{folder}/{stale}")
        return path


def checkpoint_folder(settings: CheckpointConfig, run_dir: str | os.PathLike | None) -> Location | None:
    """Where a run's checkpoints go: ``checkpoint.dir``; else ``STORAGE/checkpoints`` for ``checkpoint.storage``;
    else ``RUN_DIR/checkpoints`` (None without a run directory)."""
    if settings.dir:
        return Path(os.path.expanduser(settings.dir))
    if settings.storage:
        return join(settings.storage, "checkpoints")
    return Path(run_dir) / "checkpoints" if run_dir is not None else None


def load_checkpoint(path: Location) -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``; raise ``ConfigError`` naming the file when it is not one
    (unreadable, truncated, or another program's file under a checkpoint's name)."""
    fix = "resume from another checkpoint (checkpoint.resume=auto takes the newest good one) or delete it"
    try:
        filesystem, folder = open_folder(path, "checkpoint.resume")
        with filesystem.open_input_file(folder) as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except ConfigError:
        raise
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"checkpoint.resume: {path} is not a readable rayspec checkpoint ({first}); {fix}") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT or not _KEYS <= state.keys():
        raise ConfigError(f"checkpoint.resume: {path} is not a rayspec checkpoint of format {FORMAT}; {fix}")
    return state


def resolve_resume(resume: str | None, folder: Location | None) -> tuple[Location, dict[str, Any]] | None:
    """The checkpoint ``checkpoint.resume`` names, and its state: None; ``auto`` (the newest good one in
    ``folder``, None if there is none); a checkpoint file (refused when it does not load); or a folder holding
    checkpoints (a run directory or its ``checkpoints/``, a storage root), whose newest good one is taken."""
    if resume is None:
        return None
    if resume == "auto":
        return None if folder is None else CheckpointStore(folder).newest_good()
    path: Location = resume if is_uri(resume) else Path(os.path.expanduser(resume))
    filesystem, inner = open_folder(path, "checkpoint.resume")
    if filesystem.get_file_info(inner).type == pafs.FileType.File:
        return path, load_checkpoint(path)
    for candidate in (path, join(path, "checkpoints")):
        store = CheckpointStore(candidate)
        if store.latest() is not None:
            found = store.newest_good()
            if found is None:
                raise ConfigError(
                    f"checkpoint.resume={resume}: none of its checkpoints loads ({', '.join(map(_name, store.paths()))}"
                    "); give another checkpoint, or start afresh with checkpoint.resume=null in a new folder"
                )
            return found
    raise ConfigError(
        f"checkpoint.resume={resume} is neither a checkpoint file nor a folder holding step_*.pt checkpoints; "
        "give a checkpoint file, a run directory, or checkpoint.resume=auto"
    )


def check_compatible(saved: dict[str, Any], config: Config, path: Location) -> None:
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


def _name(location: Location) -> str:
    return location.name if isinstance(location, Path) else location.rsplit("/", 1)[-1]


def _get(tree: dict[str, Any], key: tuple[str, ...], missing: Any = None) -> Any:
    """``tree[k0][k1]...``; ``missing`` where a level lacks the key (a ``None`` value stays ``None``)."""
    for k in key:
        if not isinstance(tree, dict) or k not in tree:
            return missing
        tree = tree[k]
    return tree
