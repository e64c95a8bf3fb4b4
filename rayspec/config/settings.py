"""Settings given as Python keywords (``rayspec.fit``): a field of a typed section by its own name
(``lr=0.05``, ``max_steps=200``, ``executor="local"``), a whole section as a mapping (``optim={"lr": 0.05}``),
or a top-level setting (``seed``, ``trace``, ``logger``)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from rayspec.config.schema import SECTIONS, Config
from rayspec.errors import ConfigError

__all__ = ["FIELDS", "apply_settings"]

FIELDS: dict[str, str] = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
"""Each typed section's field, by its own name, to its section (no name is in two sections: a test checks)."""

_TOP = ("seed", "trace", "logger", "model", "data")


def apply_settings(config: Config, settings: Mapping[str, Any]) -> Config:
    """Set ``settings`` on ``config`` (whole sections first, then single fields) and validate it.

    A ``logger`` is a mapping (``{"name": "wandb", "project": "p"}``) or just its name; ``model`` and ``data``
    mappings add to those sections (a label: ``model={"name": "mynet"}``).

    Raises:
        ConfigError: an unknown name (the message suggests the closest known one), or a value that cannot work.
    """
    for key, value in sorted(settings.items(), key=lambda kv: kv[0] in FIELDS):
        if key in SECTIONS:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key}={value!r} must be a mapping of {key} settings, e.g. optim={{'lr': 0.05}}")
            section = getattr(config, key)
            for name, v in value.items():
                if not hasattr(section, name):
                    raise ConfigError(f"{key}[{name!r}] is not a {key} setting; {_known(name, SECTIONS[key])}")
                setattr(section, name, v)
        elif key in FIELDS:
            setattr(getattr(config, FIELDS[key]), key, value)
        elif key == "logger":
            config.logger = {"name": value} if isinstance(value, str) else dict(value)
        elif key in ("model", "data"):
            setattr(config, key, {**getattr(config, key), **dict(value)})
        elif key in _TOP:
            setattr(config, key, value)
        else:
            close = difflib.get_close_matches(key, [*FIELDS, *SECTIONS, *_TOP], n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"{key}={value!r} is not a setting; {hint}give a field of a section by its name "
                              f"(lr=0.05), a section as a mapping (optim={{'lr': 0.05}}), or one of {', '.join(_TOP)}")
    return config.validate()


def _known(name: str, cls: type) -> str:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, names, n=1)
    return (f"did you mean {close[0]}? " if close else "") + f"known: {', '.join(names)}"
