"""The error every layer raises for a setting that cannot work: the message names the value and the fix."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the value and the fix."""
