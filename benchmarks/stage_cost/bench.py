"""What one micro-batch costs inside a stage, beyond its forward and backward: updates, prediction, swaps.

    python -m benchmarks.stage_cost [--quick] [--model mlp] [--size full] [--batch 256] [--microbatches 8]

The peer benchmark's model and split (``benchmarks.peer``), each stage alone in this process at one
thread, micro-batches of ``batch / microbatches`` samples, F then B per micro-batch in steady state:

* ``gpipe``: policy ``none``, one update per ``microbatches`` backwards (a flushed schedule's work);
* ``async``: policy ``none``, one update per micro-batch (asynchronous 1F1B's);
* ``spectrain``: policy ``predict`` with ``s = 1`` for F and B, one update per micro-batch, the
  prediction probe on (the trainer's default);
* ``spectrain (compiled)``: the same with ``optim.compile``: the update and the next prediction in one
  compiled pass (``rayspec.core.fused``);
* ``spectrain (copy swap)``: the same with ``rayspec.core.swap.SWAP_STORAGE`` off, the fallback where
  storage pointers cannot be exchanged: each predicted action copies the stored weights away (a
  fresh tensor), writes the prediction in and copies them back;
* ``spectrain (foreach SGD)``: torch's foreach kernels instead of its fused ones;
* the AdamW runs: ``gpipe adamw``, ``spectrain adamw``, ``spectrain adamw (compiled)``;
* ``F+B only``: no update at all; each other run's ``update_ms`` is its time less this one's.

``passes`` counts the bytes the update work moves per micro-batch in passes over the stage's parameters,
``min_passes`` the one-read-one-write minimum of the same work (``roofline.py``). On stage 0's parameter
shapes alone, ``roofline.measure`` times the update ways (torch's step, the step then the prediction, the
compiled pass) against a plain ``copy_`` of the same size: the bandwidth each reaches and its fraction of
``copy_``'s; and the levers beside them (one flat buffer, the first compiled call).

It also times, on the stage's gradients, the non-finite check that every update makes (one summing
pass) against the infinity norm it replaced. Figures are ms per micro-batch, the fastest of ``--repeats``
interleaved runs of ``--count`` micro-batches each (the least disturbed by the machine's other load; the
roofline's: the fastest of its interleaved calls); ratios are of figures from the same run.

The latest figures, with the command that made them: ``benchmarks/stage_cost/README.md``.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from collections.abc import Sequence

import torch

import rayspec.core.swap
from benchmarks._shared.peer_setup import PeerConfig, build_parts, make_batches
from benchmarks._shared.results import table, write
from benchmarks.stage_cost import roofline
from rayspec.core.finite import FiniteChecks
from rayspec.core.optim import OptimSpec
from rayspec.core.stage import Stage
from rayspec.core.stage_spec import StageSpec

ADAMW = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.01}
RUNS = {  # name: (policy, update every, s, pointer swap, optimizer settings)
    "F+B only": ("none", 10**9, 0, True, {}),
    "gpipe": ("none", None, 0, True, {}),
    "async": ("none", 1, 0, True, {}),
    "spectrain": ("predict", 1, 1, True, {}),
    "spectrain (compiled)": ("predict", 1, 1, True, {"compile": True}),
    "spectrain (copy swap)": ("predict", 1, 1, False, {}),
    "spectrain (foreach SGD)": ("predict", 1, 1, True, {"fused": False}),
    "gpipe adamw": ("none", None, 0, True, ADAMW),
    "spectrain adamw": ("predict", 1, 1, True, ADAMW),
    "spectrain adamw (compiled)": ("predict", 1, 1, True, {**ADAMW, "compile": True}),
}
"""``F+B only`` never updates: the other runs' update work per micro-batch is their time less its."""
OVER = {"spectrain": "gpipe", "spectrain (compiled)": "gpipe", "spectrain adamw": "gpipe adamw",
        "spectrain adamw (compiled)": "gpipe adamw"}
"""The run each predicting run's extra cost is measured against (the same optimizer's flushed run)."""


def per_microbatch_s(part: torch.nn.Module, index: int, inputs: list, labels: list, grad: torch.Tensor | None,
                     policy: str, every: int, s: int, count: int, optim: dict | None = None) -> float:
    """Seconds per F + B of one stage in steady state (8 micro-batches of warm-up first)."""
    settings = {"momentum": 0.9, **(optim or {})}
    lr, name = settings.pop("lr", 0.01), settings.pop("optimizer", "sgd")
    spec = StageSpec(lr=lr, optim=OptimSpec(name, **settings), policy=policy, group=every)
    stage = Stage(copy.deepcopy(part), spec, index, 2)
    last = index == 1

    def one(m: int) -> None:
        k = m % len(inputs)
        stage.forward(m, inputs[k], labels[k] if last else None, s)
        stage.backward(m, None if last else grad, s, update=(m + 1) % every == 0)

    for m in range(8):
        one(m)
    t0 = time.perf_counter()
    for m in range(8, 8 + count):
        one(m)
    return (time.perf_counter() - t0) / count


def check_s(grads: list[torch.Tensor], repeats: int = 20) -> dict[str, float]:
    """Seconds of the non-finite gradient check: the summing pass (what a stage runs, ``FiniteChecks.grads_of``), torch's
    foreach 2-norm (what a clipping stage checks, as it has the norms anyway), and the infinity norm."""
    module = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(g)) for g in grads])
    for p, g in zip(module, grads):
        p.grad = g
    out = {}
    checks = FiniteChecks(0)
    for name, fn in (("norm", lambda: bool(torch.isfinite(torch.stack(torch._foreach_norm(grads, 2))).all())),
                     ("sum", lambda: checks.grads_of(module, 1)),
                     ("inf_norm", lambda: bool(torch.isfinite(torch.stack(torch._foreach_norm(grads, math.inf))).all()))):
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[name] = (time.perf_counter() - t0) / repeats
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few micro-batches (a smoke test)")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--size", default="full")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--count", type=int, default=40, help="timed micro-batches per run")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    size, count, repeats = ("tiny", 8, 1) if args.quick else (args.size, args.count, args.repeats)
    cfg = PeerConfig(args.model, size, args.batch, args.microbatches)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    parts, balance = build_parts(cfg)
    times = _timed(parts, cfg, count, repeats)
    rows = []
    for k in (0, 1):
        rows += _rows(k, parts[k], times, cfg.microbatches)
    shapes = [p.shape for p in parts[0].parameters()]
    roof, levers = roofline.measure(shapes, repeats=3 if args.quick else 15)
    print(f"model {cfg.model} ({size}) split {balance}; micro-batch {cfg.batch // cfg.microbatches}; one thread")
    print(table(rows, ["stage", "params_M", "run", "ms_per_microbatch", "over_gpipe", "update_ms", "passes",
                       "min_passes", "check_sum_ms", "check_inf_norm_ms"]))
    print(f"\nthe update work on stage 0's parameter shapes ({levers['params'] / 1e6:.2f}M elements, one thread):")
    print(table(roof, list(roof[0])))
    print("levers:", ", ".join(f"{k} {v}" for k, v in levers.items()))
    payload = {"config": vars(args), "rows": rows, "roofline": roof, "levers": levers}
    print(f"wrote {write('stage_cost', payload, quick=args.quick)}")


def _timed(parts: list, cfg: PeerConfig, count: int, repeats: int) -> dict[tuple[int, str], list[float]]:
    """Seconds per micro-batch of every run on each stage, ``repeats`` times, the runs interleaved."""
    x, y = make_batches(cfg)[0]
    xs, ys = list(x.tensor_split(cfg.microbatches)), list(y.tensor_split(cfg.microbatches))
    with torch.no_grad():
        acts = [parts[0](a) for a in xs]
    grad = torch.randn_like(acts[0]) * 1e-4
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(repeats):  # runs interleaved, so load drifts hit all alike
        for name, (policy, every, s, pointer, optim) in RUNS.items():
            rayspec.core.swap.SWAP_STORAGE = pointer and hasattr(torch.UntypedStorage, "_swap_data_ptr_")
            for k in (0, 1):
                t = per_microbatch_s(parts[k], k, xs if k == 0 else acts, ys, grad, policy,
                                     every or cfg.microbatches, s, count, optim)
                times.setdefault((k, name), []).append(t)
    rayspec.core.swap.SWAP_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
    return times


def _rows(k: int, part: torch.nn.Module, times: dict[tuple[int, str], list[float]], microbatches: int) -> list[dict]:
    """Stage ``k``'s rows: ms per micro-batch, over its flushed run (``OVER``), the update work's ms (the run less
    ``F+B only``) and passes over the parameters per micro-batch (``roofline.passes``), the non-finite checks."""
    ms = {name: min(times[k, name]) * 1e3 for name in RUNS}  # the run least disturbed by the machine's other load
    params = sum(p.numel() for p in part.parameters())
    check = check_s([torch.randn_like(p) for p in part.parameters()])
    rows = []
    for name, (policy, every, _, _, optim) in RUNS.items():
        optimizer = "adamw" if optim.get("optimizer") == "adamw" else "sgd"
        predictions = 1 if policy == "predict" else 0  # F and B of one version share their prediction
        moved, least = roofline.passes(optimizer, every or microbatches, predictions, bool(optim.get("compile")))
        updates = name != "F+B only"
        rows.append({"stage": k, "params_M": round(params / 1e6, 2), "run": name,
                     "ms_per_microbatch": round(ms[name], 2),
                     "over_gpipe": round(ms[name] / ms[OVER.get(name, "gpipe")], 2),
                     "update_ms": round(ms[name] - ms["F+B only"], 2) if updates else 0.0,
                     "passes": round(moved, 2) if updates else 0, "min_passes": round(least, 2) if updates else 0,
                     "check_norm_ms": round(check["norm"] * 1e3, 2), "check_sum_ms": round(check["sum"] * 1e3, 2),
                     "check_inf_norm_ms": round(check["inf_norm"] * 1e3, 2)})
    return rows


if __name__ == "__main__":
    main()
