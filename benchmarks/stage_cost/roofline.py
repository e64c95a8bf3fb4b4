"""The update work of a stage against the memory roofline: bytes each method moves per micro-batch, and the
bandwidth its update and prediction reach against a plain ``copy_`` of the same size.

Bytes are counted in *passes* over the stage's parameters (one pass: one parameter-sized tensor read or written):

* torch's fused step: SGD reads gradient, buffer, weights and writes buffer, weights (5); Adam/AdamW reads
  gradient, two moments, weights and writes the moments and the weights (7). That is the step's own minimum.
* a prediction ``a * W + b * D``: reads weights and direction, writes the scratch copy (3; 5 where ``a != 1``,
  AdamW's decay: a scaled copy first). Adam's direction ``D``, computed in full: 11 (five element-wise calls).
* a predicting update's minimum, one read and one write of each element: SGD 6 (gradient, buffer, weights in;
  buffer, weights, prediction out), Adam/AdamW 8.

``achieved`` is the minimum's bytes over the measured time: the bandwidth a one-pass kernel would need to take
that long; its ratio to ``copy_``'s (2 passes per call) is the fraction of the roofline reached.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from rayspec.core import fused
from rayspec.core.optim import Optimizer, OptimSpec

STEP = {"sgd": 5, "adamw": 7}
MINIMUM = {"sgd": 6, "adamw": 8}
DIRECTION = {"sgd": 0, "adamw": 11}
PREDICT = {"sgd": 3, "adamw": 5}
SETTINGS = {"sgd": {"lr": 0.01, "momentum": 0.9}, "adamw": {"lr": 1e-3, "weight_decay": 0.01}}


def passes(optimizer: str, every: int, predictions: int, compiled: bool) -> tuple[float, float]:
    """Passes moved per micro-batch by the update work of a run (updates every ``every`` micro-batches, each
    followed by ``predictions`` computed predictions), and the one-read-one-write minimum of the same work."""
    if not predictions:
        return STEP[optimizer] / every, STEP[optimizer] / every
    if compiled:
        moved = float(MINIMUM[optimizer])
    else:
        moved = STEP[optimizer] + DIRECTION[optimizer] + predictions * PREDICT[optimizer]
    return moved / every, MINIMUM[optimizer] / every


def _fastest(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Per name, the fastest of ``repeats`` timed calls after one warm-up, the calls taken in turn so that the
    machine's other load hits all alike; the minimum is the figure least disturbed by it."""
    best = {}
    for name, fn in fns.items():
        fn()
        best[name] = float("inf")
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _optimizer(shapes: Sequence[torch.Size], name: str, compiled: bool) -> tuple[Optimizer, list[torch.nn.Parameter]]:
    """An optimizer over fresh parameters of ``shapes`` with gradients, after one step (its state exists)."""
    params = [torch.nn.Parameter(torch.randn(s) * 0.05) for s in shapes]
    settings = dict(SETTINGS[name])
    settings.pop("lr")
    opt = Optimizer(params, OptimSpec(name, compile=compiled, **settings))
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step(SETTINGS[name]["lr"])
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return opt, params


def measure(shapes: Sequence[torch.Size], repeats: int = 15) -> tuple[list[dict], dict]:
    """Rows per optimizer and way of updating (ms, passes, GB/s, fraction of ``copy_``'s) for parameters of
    ``shapes``, and the levers measured beside them (one flat buffer, the first compiled call)."""
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    src, dst = torch.randn(numel), torch.empty(numel)
    fns: dict[tuple[str, str], Callable[[], object]] = {("-", "copy_"): lambda: dst.copy_(src)}
    moved: dict[tuple[str, str], tuple[float, float]] = {("-", "copy_"): (2, 2)}
    levers: dict = {"params": numel}
    for name in ("sgd", "adamw"):
        for way, (fn, passes_moved, least) in _ways(shapes, name, levers).items():
            fns[name, way], moved[name, way] = fn, (passes_moved, least)
    flat = _flat_ways(shapes)
    times = _fastest({**fns, **flat}, repeats)
    copy_gbps = 2 * numel * 4 / times["-", "copy_"] / 1e9
    rows = []
    for key in fns:
        gbps = moved[key][1] * numel * 4 / times[key] / 1e9
        rows.append({"optimizer": key[0], "update": key[1], "ms": round(times[key] * 1e3, 2), "passes": moved[key][0],
                     "min_passes": moved[key][1], "GBps": round(gbps, 1), "of_copy": round(gbps / copy_gbps, 2)})
    levers.update({"copy_GBps": round(copy_gbps, 1), "tensors_per_stage": len(shapes),
                   **{k: round(times[k] * 1e3, 2) for k in flat}})
    return rows, levers


def _ways(shapes: Sequence[torch.Size], name: str, levers: dict) -> dict[str, tuple[Callable[[], object], float, float]]:
    """``name``'s ways of updating (a call, its passes, its minimum): torch's step alone, then the prediction as the
    stage computes it without ``optim.compile``, and the compiled pass (its first call timed into ``levers``)."""
    lr = SETTINGS[name]["lr"]
    plain, _ = _optimizer(shapes, name, False)
    out = [torch.empty(s) for s in shapes]
    a = 1.0 - lr * 0.01 if name == "adamw" else 1.0

    def separate() -> None:
        plain.step(lr)
        for w, d, t in zip(plain.aliases, plain.direction(), out):  # what WeightSwap computes
            assert d is not None
            if a == 1.0:
                torch.add(w, d, alpha=-lr, out=t)
            else:
                torch.mul(w, a, out=t).add_(d, alpha=-lr)

    compiled, params = _optimizer(shapes, name, True)
    t0 = time.perf_counter()
    ran = compiled.step(lr, (a, -lr, out))  # the first call compiles (or finds the compiled code in the cache)
    levers[f"first_compiled_call_s_{name}"] = round(time.perf_counter() - t0, 2)
    levers[f"compiled_{name}"] = ran
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return {"step (torch fused)": (lambda: plain.step(lr), STEP[name], STEP[name]),
            "step, then prediction": (separate, STEP[name] + DIRECTION[name] + PREDICT[name], MINIMUM[name]),
            "step + prediction, compiled": (lambda: compiled.step(lr, (a, -lr, out)), MINIMUM[name], MINIMUM[name])}


def _flat_ways(shapes: Sequence[torch.Size]) -> dict[str, Callable[[], object]]:
    """The compiled SGD step + prediction per parameter tensor and as one call on a flat buffer of the same size
    (gradients already flat: the copy that would put them there is not counted)."""
    spec = OptimSpec("sgd")
    per = [tuple(torch.randn(s) for _ in range(4)) for s in shapes]
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    flat = [tuple(torch.randn(numel) for _ in range(4))]

    def run(groups: Sequence[tuple[torch.Tensor, ...]]) -> None:
        ws, gs, ms, ps = zip(*groups)
        fused.sgd_step(ws, gs, ms, ps, 0.01, spec, 1.0, -0.01)

    return {"compiled_per_parameter_ms": lambda: run(per), "compiled_flat_buffer_ms": lambda: run(flat)}
