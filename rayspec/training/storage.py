"""Where a run's checkpoints and summary go: a local path or any ``pyarrow.fs`` URI, written atomically.

[Note: storage] ``checkpoint.storage`` is Ray Train's ``RunConfig(storage_path=...)`` for rayspec: a
folder every node can reach (NFS, ``s3://``, ``gs://``, ``hdfs://``), so that a run whose driver
actor's node is lost resumes on another. A plain path is a folder on the local file system, as
``RUN_DIR/checkpoints`` always was; a URI goes to ``pyarrow.fs.FileSystem.from_uri`` as it is.
Local paths and ``file://`` URIs are what rayspec's tests exercise; other schemes are pyarrow's.

A file is written to a temporary name beside its own, then moved onto its name. On a local file
system (and NFS) the data is flushed to disk first and the move is a ``rename``: atomic, so a
reader sees the old file or the whole new one. On object stores (S3, GCS) an object appears only
once its upload completes, so no partial object ever has a checkpoint's name either; there the
move is a copy and a delete, and a crash between the two leaves a temporary object, which readers
ignore and the next write removes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from pyarrow import fs as pafs

from rayspec.errors import ConfigError

__all__ = ["Location", "is_uri", "join", "open_folder", "absolute", "write_atomic", "put_file", "read_file"]

Location = Path | str
"""A file or folder: a local ``Path``, or a URI string (``file:///...``, ``s3://bucket/...``)."""

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(location: Location) -> bool:
    """Whether ``location`` is a URI (``scheme://...``) rather than a local path."""
    return isinstance(location, str) and bool(_URI.match(location))


def absolute(location: Location) -> Location:
    """``location`` usable from any working directory: a URI as it is, a local path resolved."""
    if is_uri(location):
        return location
    return Path(os.path.expanduser(location)).resolve()


def join(location: Location, name: str) -> Location:
    """``name`` inside the folder at ``location``."""
    return location / name if isinstance(location, Path) else f"{location.rstrip('/')}/{name}" if is_uri(location) \
        else Path(location) / name


def open_folder(location: Location, setting: str = "checkpoint.storage") -> tuple[pafs.FileSystem, str]:
    """The file system holding ``location`` and the folder's path within it.

    Raises:
        ConfigError: a URI that ``pyarrow.fs`` cannot open (unknown scheme, unreachable store); the message
            names ``setting`` and the URI.
    """
    if not is_uri(location):
        return pafs.LocalFileSystem(), str(absolute(location))
    try:
        filesystem, path = pafs.FileSystem.from_uri(str(location))
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... by scheme
        raise ConfigError(
            f"{setting}={location} cannot be opened by pyarrow.fs ({err}); give a local path or a URI of a file "
            "system pyarrow knows (file://, s3://, gs://, hdfs://) with its credentials set"
        ) from err
    return filesystem, path.rstrip("/") or "/"


def write_atomic(filesystem: pafs.FileSystem, path: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Write ``path`` through ``write(stream)`` under a temporary name, then move it onto ``path``
    ([Note: storage]); on any failure the temporary file is removed and ``path`` is untouched."""
    folder, name = path.rsplit("/", 1)
    tmp = f"{folder}/.{name}.{os.getpid()}.tmp"
    local = isinstance(filesystem, pafs.LocalFileSystem)
    try:
        with filesystem.open_output_stream(tmp) as stream:
            write(stream)
        if local:
            _fsync(tmp)
        filesystem.move(tmp, path)
    except BaseException:
        try:
            filesystem.delete_file(tmp)
        except Exception:  # noqa: BLE001 - nothing was written, or the store is gone: the error below says why
            pass
        raise
    if local:
        _fsync(folder)


def put_file(location: Location, name: str, data: bytes) -> None:
    """Write ``data`` as ``name`` in the folder at ``location`` (created), atomically."""
    filesystem, folder = open_folder(location)
    filesystem.create_dir(folder, recursive=True)
    write_atomic(filesystem, f"{folder}/{name}", lambda stream: stream.write(data))


def read_file(location: Location, name: str) -> bytes | None:
    """The bytes of ``name`` in the folder at ``location``; None when it is not there or cannot be read."""
    try:
        filesystem, folder = open_folder(location)
        with filesystem.open_input_stream(f"{folder}/{name}") as stream:
            return stream.read()
    except (OSError, ValueError):  # absent, unreadable, or a store pyarrow cannot open (ConfigError)
        return None


def _fsync(path: str) -> None:
    """Flush ``path`` (a file, or a folder's entries) to disk; a no-op where the file system cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
