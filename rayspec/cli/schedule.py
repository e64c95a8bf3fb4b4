"""``python -m rayspec.schedule``: print a schedule as a stage x time-slot grid, or one JSON record per action."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable

from rayspec.core.methods import METHODS, VARIANTS
from rayspec.core.schedule import SCHEDULES, Schedule, ScheduleError, build_schedule

__all__ = ["describe", "main"]


def describe(schedule: Schedule, method: str, variant: str) -> list[dict]:
    """One record per action in execution order: stage, kind, microbatch, version and ``s``."""
    held = schedule.versions()
    s = schedule.differences(method, variant) or {k: 0 for k in held}
    return [
        {"stage": a.stage, "kind": str(a.kind), "microbatch": a.microbatch, "version": held[a.key], "s": s[a.key]}
        for a in schedule.order()
    ]


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rayspec.schedule", description=__doc__.splitlines()[0])
    pipelined = sorted(name for name, m in METHODS.items() if m.pipelined)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=SCHEDULES, default=None, help="default: the method's schedule")
    parser.add_argument("--method", choices=pipelined, default="spectrain")
    parser.add_argument("--variant", choices=VARIANTS, default="paper")
    parser.add_argument("--group", type=int, default=None, help="micro-batches per update (gpipe: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON record per action instead of the grid")
    args = parser.parse_args(None if argv is None else list(argv))
    name = args.schedule or METHODS[args.method].schedule
    if name is None:
        parser.error(f"--method {args.method} runs no pipeline schedule; give --schedule")
    try:
        schedule = build_schedule(name, args.stages, args.microbatches, group=args.group)
    except ScheduleError as err:
        parser.error(str(err))
    if args.json:
        print(json.dumps(describe(schedule, args.method, args.variant)))
        return
    s = schedule.differences(args.method, args.variant)
    print(schedule.grid(s))
    if s is not None:
        print(f"cells read F<m>+<s>: weights predicted s versions ahead ({args.method}, variant={args.variant})")
