"""Settings given as Python keywords (``rayspec.fit``): a section as a mapping (``optim={"lr": 0.05}``), a field
of a typed section by its own name where no other section has a field of that name (``lr=0.05``,
``max_steps=200``, ``executor="local"``), or a top-level setting (``seed``, ``trace``, ``logger``, ``model``,
``data``)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from rayspec.config.schema import SECTIONS, Config
from rayspec.errors import ConfigError

__all__ = ["FIELDS", "apply_settings"]



def _owners() -> dict[str, tuple[str, ...]]:
    owners: dict[str, tuple[str, ...]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            owners[f.name] = (*owners.get(f.name, ()), section)
    return owners


FIELDS = _owners()
"""Each typed section's field, by its own name, to the sections that have a field of that name (a flat keyword
names a field only where that is one section)."""

_TOP = ("seed", "trace", "logger", "model", "data")


def apply_settings(config: Config, settings: Mapping[str, Any]) -> Config:
    """``config`` with ``settings``: each section changed is made anew (``dataclasses.replace``, so it checks
    itself), then the whole is validated.

    A ``logger`` is a mapping (``{"name": "wandb", "project": "p"}``) or just its name; ``model`` and ``data``
    mappings add to those sections (a label: ``model={"name": "mynet"}``).

    Raises:
        ConfigError: an unknown name (the message suggests the closest known one), a flat name that is a field of
            two sections, a field given twice (flat and in its section), or a value that cannot work.
    """
    changes: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    given: dict[tuple[str, str], str] = {}  # (section, field) -> how it was given
    top: dict[str, Any] = {}

    def change(section: str, name: str, value: Any, how: str) -> None:
        if (section, name) in given:
            raise ConfigError(f"{section}.{name} is given twice, as {given[section, name]} and as {how}; give it once")
        given[section, name] = how
        changes[section][name] = value

    for key, value in settings.items():
        if key in SECTIONS:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key}={value!r} must be a mapping of {key} settings, e.g. optim={{'lr': 0.05}}")
            for name, v in value.items():
                if name not in FIELDS or key not in FIELDS[name]:
                    raise ConfigError(f"{key}[{name!r}] is not a {key} setting; {_known(name, SECTIONS[key])}")
                change(key, name, v, f"{key}={{{name!r}: ...}}")
        elif key in FIELDS:
            owners = FIELDS[key]
            if len(owners) > 1:
                raise ConfigError(f"{key}={value!r} is a field of the sections {' and '.join(owners)}; give it in "
                                  f"its section, e.g. {owners[0]}={{{key!r}: {value!r}}}")
            change(owners[0], key, value, f"{key}=...")
        elif key == "logger":
            top[key] = {"name": value} if isinstance(value, str) else dict(value)
        elif key in ("model", "data"):
            top[key] = {**getattr(config, key), **dict(value)}
        elif key in _TOP:
            top[key] = value
        else:
            close = difflib.get_close_matches(key, [*FIELDS, *SECTIONS, *_TOP], n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"{key}={value!r} is not a setting; {hint}give a section as a mapping "
                              f"(optim={{'lr': 0.05}}), a field of a section by its name (lr=0.05), or one of "
                              f"{', '.join(_TOP)}")
    sections = {name: dataclasses.replace(getattr(config, name), **values) for name, values in changes.items() if values}
    return dataclasses.replace(config, **sections, **top).validate()


def _known(name: str, cls: type) -> str:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, names, n=1)
    return (f"did you mean {close[0]}? " if close else "") + f"known: {', '.join(names)}"
