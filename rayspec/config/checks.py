"""Checks shared by the config sections; each raises ``ConfigError`` naming the value and the fix."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rayspec.errors import ConfigError, unknown

__all__ = ["choice", "number", "integer", "optional_integer"]


def choice(name: str, value: Any, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise unknown(name, value, choices)


def number(v: Any) -> bool:
    """Whether ``v`` is an int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def integer(name: str, value: Any, low: int, fix: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be an integer; {fix}")
    if value < low:
        raise ConfigError(f"{name}={value} must be >= {low}; {fix}")


def optional_integer(name: str, value: Any, low: int, fix: str) -> None:
    if value is not None:
        integer(name, value, low, fix)
