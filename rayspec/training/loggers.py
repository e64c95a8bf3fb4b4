"""Experiment loggers for the driver: W&B (online, or offline when no API key is configured).

Loggers are trainer callbacks (``on_start``, ``on_metrics``, ``on_end``; see ``rayspec.training.runner.run_training``)
and run on the driver only: stage actors never talk to W&B. ``build_callbacks`` turns the
``logger`` section of the config into callbacks.

[Note: W&B resume] A run's W&B id (``logger.id``; rayspec picks one when it is null) goes into every checkpoint
(``wandb_id``) and into ``RUN_DIR/wandb.json`` with the last update sent to W&B. A resumed run takes the
checkpoint's id and continues that W&B run (``wandb.init(id=..., resume="allow")``); its steps are update counts,
so they go on from the checkpoint. W&B drops a record whose step is below the last one it holds (offline too,
within one run file), and the updates between the checkpoint and the end of the earlier attempt are in W&B
already. The resumed run does not send them again: a resumed run repeats those updates exactly (only the timing
figures differ). W&B's ``resume_from`` would rewind the history to the checkpoint instead, but it is in beta,
works only online and needs the earlier run on the server, so rayspec does not use it. The last step W&B holds
comes from W&B when it says (an online resumed run) and from ``wandb.json`` in the run folder and in the folder
of the checkpoint resumed from; an offline run resumed elsewhere sends every update after the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import netrc
import os
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rayspec.config import LOGGERS, Config
from rayspec.errors import ConfigError
from rayspec.training.storage import Location, put_file, read_file

__all__ = ["LOGGERS", "WandbLogger", "build_callbacks", "wandb_mode", "with_wandb_id", "new_wandb_id", "RUN_FILE"]

log = logging.getLogger(__name__)

WANDB_MODES = ("auto", "online", "offline", "disabled")
_WANDB_KEYS = {"name", "id", "project", "entity", "group", "tags", "mode", "notes", "job_type"}
RUN_FILE = "wandb.json"
"""In the run folder: the W&B run's ``id``, ``project``, ``entity``, ``mode`` and ``last_step`` sent ([Note: W&B resume])."""


def wandb_mode(requested: str | None = "auto") -> tuple[str, str]:
    """The W&B mode to use and why: ``auto`` means online with an API key, offline without one.

    ``WANDB_MODE`` in the environment wins over the config (W&B itself reads it too). An API key is
    found in ``WANDB_API_KEY`` or in the netrc file (``NETRC`` or ``~/.netrc``) for the W&B host
    (``WANDB_BASE_URL``, default ``api.wandb.ai``), where ``wandb login`` writes it.
    """
    env = os.environ.get("WANDB_MODE")
    if env:
        return env, f"WANDB_MODE={env} is set"
    requested = requested or "auto"
    if requested != "auto":
        return requested, f"logger.mode={requested}"
    if os.environ.get("WANDB_API_KEY"):
        return "online", "WANDB_API_KEY is set"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
        if os.path.exists(path) and netrc.netrc(path).authenticators(host):
            return "online", f"an API key for {host} is in {path}"
    except (netrc.NetrcParseError, OSError):
        pass
    return "offline", "no W&B API key is configured"


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "/"))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v
    return out


class WandbLogger:
    """Logs a run to W&B from the driver: config, per-step and per-evaluation metrics, the summary.

    Args:
        run_dir: the run directory; W&B writes its run under ``<run_dir>/wandb/``, rayspec ``<run_dir>/wandb.json``.
        project: the W&B project.
        entity: the W&B entity (user or team), None for the default.
        group: a group for related runs (a sweep's name).
        name: the run's display name.
        id: the W&B run id; None: ``logger.id`` of the config at ``on_start`` (set by the trainer: the resumed
            checkpoint's, or a new one).
        tags: run tags.
        mode: ``auto`` (online with an API key, else offline), ``online``, ``offline`` or ``disabled``.
        notes: free text stored with the run.
        job_type: W&B job type, e.g. ``train`` or ``sweep-trial``.
        storage: ``checkpoint.storage``: ``wandb.json`` is also written there, and read from there on resuming.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        project: str = "rayspec",
        entity: str | None = None,
        group: str | None = None,
        name: str | None = None,
        id: str | None = None,
        tags: list[str] | tuple[str, ...] = (),
        mode: str = "auto",
        notes: str | None = None,
        job_type: str = "train",
        storage: str | None = None,
    ) -> None:
        if mode not in WANDB_MODES:
            raise ConfigError(f"logger.mode={mode!r} is unknown; choose one of {', '.join(WANDB_MODES)}")
        self.run_dir = Path(run_dir)
        self.options: dict[str, Any] = {"project": project, "entity": entity, "group": group, "name": name, "tags": list(tags),
                        "notes": notes, "job_type": job_type}
        self.id = id
        self.mode, self.reason = wandb_mode(mode)
        self.storage = storage
        self.run: Any = None
        self.resumed: tuple[int, Location | None] | None = None
        self.next_step = 0
        """Records below this step are in W&B already and are not sent ([Note: W&B resume])."""
        self.written = -1
        """The last step recorded in ``wandb.json``."""

    def on_resume(self, step: int, checkpoint: Location | None) -> None:
        """The run resumes from ``checkpoint``, written at update ``step`` (called before ``on_start``)."""
        self.resumed = (step, checkpoint)

    def on_start(self, config: Config) -> None:
        import wandb

        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.mode == "offline":
            log.info("W&B: %s; logging offline under %s (upload later with `wandb sync %s/offline-run-*`)", self.reason,
                     self.run_dir / "wandb", self.run_dir / "wandb")
        run_id = self.id or (config.logger or {}).get("id") or new_wandb_id()
        self.run = wandb.init(dir=str(self.run_dir), config=dataclasses.asdict(config), mode=self.mode,  # type: ignore[arg-type]
                              id=run_id, resume="allow", reinit="finish_previous", **self.options)
        if self.resumed is not None:
            self._continue(run_id)
        self._record(self.next_step - 1)

    def _continue(self, run_id: str) -> None:
        """Set ``next_step`` past what W&B holds of run ``run_id`` and say so."""
        step, checkpoint = self.resumed or (0, None)
        held = [self.run.step - 1 if self.run.resumed else -1]  # W&B's word (online)
        folders: list[Location] = [self.run_dir, *([self.storage] if self.storage else [])]
        if isinstance(checkpoint, Path):  # a run directory's checkpoints/ (a storage's is read above)
            folders.append(checkpoint.parent.parent)
        for folder in folders:
            record = _read_run_file(folder)
            if record.get("id") == run_id and isinstance(record.get("last_step"), int):
                held.append(record["last_step"])
        self.next_step = max(held) + 1
        again = f"; updates {step + 1}-{self.next_step - 1} are in W&B already and are not sent again" \
            if self.next_step > step + 1 else ""
        log.info("W&B: continuing run %s from update %s%s", run_id, step, again)

    def _record(self, last_step: int) -> None:
        """Write ``RUN_DIR/wandb.json``: the W&B run and the last step sent."""
        if self.run is None or self.mode == "disabled":
            return
        record = {"id": self.run.id, "project": self.run.project, "entity": self.run.entity, "mode": self.mode,
                  "last_step": last_step if last_step >= 0 else None}
        tmp = self.run_dir / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.run_dir / RUN_FILE)
        if self.storage:  # where a resumed run on another node finds it
            put_file(self.storage, RUN_FILE, json.dumps(record).encode())
        self.written = last_step

    def on_metrics(self, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        step = int(record["step"])
        if step < self.next_step:  # in W&B already: a resumed run repeats it exactly
            return
        values = {k: v for k, v in record.items() if k != "step"}
        self.run.log(values, step=step)
        if step > self.written:
            self._record(step)
        self.next_step = step  # the same step again merges into W&B's row; a lower one would be dropped

    def on_end(self, summary: dict[str, Any] | None) -> None:
        if self.run is None:
            return
        try:
            if summary is not None:
                flat = _flat({k: v for k, v in summary.items() if k not in ("config", "stage_stats")})
                for st in summary.get("stage_stats", []):
                    flat[f"stage{st['stage']}/busy_fraction"] = st.get("busy_fraction")
                self.run.summary.update(flat)
        finally:
            self.run.finish(exit_code=0 if summary is not None else 1)
            self.run = None


def new_wandb_id() -> str:
    """A new W&B run id: 8 characters of ``[0-9a-z]``, as W&B's own."""
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz"
    return "".join(secrets.choice(alphabet) for _ in range(8))


def with_wandb_id(config: Config, resume: dict[str, Any] | None) -> Config:
    """``config`` with ``logger.id`` set when it logs to W&B: the configured id, else the resumed checkpoint's
    (``wandb_id``), else a new one ([Note: W&B resume]); ``config`` itself is not changed."""
    logger = dict(config.logger or {})
    if logger.get("name") != "wandb" or logger.get("id"):
        return config
    logger["id"] = (resume or {}).get("wandb_id") or new_wandb_id()
    return dataclasses.replace(config, logger=logger)


def _read_run_file(folder: Location) -> dict[str, Any]:
    data = read_file(folder, RUN_FILE)
    try:
        record = json.loads(data) if data is not None else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def build_callbacks(
    config: Config,
    run_dir: str | os.PathLike,
    group: str | None = None,
    name: str | None = None,
    job_type: str = "train",
) -> list[Any]:
    """The trainer callbacks the ``logger`` section asks for: none, or a ``WandbLogger``.

    ``group`` and ``name`` win over ``logger.group`` and ``logger.name`` when given (a sweep groups
    its trials). Raises ``ConfigError`` for an unknown logger or key.
    """
    opts = dict(config.logger or {"name": "none"})
    kind = opts.pop("name", "none") or "none"
    if kind not in LOGGERS:
        raise ConfigError(f"logger={kind!r} is unknown; choose one of {', '.join(LOGGERS)}")
    if kind == "none":
        return []
    unknown = sorted(set(opts) - _WANDB_KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join('logger.' + k for k in unknown)}; "
                          f"known: {', '.join(sorted(_WANDB_KEYS))}")
    opts["name"] = name or opts.pop("run_name", None)
    if group is not None:
        opts["group"] = group
    opts.setdefault("mode", "auto")
    opts["mode"] = opts["mode"] or "auto"
    opts["tags"] = list(opts.get("tags") or [])
    return [WandbLogger(run_dir, job_type=job_type, storage=config.checkpoint.storage, **opts)]
