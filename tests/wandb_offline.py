"""Reading what an offline W&B run wrote, without syncing it: the tests check the history rayspec logged.

A W&B run file (``run-<id>.wandb``) is a 7-byte header (":W&B", magic 0xBEE1, version 0) followed by a
LevelDB-style log: 32 KiB blocks of records, each ``crc32c (4) | length (2, little endian) | type (1)``
then the payload; a protobuf ``Record`` may be split into FIRST/MIDDLE/LAST pieces across blocks.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (it does not start with ':W&B')")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the rest of a block too small for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        payload = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            yield pending + payload
            pending = b""


def offline_runs(run_dir: str | os.PathLike) -> list[Path]:
    """The offline W&B run directories under ``<run_dir>/wandb/``, oldest first."""
    return sorted((Path(run_dir) / "wandb").glob("offline-run-*"))


def offline_run_id(run: str | os.PathLike) -> str:
    """The W&B run id of an offline run directory, ``offline-run-<YYYYMMDD_HHMMSS>-<id>[-<n>]``: W&B adds
    ``-<n>`` when a resumed run starts within the same second as the directory it continues."""
    return Path(run).name.split("-")[3]


def read_offline_history(run: str | os.PathLike, wait_s: float = 0.0) -> list[dict[str, Any]]:
    """The history rows (``wandb.log`` calls, with ``_step``) of an offline run directory or run file.

    W&B's writer process may still be flushing when ``finish()`` returns; ``wait_s`` waits up to that
    many seconds for the run's exit record (the end of a finished run) before reading.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(run)
    if path.is_dir():
        files = sorted(path.glob("run-*.wandb"))
        if not files:
            raise FileNotFoundError(f"no run-*.wandb file in {path}")
        path = files[0]
    deadline = time.monotonic() + wait_s
    while True:
        rows, finished = [], False
        for payload in _records(path):
            rec = pb.Record()  # type: ignore[attr-defined]
            rec.ParseFromString(payload)
            kind = rec.WhichOneof("record_type")
            finished |= kind == "exit"
            if kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in rec.history.item})
        if finished or time.monotonic() >= deadline:
            return rows
        time.sleep(0.2)
