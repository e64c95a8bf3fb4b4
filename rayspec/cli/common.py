"""What the command lines share: the errors they report as bad input, settings files, ``key=value`` arguments."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from rayspec.core.schedule import ScheduleError
from rayspec.data import DataError
from rayspec.errors import ConfigError
from rayspec.models import ModelError
from rayspec.partition import PartitionError

__all__ = ["USER_ERRORS", "EXPERIMENTS", "settings_names", "find_settings", "read_settings", "check_keys", "split_args"]

USER_ERRORS = (ConfigError, DataError, ModelError, PartitionError, ScheduleError)
"""Bad input: the command prints the message (it names the value and the fix) and exits with 2."""
EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
"""The sweep files (``sweeps/``) and study files (``studies/``) shipped inside the package. Each describes many
training runs and is read by its own loader (``rayspec.cli.sweep``, ``rayspec.cli.study_config``), not composed by
Hydra; so they stay out of ``rayspec/conf``, where Hydra would list them as config groups of ``rayspec train``."""


def settings_names(folder: Path) -> list[str]:
    """The names of the settings files (sweeps, studies) in ``folder``."""
    return sorted(p.stem for p in folder.glob("*.yaml"))


def find_settings(ref: str, folder: Path, kind: str, error: type[Exception], plural: str = "") -> Path:
    """The ``kind`` file (sweep, study) for ``kind=REF``: a name in ``folder`` or a path to a ``.yaml`` file."""
    path = Path(ref).expanduser()
    candidates = [path] if path.suffix in (".yaml", ".yml") else [folder / f"{ref}.yaml", path.with_suffix(".yaml")]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    names = ", ".join(settings_names(folder)) or "none"
    raise error(f"{kind}={ref} not found; available {plural or kind + 's'} in {folder}: {names} "
                "(or give a path to a .yaml file)")


def read_settings(path: Path, error: type[Exception], what: str) -> dict[str, Any]:
    """The mapping in the YAML file ``path`` (a sweep or study file); ``error`` names a bad file."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise error(f"{path} is not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise error(f"{path} must hold a mapping of {what}")
    return raw


def check_keys(raw: Mapping[str, Any], known: Sequence[str], where: str, error: type[Exception]) -> None:
    """Raise ``error`` for the first key of ``raw`` not in ``known``, suggesting the closest known one."""
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise error(f"{where}: unknown key {key!r}; {hint}known keys: {', '.join(known)}")


def split_args(argv: Sequence[str], kind: str, keys: Sequence[str], text_keys: Sequence[str], available: list[str],
               usage: str, error: type[Exception]) -> tuple[str, dict[str, Any], list[str]]:
    """Split ``key=value`` arguments into the ``kind`` reference (``sweep=NAME``, ``study=NAME``), the command's
    own options (``keys``; values read as YAML except ``text_keys``) and training overrides.

    Returns:
        The reference, the options (``resume`` always set, default true) and the overrides.
    """
    options: dict[str, Any] = {}
    overrides: list[str] = []
    for arg in argv:
        if "=" not in arg and not arg.startswith("~"):
            raise error(f"argument {arg!r} is not key=value (or a Hydra deletion ~key)\n{usage}")
        key, _, value = arg.partition("=")
        if key in keys:
            options[key] = value if key in text_keys else yaml.safe_load(value)
        else:
            overrides.append(arg)
    if kind not in options:
        plural = "studies" if kind == "study" else kind + "s"
        raise error(f"give {kind}=NAME; available {plural}: {', '.join(available) or 'none'}\n{usage}")
    resume = options.pop("resume", True)
    if not isinstance(resume, bool):
        raise error(f"resume={resume!r} must be true or false")
    options["resume"] = resume
    return options.pop(kind), options, overrides
