"""The errors rayspec raises for input that cannot work: one base, ``RayspecError``, whose message names the value
and the fix; ``ConfigError`` for a setting, and for an unknown name wherever one is looked up (``unknown``)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["RayspecError", "ConfigError", "unknown"]


class RayspecError(ValueError):
    """Input that cannot work (a setting, a name, a model, a data set, a schedule, a sweep or study file); the
    message names the value and the fix. Every error rayspec raises for what a user gave derives from it
    (``ConfigError``, ``DataError``, ``ModelError``, ``PartitionError``, ``ScheduleError``, ``SweepError``,
    ``StudyError``); a ``ValueError``, so ``except ValueError`` catches it too."""


class ConfigError(RayspecError):
    """A configuration value that cannot work, or an unknown name; the message names the value and the fix."""


def unknown(setting: str, value: object, choices: Iterable[str], where: str = "") -> ConfigError:
    """The error for ``setting=value`` that names none of ``choices``, with the closest one when there is one:
    ``pipeline.method='spectrian' is unknown; choose one of ..., spectrain (did you mean 'spectrain'?)``.

    Args:
        setting: what the value was given as (``pipeline.method``, ``model``).
        value: the name given.
        choices: the known names.
        where: appended to the setting (`` for model=vgg16``).
    """
    choices = [str(c) for c in choices]
    close = difflib.get_close_matches(str(value), choices, n=1) if isinstance(value, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{setting}={value!r} is unknown{where}; choose one of {', '.join(choices)}{hint}")
