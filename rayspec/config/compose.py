"""Hydra composition: ``rayspec/conf`` plus the typed sections' defaults, with command-line overrides.

The sections' defaults (``rayspec.config.sections``) are stored in Hydra's config store as ``rayspec``,
which ``rayspec/conf/config.yaml`` lists first; the YAML groups (models, data sets, loggers, debug
presets, experiments) are merged on top. The store entry holds plain values, not a typed schema, so a
value of the wrong type reaches the section's own check (``rayspec.config.sections``), whose message names the
value and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from rayspec.config.schema import defaults

__all__ = ["CONF", "register", "compose", "merge_overrides", "override_key", "override_value"]

CONF = Path(__file__).resolve().parents[1] / "conf"
"""The Hydra config directory shipped inside the package."""


def register() -> None:
    """Store the sections' defaults as Hydra's ``rayspec`` config (again is harmless)."""
    ConfigStore.instance().store(name="rayspec", node=defaults())


register()


def compose(overrides: Sequence[str]) -> dict[str, Any]:
    """``rayspec/conf/config.yaml`` with Hydra overrides applied, as a plain resolved mapping."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = hydra_compose("config", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def override_key(override: str) -> str:
    """The key an override sets: ``+pipeline.stages=2`` -> ``pipeline.stages``."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*groups: Sequence[str]) -> list[str]:
    """Concatenate override lists; a later override of the same key replaces the earlier one."""
    merged: dict[str, str] = {}
    for group in groups:
        for override in group:
            key = override_key(override)
            merged.pop(key, None)
            merged[key] = override
    return list(merged.values())


def override_value(value: Any) -> str:
    """A value as Hydra's override grammar reads it: ``true``, ``null``, ``0.01``, ``[2,2,2,1]``, ``'a b'``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if re.fullmatch(r"[\w./:\-+]+", text) or re.fullmatch(r"'.*'|\[.*\]|\{.*\}", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
