"""The order each rank runs its actions in, per schedule: short generators of ``(stage, kind, micro-batch)``.

Nothing here imports torch or Ray; ``rayspec.core.schedule`` turns the orders into a ``Schedule`` and checks
them. A rank runs one stage, or with ``virtual`` model chunks the stages ``rank, rank + N, ...`` (torch's loop
placement). The orders are torch's (``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` with one chunk per rank,
``ScheduleInterleaved1F1B``), so a CSV either side writes runs the same on the other. ``BUBBLES`` gives each
schedule's bubble as a formula: idle time over busy time per rank when F, I and W each take one unit (B = I + W).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["Step", "ORDERS", "BUBBLES", "order", "bubble_formula", "measured_bubble"]

Step = tuple[int, str, int]
"""``(stage, kind, micro-batch)``: one action of a rank."""


def vanilla(stages: int, rank: int, m: int, group: int, virtual: int) -> list[Step]:
    return [step for j in range(m) for step in ((rank, "F", j), (rank, "B", j))]


def gpipe(stages: int, rank: int, m: int, group: int, virtual: int) -> list[Step]:
    out: list[Step] = []
    for g0 in range(0, m, group):
        out += [(rank, "F", j) for j in range(g0, g0 + group)] + [(rank, "B", j) for j in range(g0, g0 + group)]
    return out


def one_f_one_b(stages: int, rank: int, m: int, group: int, virtual: int) -> list[Step]:
    """PipeDream's 1F1B, streaming across updates: N-k-1 warm-up forwards, then F and B in turn, then drain::

        rank 0 | F0 F1 F2 .  .  .  B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5
        rank 3 |          F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5
    """
    warm = min(stages - rank - 1, m)
    out: list[Step] = [(rank, "F", j) for j in range(warm)]
    for j in range(m):
        if j + warm < m:
            out.append((rank, "F", j + warm))
        out.append((rank, "B", j))
    return out


def flushed_1f1b(stages: int, rank: int, m: int, group: int, virtual: int) -> list[Step]:
    """Synchronous 1F1B (DeepSpeed, Megatron, torch's ``Schedule1F1B``): one fill-1F1B-drain per ``group``."""
    return [(k, kind, j + g0) for g0 in range(0, m, group)
            for k, kind, j in one_f_one_b(stages, rank, group, group, virtual)]


def zb1p(stages: int, rank: int, m: int, group: int, virtual: int) -> list[Step]:
    """ZB-H1 per batch: the backward split into I (input gradient, on the critical path) and W (weight gradient),
    rank k holding back k W's so that they fill the drain's bubble (torch's ``ScheduleInterleavedZeroBubble`` with
    one chunk per rank)::

        rank 0 | F0 F1 F2 F3 I0 W0 F4 I1 W1 ...  I7 W7
        rank 3 | F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 ... W7
    """
    out: list[Step] = []
    for g0 in range(0, m, group):
        warm = min(stages - rank, group)
        steps: list[Step] = [(rank, "F", j) for j in range(warm)]
        for j in range(group):
            steps.append((rank, "I", j))
            if j - rank >= 0:
                steps.append((rank, "W", j - rank))
            if j + warm < group:
                steps.append((rank, "F", j + warm))
        steps += [(rank, "W", j) for j in range(max(group - rank, 0), group)]
        out += [(k, kind, j + g0) for k, kind, j in steps]
    return out


def interleaved(stages: int, rank: int, m: int, group: int, virtual: int) -> list[Step]:
    """Interleaved 1F1B per batch (Megatron, torch's ``ScheduleInterleaved1F1B``): rank k holds chunks k, k+N, ...;
    forwards go N micro-batches per chunk, backwards the same with the chunks reversed; (v-1)N + 2(N-1-k) warm-up
    forwards, then one forward and one backward in turn, then drain."""
    n, v = stages, virtual
    total = group * v

    def forward(i: int) -> Step:
        return (rank + n * ((i // n) % v), "F", (i // (n * v)) * n + i % n)

    def backward(i: int) -> Step:
        return (rank + n * (v - 1 - (i // n) % v), "B", (i // (n * v)) * n + i % n)

    warm = min((v - 1) * n + 2 * (n - 1 - rank), total)
    steps = [forward(i) for i in range(warm)]
    for i in range(total - warm):
        steps += [forward(warm + i), backward(i)]
    steps += [backward(i) for i in range(total - warm, total)]
    return [(k, kind, j + g0) for g0 in range(0, m, group) for k, kind, j in steps]


ORDERS: dict[str, Callable[[int, int, int, int, int], list[Step]]] = {
    "vanilla": vanilla, "gpipe": gpipe, "1f1b": one_f_one_b, "1f1b-flushed": flushed_1f1b, "zb1p": zb1p,
    "interleaved": interleaved,
}
"""Each schedule's order: ``ORDERS[name](stages N, rank, micro-batches, group, virtual)``, one rank's steps."""

BUBBLES: dict[str, str] = {
    "vanilla": "p-1", "gpipe": "(p-1)/m", "1f1b": "(p-1)/m", "1f1b-flushed": "(p-1)/m", "zb1p": "(p-1)/(3m)",
    "interleaved": "(p-1)/(v m)",
}
"""Each schedule's bubble per segment (p ranks, m micro-batches per flush, v chunks per rank), as text."""


def order(name: str, stages: int, rank: int, microbatches: int, group: int, virtual: int = 1) -> list[Step]:
    """Rank ``rank``'s steps in the schedule ``name`` (``ORDERS``)."""
    return ORDERS[name](stages, rank, microbatches, group, virtual)


def bubble_formula(name: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """``BUBBLES[name]`` at ``p = stages``, ``m = microbatches`` per flush, ``v = virtual``: the bubble when F, I and
    W each take one unit (B = I + W)."""
    p, m, v = stages, microbatches, virtual
    formulas = {"vanilla": p - 1.0, "gpipe": (p - 1) / m, "1f1b": (p - 1) / m, "1f1b-flushed": (p - 1) / m,
                "zb1p": (p - 1) / (3 * m), "interleaved": (p - 1) / (v * m)}
    return formulas[name]


def measured_bubble(timelines: Sequence[Sequence[tuple]], ranks: int | None = None) -> float:
    """Idle over busy time of ``ranks`` ranks (default one per timeline) from measured actions: per stage,
    ``(kind, micro-batch, start, end)`` (``Executor.timeline()``), from the first start to the last end."""
    spans = [(row[-2], row[-1]) for timeline in timelines for row in timeline]
    busy = sum(end - start for start, end in spans)
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    return (wall * (ranks or len(timelines)) - busy) / busy
