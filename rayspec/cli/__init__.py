"""The command lines: ``rayspec train|tune|study|schedule`` (``rayspec.cli.main``), each also
``python -m rayspec.train|tune|study|schedule``; every one takes Hydra-style ``key=value`` arguments."""

__all__: list[str] = []
