"""Weight memory: peak parameter + optimizer state per stage of ``pipedream`` (weight stash) against ``spectrain``.

    python -m benchmarks.memory [--quick] [--models vgg16,resnet50] [--size full] [--stages 2,4,8]
                                [--partition parameters] [--segments 2]

Each model is cut into ``N`` stages (``by_parameters`` by default: memory is what is being
balanced), and each method's own 1F1B schedule runs through ``LocalExecutor`` for ``--segments``
segments of ``2N`` micro-batches (enough for every stage to reach steady state: stage ``k``
needs ``2(N-k) - 1``). Micro-batches are tiny (2 samples) and the learning rate small (the
losses only have to stay finite): the state measured here is parameter-sized and depends on
neither. ``--quick`` builds tiny models. Per stage, ``Stage.stats.peak_weight_bytes`` is read after the
first segment and after the last; it is the largest sum of ``Stage.weight_bytes()`` (weights, optimizer state, scratch copy, stash) seen so far.

Expected, in copies of the stage's weights ``W_k`` (read off ``rayspec/core/stage.py``):

* ``spectrain``: weights + momentum + one scratch copy = 3, or 2 on a stage whose actions
  all have ``s = 0`` (the scratch is allocated on the first prediction; with ``N = 2`` the last
  stage never predicts under the ``paper`` variant, under ``consistent`` the last stage never
  does for any ``N``).
* ``pipedream``, first segment: weights + momentum + ``N - k`` stashed versions = ``2 + N - k``.
  The stash holds the current version too, so steady-state backwards restore from it and need
  no scratch; only the drain (where the current version is no longer stashed) allocates the
  scratch, when the stash has already shrunk, so the peak stays ``2 + N - k``.
* ``pipedream``, later segments: the same; the drain's scratch is freed once the stage has no
  micro-batch in flight, so every segment (every ``train.eval_every`` or ``checkpoint.every``)
  peaks at ``2 + N - k`` again.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence

import torch

from benchmarks._shared.models import build
from benchmarks._shared.results import table, write
from rayspec.core.methods import METHODS
from rayspec.core.optim import OptimSpec
from rayspec.core.schedule import build_schedule
from rayspec.core.stage import make_stages
from rayspec.core.stage_spec import StageSpec
from rayspec.data import DataInfo
from rayspec.exec import LocalExecutor
from rayspec.models import ModelError
from rayspec.partition import PartitionError, by_parameters, split, uniform

STORED = ("pipedream", "spectrain")
FULL_MODELS = ("vgg16", "resnet50", "resnet152", "transformer", "residual_lstm")
QUICK_MODELS = ("mlp", "vgg16", "transformer")
MIB = 2**20


def microbatch_count(n: int) -> int:
    """Micro-batches per segment: ``2N``, one past the ``2N - 1`` that stage 0 needs to reach steady state."""
    return 2 * n


def make_microbatches(info: DataInfo, count: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` random ``(input, labels)`` micro-batches of ``batch`` samples for ``info``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        if info.kind == "image":
            x = torch.randn(batch, *info.input_shape, generator=g)
        else:
            if not info.vocab_size:
                raise ModelError(f"text micro-batches need DataInfo.vocab_size, got {info.vocab_size}")
            x = torch.randint(1, info.vocab_size, (batch, *info.input_shape), generator=g)
        out.append((x, torch.randint(0, info.num_classes, (batch,), generator=g)))
    return out


def balance_for(model: torch.nn.Sequential, n: int, partition: str) -> list[int]:
    """Block counts per stage: ``uniform`` or ``parameters``."""
    if partition == "uniform":
        return uniform(len(model), n)
    if partition == "parameters":
        return by_parameters(model, n)
    raise ValueError(f"--partition={partition!r} is unknown; choose uniform or parameters")


def predicting_stages(n: int, microbatches: int, variant: str = "paper") -> list[bool]:
    """Per stage: whether any of its 1F1B actions predicts (``s > 0``), i.e. whether it allocates the scratch."""
    s = build_schedule("1f1b", n, microbatches).version_differences(variant)
    return [any(v > 0 for (k, _, _), v in s.items() if k == stage) for stage in range(n)]


def expected_copies(method: str, n: int, k: int, *, later: bool, predicts: bool = True) -> int:
    """Copies of ``W_k`` at stage ``k``'s peak, as the code of ``Stage`` keeps them (see the module docstring).

    Args:
        method: ``pipedream`` or ``spectrain``.
        n: stages.
        k: the stage.
        later: after a second segment (the same count: a drained stage frees its scratch).
        predicts: spectrain only: whether the stage has an action with ``s > 0``.
    """
    if method == "spectrain":
        return 2 + int(predicts)
    if method == "pipedream":
        return 2 + (n - k)
    raise ValueError(f"method={method!r}: expected copies are known for {', '.join(STORED)}")


def stage_memory(
    model: torch.nn.Sequential,
    info: DataInfo,
    n: int,
    method: str,
    balance: list[int],
    *,
    batch: int = 2,
    segments: int = 2,
    variant: str = "paper",
    lr: float = 1e-4,
    momentum: float = 0.9,
) -> list[dict]:
    """Run ``method``'s 1F1B schedule for ``segments`` segments; per stage the weight memory it peaked at.

    Returns:
        One dict per stage: ``weight_bytes`` (``W_k``), ``peak_first`` (peak after the first
        segment), ``peak_later`` (after the last), ``peak_stash`` (most versions stashed at once)
        ``final`` (``Stage.weight_bytes()`` after the last segment, drained) and ``finite``
        (whether every loss was finite; the memory does not depend on it).
    """
    parts = split(copy.deepcopy(model), balance)
    stages = make_stages(parts, method, StageSpec(lr=lr, optim=OptimSpec(momentum=momentum)))
    ex = LocalExecutor(stages, method, variant)
    m = microbatch_count(n)
    schedule = build_schedule(METHODS[method].schedule, n, m)
    first: list[int] = []
    finite = True
    for seg in range(segments):
        losses = ex.run(schedule, make_microbatches(info, m, batch, seed=seg))
        finite = finite and bool(torch.isfinite(torch.tensor(losses)).all())
        if seg == 0:
            first = [st.stats.peak_weight_bytes for st in stages]
    rows = []
    for st, peak0 in zip(stages, first):
        final = st.weight_bytes()
        rows.append({"weight_bytes": final["weights"], "peak_first": peak0, "peak_later": st.stats.peak_weight_bytes,
                     "peak_stash": st.stats.peak_stash, "final": final, "finite": finite})
    return rows


def measure(name: str, size: str, n: int, partition: str, batch: int, segments: int, variant: str = "paper") -> dict:
    """Both methods on ``name`` cut into ``n`` stages: per-stage measured and expected copies."""
    torch.manual_seed(0)
    model, info = build(name, size)
    balance = balance_for(model, n, partition)
    res = {method: stage_memory(model, info, n, method, balance, batch=batch, segments=segments, variant=variant)
           for method in STORED}
    predicts = predicting_stages(n, microbatch_count(n), variant)
    stages = []
    for k in range(n):
        pd, st = res["pipedream"][k], res["spectrain"][k]
        w = pd["weight_bytes"]
        stages.append({
            "stage": k, "blocks": balance[k], "weights_mib": w / MIB,
            "pipedream_mib": pd["peak_first"] / MIB, "pipedream_later_mib": pd["peak_later"] / MIB,
            "spectrain_mib": st["peak_later"] / MIB,
            "pipedream_copies": pd["peak_first"] / w, "pipedream_later_copies": pd["peak_later"] / w,
            "spectrain_copies": st["peak_later"] / w,
            "expected_pipedream": expected_copies("pipedream", n, k, later=False),
            "expected_pipedream_later": expected_copies("pipedream", n, k, later=segments > 1),
            "expected_spectrain": expected_copies("spectrain", n, k, later=True, predicts=predicts[k]),
            "pipedream_peak_stash": pd["peak_stash"],
            "pipedream_final": pd["final"], "spectrain_final": st["final"],
            "ratio": pd["peak_first"] / st["peak_later"], "ratio_later": pd["peak_later"] / st["peak_later"],
            "losses_finite": pd["finite"] and st["finite"],
        })
    total = {key: sum(s[key] for s in stages) for key in ("weights_mib", "pipedream_mib", "pipedream_later_mib",
                                                           "spectrain_mib")}
    total["ratio"] = total["pipedream_mib"] / total["spectrain_mib"]
    total["ratio_later"] = total["pipedream_later_mib"] / total["spectrain_mib"]
    return {"model": name, "size": size, "kind": info.kind, "stages": n, "balance": balance,
            "microbatches_per_segment": microbatch_count(n), "segments": segments, "per_stage": stages, "total": total}


def _rows(result: dict) -> list[dict]:
    def mib(v: float) -> str:
        return f"{v:.0f}" if v >= 100 else f"{v:.2f}" if v >= 1 else f"{v:.3g}"

    rows = [{
        "stage": s["stage"], "blocks": s["blocks"], "W MiB": mib(s["weights_mib"]),
        "pipedream MiB": f"{mib(s['pipedream_mib'])} ({s['pipedream_copies']:.2f}W)",
        "pd exp": f"{s['expected_pipedream']}W",
        "pd later MiB": f"{mib(s['pipedream_later_mib'])} ({s['pipedream_later_copies']:.2f}W)",
        "pd later exp": f"{s['expected_pipedream_later']}W",
        "spectrain MiB": f"{mib(s['spectrain_mib'])} ({s['spectrain_copies']:.2f}W)",
        "st exp": f"{s['expected_spectrain']}W",
        "pd/st": f"{s['ratio']:.2f}", "later pd/st": f"{s['ratio_later']:.2f}",
    } for s in result["per_stage"]]
    t = result["total"]
    rows.append({"stage": "total", "blocks": sum(result["balance"]), "W MiB": mib(t["weights_mib"]),
                 "pipedream MiB": mib(t["pipedream_mib"]), "pd exp": "", "pd later MiB": mib(t["pipedream_later_mib"]),
                 "pd later exp": "", "spectrain MiB": mib(t["spectrain_mib"]), "st exp": "",
                 "pd/st": f"{t['ratio']:.2f}", "later pd/st": f"{t['ratio_later']:.2f}"})
    return rows


COLUMNS = ["stage", "blocks", "W MiB", "pipedream MiB", "pd exp", "pd later MiB", "pd later exp", "spectrain MiB", "st exp",
           "pd/st", "later pd/st"]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models")
    ap.add_argument("--models", default="", help=f"comma-separated (default {','.join(FULL_MODELS)}; "
                                                  f"{','.join(QUICK_MODELS)} with --quick)")
    ap.add_argument("--size", default=None, help="model size (default full; tiny with --quick)")
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--partition", default="parameters", choices=("parameters", "uniform"))
    ap.add_argument("--segments", type=int, default=2, help="segments run per method (>= 2 shows the later peak)")
    ap.add_argument("--batch", type=int, default=2, help="samples per micro-batch")
    ap.add_argument("--variant", default="paper", choices=("paper", "consistent"))
    args = ap.parse_args(argv)
    size = args.size or ("tiny" if args.quick else "full")
    names = [m for m in args.models.split(",") if m] or list(QUICK_MODELS if args.quick else FULL_MODELS)
    results, skipped = [], {}
    mismatches = []
    for name in names:
        for n in (int(v) for v in args.stages.split(",")):
            try:
                r = measure(name, size, n, args.partition, args.batch, max(1, args.segments), args.variant)
            except (ModelError, PartitionError) as err:
                skipped[f"{name}/{n}"] = str(err)
                print(f"\n== {name}, {n} stages: skipped: {err}")
                continue
            results.append(r)
            print(f"\n== {name} ({size}, {r['kind']}), {n} stages, balance {r['balance']}, "
                  f"{r['microbatches_per_segment']} micro-batches x {r['segments']} segments")
            print(table(_rows(r), COLUMNS))
            for s in r["per_stage"]:
                for got, want in (("pipedream_copies", "expected_pipedream"),
                                  ("pipedream_later_copies", "expected_pipedream_later"),
                                  ("spectrain_copies", "expected_spectrain")):
                    if abs(s[got] - s[want]) > 1e-9:
                        mismatches.append(f"{name}/{n} stage {s['stage']}: {got}={s[got]:.3f}, expected {s[want]}")
    if results:
        print("\nsummary (total MiB over stages; pd = pipedream, st = spectrain):")
        print(table([{"model": r["model"], "stages": r["stages"], "W": f"{r['total']['weights_mib']:.1f}",
                      "pipedream": f"{r['total']['pipedream_mib']:.1f}",
                      "pd later": f"{r['total']['pipedream_later_mib']:.1f}",
                      "spectrain": f"{r['total']['spectrain_mib']:.1f}", "pd/st": f"{r['total']['ratio']:.2f}",
                      "later pd/st": f"{r['total']['ratio_later']:.2f}"} for r in results],
                    ["model", "stages", "W", "pipedream", "pd later", "spectrain", "pd/st", "later pd/st"]))
    print("\nexp = analytic copies of W_k: pipedream 2 + (N-k) in every segment (a drained stage frees its "
          "scratch); spectrain 3 (2 on a stage that never predicts)")
    print("all measured peaks match the expectation" if not mismatches else "MISMATCHES:\n  " + "\n  ".join(mismatches))
    path = write("memory", {"size": size, "partition": args.partition, "variant": args.variant, "batch": args.batch,
                            "segments": args.segments, "results": results, "skipped": skipped,
                            "mismatches": mismatches}, quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
