"""``rayspec COMMAND ARGS``: the console script; each command is ``python -m rayspec.COMMAND ARGS``.

Every command takes Hydra-style ``key=value`` arguments: ``train`` is a Hydra application (``--help``, ``--cfg job``,
``-m``, ``--config-dir`` ...); ``tune`` and ``study`` read their own options and pass the other overrides to the
training configuration; ``schedule`` reads only its own options.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "main"]

COMMANDS = {
    "train": "train a model as configured: rayspec train [+experiment=NAME] [key=value ...] (Hydra; --help lists all)",
    "tune": "run a Ray Tune sweep: rayspec tune sweep=NAME [options] [training overrides]",
    "study": "compare every method with sequential training: rayspec study study=NAME [options] [training overrides]",
    "schedule": "print a pipeline schedule: rayspec schedule [schedule=1f1b] [stages=4] [microbatches=8] [json=true]",
}
"""Command -> what it does; the command runs ``rayspec.cli.<command>.main``."""


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS.items()]
    return "\n".join(["usage: rayspec COMMAND [key=value ...]   (rayspec COMMAND --help for a command's options)",
                      "", "commands:", *lines,
                      "", "python -m rayspec.COMMAND takes the same arguments."])


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rayspec ARGV`` (default: this process's arguments); returns the command's exit code, 2 for no command
    or an unknown one."""
    # The first word picks the command and the rest goes to it untouched: argparse subcommands would read the
    # arguments themselves (train's --help, -m and --cfg belong to Hydra).
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not args or args[0] not in COMMANDS:
        given = f"rayspec: unknown command {args[0]!r}\n" if args else ""
        print(f"{given}{usage()}", file=sys.stderr)
        return 2
    # imported here, so that `rayspec --help` answers without loading torch, Ray and Hydra
    command = importlib.import_module(f"rayspec.cli.{args[0]}")
    return int(command.main(args[1:]) or 0)
