"""``python -m rayspec.schedule``: print a schedule as a stage x time-slot grid, torch's CSV (``2F0``, ``1I3``, one
row per rank) or one JSON record per action; ``--read FILE`` checks a torch CSV and prints it the same ways."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable

from rayspec.core.methods import METHODS, VARIANTS
from rayspec.core.orders import BUBBLES, bubble_formula
from rayspec.core.schedule import EQUAL_FIW, SCHEDULES, Schedule, ScheduleError, build_schedule
from rayspec.core.schedule_text import load_schedule, to_csv

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
    parser.add_argument("--virtual", type=int, default=1, help="model chunks per rank (interleaved)")
    parser.add_argument("--read", metavar="FILE", help="a schedule in torch's compute-only CSV, checked as torch does")
    parser.add_argument("--json", action="store_true", help="print one JSON record per action instead of the grid")
    parser.add_argument("--csv", action="store_true", help="print torch's compute-only CSV instead of the grid")
    args = parser.parse_args(None if argv is None else list(argv))
    name = args.schedule or METHODS[args.method].schedule
    if name is None:
        parser.error(f"--method {args.method} runs no pipeline schedule; give --schedule")
    try:
        if args.read:
            schedule = load_schedule(args.read)
        else:
            schedule = build_schedule(name, args.stages, args.microbatches, group=args.group, virtual=args.virtual)
    except (ScheduleError, OSError) as err:
        parser.error(str(err))
    method = args.method if not args.read else "vanilla"  # a file's schedule: no staleness to predict
    if args.json:
        print(json.dumps(describe(schedule, method, args.variant)))
        return
    if args.csv:
        print(to_csv(schedule), end="")
        return
    s = schedule.differences(method, args.variant)
    print(schedule.grid(s))
    if s is not None:
        print(f"cells read F<m>+<s>: weights predicted s versions ahead ({args.method}, variant={args.variant})")
    formula = ""
    if schedule.name in BUBBLES and schedule.group == schedule.microbatches:
        value = bubble_formula(schedule.name, schedule.ranks, schedule.microbatches, schedule.virtual)
        formula = f"formula {BUBBLES[schedule.name]} = {value:.4f}, "
    print(f"bubble: {formula}simulated with F = I = W (B = I + W): {schedule.bubble(EQUAL_FIW):.4f}")
