"""``rayspec schedule`` (``python -m rayspec.schedule``): print a schedule as a stage x time-slot grid, torch's CSV
(``2F0``, ``1I3``, one row per rank) or one JSON record per action; ``read=FILE`` checks a torch CSV and prints it
the same ways."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from types import SimpleNamespace

from rayspec.cli.common import check_keys, parse_overrides
from rayspec.config.compose import override_key
from rayspec.core.methods import METHODS, VARIANTS
from rayspec.core.orders import BUBBLES, bubble_formula
from rayspec.core.schedule import EQUAL_FIW, SCHEDULES, Schedule, ScheduleError, build_schedule
from rayspec.core.schedule_text import load_schedule, to_csv
from rayspec.errors import RayspecError, unknown

__all__ = ["describe", "parse_args", "main"]


def describe(schedule: Schedule, method: str, variant: str) -> list[dict]:
    """One record per action in execution order: stage, kind, microbatch, version and ``s``."""
    held = schedule.versions()
    s = schedule.differences(method, variant) or {k: 0 for k in held}
    return [
        {"stage": a.stage, "kind": str(a.kind), "microbatch": a.microbatch, "version": held[a.key], "s": s[a.key]}
        for a in schedule.order()
    ]


USAGE = """usage: rayspec schedule [stages=4] [microbatches=8] [schedule=NAME] [method=spectrain] [variant=paper]
                        [group=N] [virtual=1] [read=FILE] [json=true | csv=true]
       (python -m rayspec.schedule takes the same arguments; values are read as Hydra overrides)
  schedule   {schedules} (default: the method's schedule)
  method     {methods}
  variant    {variants}
  group      micro-batches per update (gpipe: all)
  virtual    model chunks per rank (interleaved)
  read       a schedule in torch's compute-only CSV, checked as torch does
  json       print one JSON record per action instead of the grid
  csv        print torch's compute-only CSV instead of the grid"""
DEFAULTS = {"stages": 4, "microbatches": 8, "schedule": None, "method": "spectrain", "variant": "paper", "group": None,
            "virtual": 1, "read": None, "json": False, "csv": False}


def parse_args(argv: Iterable[str]) -> SimpleNamespace:
    """The ``key=value`` arguments (Hydra's override grammar, as every rayspec command reads them) over ``DEFAULTS``.

    Raises:
        ScheduleError: an unknown key, or a value of the wrong type.
        ConfigError: a name not among the choices (schedule, method, variant).
    """
    options, rest = parse_overrides(list(argv), tuple(DEFAULTS), ("read",), _usage(), ScheduleError)
    check_keys(dict.fromkeys(override_key(o) for o in rest), tuple(DEFAULTS), "rayspec.schedule", ScheduleError)
    args = SimpleNamespace(**{**DEFAULTS, **options})
    for key, choices in (("schedule", SCHEDULES), ("method", _pipelined()), ("variant", VARIANTS)):
        value = getattr(args, key)
        if value is not None and value not in choices:
            raise unknown(key, value, choices)
    for key in ("stages", "microbatches", "group", "virtual"):
        value = getattr(args, key)
        if (value is not None or key != "group") and (not isinstance(value, int) or isinstance(value, bool)):
            raise ScheduleError(f"{key}={value!r} must be an integer")
    for key in ("json", "csv"):
        if not isinstance(getattr(args, key), bool):
            raise ScheduleError(f"{key}={getattr(args, key)!r} must be true or false")
    return args


def _pipelined() -> list[str]:
    return sorted(name for name, m in METHODS.items() if m.pipelined)


def _usage() -> str:
    return USAGE.format(schedules=", ".join(SCHEDULES), methods=", ".join(_pipelined()), variants=", ".join(VARIANTS))


def main(argv: Iterable[str] | None = None) -> int:
    """Run ``python -m rayspec.schedule``; returns the exit code (2: bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(_usage())
        return 0
    try:
        args = parse_args(argv)
        schedule = _schedule(args)
    except (RayspecError, OSError) as err:  # ScheduleError, ConfigError (an unknown name)
        print(f"error: {err}", file=sys.stderr)
        return 2
    method = args.method if not args.read else "vanilla"  # a file's schedule: no staleness to predict
    if args.json:
        print(json.dumps(describe(schedule, method, args.variant)))
    elif args.csv:
        print(to_csv(schedule), end="")
    else:
        _print_grid(schedule, method, args)
    return 0


def _schedule(args: SimpleNamespace) -> Schedule:
    """The schedule read from ``read=FILE``, or the one the method (or ``schedule=NAME``) builds."""
    if args.read:
        return load_schedule(args.read)
    name = args.schedule or METHODS[args.method].schedule
    if name is None:
        raise ScheduleError(f"method={args.method} runs no pipeline schedule; give schedule=NAME")
    return build_schedule(name, args.stages, args.microbatches, group=args.group, virtual=args.virtual)


def _print_grid(schedule: Schedule, method: str, args: SimpleNamespace) -> None:
    """The stage x time-slot grid, what its cells mean, and the bubble (formula and simulated)."""
    s = schedule.differences(method, args.variant)
    print(schedule.grid(s))
    if s is not None:
        print(f"cells read F<m>+<s>: weights predicted s versions ahead ({args.method}, variant={args.variant})")
    formula = ""
    if schedule.name in BUBBLES and schedule.group == schedule.microbatches:
        value = bubble_formula(schedule.name, schedule.ranks, schedule.microbatches, schedule.virtual)
        formula = f"formula {BUBBLES[schedule.name]} = {value:.4f}, "
    print(f"bubble: {formula}simulated with F = I = W (B = I + W): {schedule.bubble(EQUAL_FIW):.4f}")
