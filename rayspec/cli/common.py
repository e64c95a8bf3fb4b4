"""What the command lines share: the errors they report as bad input, settings files, Hydra-style ``key=value``
arguments."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException

from rayspec.errors import unknown

__all__ = ["EXPERIMENTS", "settings_names", "find_settings", "read_settings", "check_keys",
           "parse_overrides", "split_args"]

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
"""The sweep files (``sweeps/``) and study files (``studies/``) shipped inside the package. Each describes many
training runs and is read by its own loader (``rayspec.cli.sweep``, ``rayspec.cli.study_config``), not composed by
Hydra; so they stay out of ``rayspec/conf``, where Hydra would list them as config groups of ``rayspec train``."""


def settings_names(folder: Path) -> list[str]:
    """The names of the settings files (sweeps, studies) in ``folder``."""
    return sorted(p.stem for p in folder.glob("*.yaml"))


def find_settings(ref: str, folder: Path, kind: str, error: type[Exception], plural: str = "") -> Path:
    """The ``kind`` file (sweep, study) for ``kind=REF``: a name in ``folder`` or a path to a ``.yaml`` file.

    Raises:
        ConfigError: ``ref`` is a name that names no file in ``folder`` (``unknown``).
        error: ``ref`` is a path to a ``.yaml`` file that does not exist.
    """
    path = Path(ref).expanduser()
    is_path = path.suffix in (".yaml", ".yml")
    candidates = [path] if is_path else [folder / f"{ref}.yaml", path.with_suffix(".yaml")]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if not is_path:
        raise unknown(kind, ref, settings_names(folder), f" in {folder} (a path to a .yaml file works too)")
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


def parse_overrides(argv: Sequence[str], keys: Sequence[str], text_keys: Sequence[str], usage: str,
                    error: type[Exception]) -> tuple[dict[str, Any], list[str]]:
    """Read ``argv`` with Hydra's override grammar (as ``rayspec train`` does) and split it into the command's own
    options (``keys``) and training overrides (the rest, kept as written for Hydra to compose).

    An option's value is what Hydra reads (``resume=false`` is False, ``stages=[2,4]`` a list, ``null`` None);
    ``text_keys`` (names, paths) keep their text, so ``study=2024`` names the file ``2024.yaml``.

    Raises:
        error: an argument Hydra cannot read, or an option given as ``+key``, ``~key`` or a sweep ``a,b``.
    """
    parser = OverridesParser.create()
    options: dict[str, Any] = {}
    overrides: list[str] = []
    for arg in argv:
        if arg.startswith("-"):
            flag = arg.lstrip("-").split("=", 1)[0]
            raise error(f"argument {arg!r}: rayspec commands take key=value arguments; write {flag}=VALUE\n{usage}")
        try:
            override = parser.parse_override(arg)
        except HydraException as err:
            raise error(f"argument {arg!r} is not a Hydra override key=value: {err}\n{usage}") from err
        key = override.key_or_group
        if key not in keys:
            overrides.append(arg)
            continue
        if override.type != OverrideType.CHANGE or override.is_sweep_override():
            raise error(f"{arg!r}: give the option {key} as {key}=VALUE, one value or a list [a,b], without + or ~"
                        f"\n{usage}")
        value = override.value()
        if key in text_keys and not isinstance(value, str):
            value = arg.split("=", 1)[1]
        options[key] = value
    return options, overrides


def split_args(argv: Sequence[str], kind: str, keys: Sequence[str], text_keys: Sequence[str], available: list[str],
               usage: str, error: type[Exception]) -> tuple[str, dict[str, Any], list[str]]:
    """Split the arguments of ``rayspec tune`` or ``rayspec study`` (``parse_overrides``) into the ``kind``
    reference (``sweep=NAME``, ``study=NAME``), the command's own options (``keys``) and training overrides.

    Returns:
        The reference, the options (``resume`` always set, default true) and the overrides.
    """
    options, overrides = parse_overrides(argv, keys, (kind, *text_keys), usage, error)
    if kind not in options:
        plural = "studies" if kind == "study" else kind + "s"
        raise error(f"give {kind}=NAME; available {plural}: {', '.join(available) or 'none'}\n{usage}")
    resume = options.pop("resume", True)
    if not isinstance(resume, bool):
        raise error(f"resume={resume!r} must be true or false")
    options["resume"] = resume
    return options.pop(kind), options, overrides
