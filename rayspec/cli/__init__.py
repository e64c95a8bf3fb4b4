"""The command lines: ``python -m rayspec.train``, ``rayspec.tune``, ``rayspec.study`` and ``rayspec.schedule``."""

__all__: list[str] = []
