"""Bytes moved per optimizer update: pipelined model parallelism (MP) against data parallelism (DP).

    python -m benchmarks.communication [--quick] [--models a,b] [--stages 2,4] [--partition uniform]
                                       [--count-batch 2] [--updates 2] [--no-ray]

Every paper model (vgg16, resnet152, inception_v4 and snn on CIFAR-like ``(3, 32, 32)`` images,
10 classes; transformer and residual_lstm on 256-token sequences, vocabulary 20000, 2 classes) and
the authors' extra CNNs (resnet50, densenet121, googlenet), at the paper's batch: 128 images or
256 sequences per update. ``--quick`` builds the ``tiny`` sizes instead of ``full``.

Definitions, per optimizer update (one batch), N stages or N workers, P trainable float32 parameters:

* **MP, analytic**: the sum over the N-1 stage boundaries of the bytes of the activation crossing it
  forward (every tensor of a tuple activation, integer ids and boolean masks included) plus the bytes
  of its gradient crossing it backward (only the floating-point tensors: integer tensors get no
  gradient, exactly as ``rayspec.core.stage.Stage`` makes float inputs require grad and sends their
  ``.grad``). Obtained by running the blocks on PyTorch's ``meta`` device (shapes and dtypes, no
  arithmetic), at the paper batch and at the counting batch. This is the total over all devices.
* **MP, counted**: the model split into the same stages, run through the real ``Stage`` objects and
  ``LocalExecutor`` (``spectrain``, 1F1B, ``--updates`` updates) at ``--count-batch`` samples per update
  (a full model's step at batch 128 would take minutes on a small CPU), reading each stage's
  ``stats.sent_bytes`` (``F``: activation to the next stage, ``B``: input gradient to the previous one).
  Asserted equal, boundary by boundary, to the analytic volume at that batch; the activation volume is
  linear in the batch, so the paper-batch figure is the analytic one. Unless ``--no-ray``, one model
  (the transformer, whose activations carry a boolean mask) is also counted through ``RayExecutor``:
  the counters are the same on the Ray transport.
* **DP**: a ring all-reduce sends ``2 (N-1)/N * P * 4`` bytes per worker per update (reduce-scatter plus
  all-gather), ``2 (N-1) * P * 4`` in total over the N workers. What rayspec's data-parallel counter
  measures (``summary["bytes_per_update"]`` of ``pipeline.method=dataparallel``) is the gradient buffer
  handed to all-reduce, ``P * 4`` per worker per update; unless ``--no-ray`` that is checked on a tiny MLP
  with 2 Ray Train workers through ``rayspec.training.train``.
* **Ratio** ``DP/MP`` = DP total (ring, all workers) / MP total (all boundaries, both directions): how
  many times more bytes data parallelism moves per update than model parallelism on the same N devices.

The partition is ``--partition``: ``uniform`` (the pipeline's default, equal block counts) or
``parameters`` (``rayspec.partition.by_parameters``); the result file holds the analytic volume of
both. Results: ``benchmarks/results/communication.json``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from benchmarks._shared.models import build
from benchmarks._shared.processes import start_ray
from benchmarks._shared.results import table, write
from rayspec.core.activations import activation_bytes
from rayspec.core.methods import METHODS
from rayspec.core.optim import OptimSpec
from rayspec.core.schedule import build_schedule
from rayspec.core.stage import make_stages
from rayspec.core.stage_spec import StageSpec
from rayspec.data import DataInfo
from rayspec.exec import LocalExecutor
from rayspec.models import MODELS, ModelError
from rayspec.partition import by_parameters, human_bytes, split, uniform

BATCH = {"image": 128, "text": 256}  # the paper's batch per update: CIFAR-10 128, IMDb 256
PAPER_MODELS = ("vgg16", "resnet152", "inception_v4", "snn", "transformer", "residual_lstm")
EXTRA_MODELS = ("resnet50", "densenet121", "googlenet")  # run by the authors' public code
COUNT_METHODS = ("vanilla", "async", "pipedream", "spectrain")  # one micro-batch per update
PARTITION_CHOICES = ("uniform", "parameters")


def example_batch(info: DataInfo, batch: int, seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of inputs and labels shaped as ``info`` describes: normal images, or token ids with padding.

    On ``device="meta"`` only shapes and dtypes exist (the values are never used).
    """
    if device == "meta":
        dtype = torch.float32 if info.kind == "image" else torch.int64
        return (torch.empty(batch, *info.input_shape, dtype=dtype, device="meta"),
                torch.empty(batch, dtype=torch.int64, device="meta"))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, info.num_classes, (batch,), generator=g)
    if info.kind == "image":
        return torch.randn(batch, *info.input_shape, generator=g), labels
    if not info.vocab_size:
        raise ModelError(f"a text batch needs DataInfo.vocab_size, got {info.vocab_size}; describe the vocabulary")
    ids = torch.randint(1, info.vocab_size, (batch, *info.input_shape), generator=g)
    length = ids.shape[-1]
    keep = torch.randint(length // 4, length + 1, (batch, 1), generator=g)
    return ids * (torch.arange(length) < keep), labels  # right padding (id 0), as the text loaders pad


def _tensors(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in (x if isinstance(x, (tuple, list)) else (x,)) if isinstance(t, torch.Tensor))


def block_bytes(model: nn.Sequential, info: DataInfo, batch: int) -> list[dict[str, int]]:
    """Bytes each block's output would move across a stage boundary after it, for one batch.

    Runs a copy of the model on the ``meta`` device: no arithmetic, no memory.

    Returns:
        Per block, ``{"F": bytes of every output tensor, "B": bytes of the floating-point ones}``
        (the gradient that comes back; integer tensors get none).
    """
    meta = copy.deepcopy(model).to("meta")
    x: Any = example_batch(info, batch, device="meta")[0]
    out = []
    with torch.no_grad():
        for block in meta:
            x = block(x)
            tensors = _tensors(x)
            out.append({"F": activation_bytes(tensors), "B": activation_bytes([t for t in tensors if t.is_floating_point()])})
    return out


def boundaries(blocks: Sequence[dict[str, int]], balance: Sequence[int]) -> list[dict[str, int]]:
    """The ``N - 1`` boundary volumes of a partition: the output of each stage's last block but the final stage's."""
    cuts, end = [], 0
    for count in balance[:-1]:
        end += count
        cuts.append(dict(blocks[end - 1]))
    return cuts


def mp_total(cuts: Sequence[dict[str, int]]) -> int:
    """MP bytes per update over all boundaries, forward and backward."""
    return sum(c["F"] + c["B"] for c in cuts)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the trainable parameters: the gradient DP all-reduces per update (``P * 4`` in float32)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def dp_bytes(param_bytes: int, workers: int) -> dict[str, float]:
    """Ring all-reduce volumes per update: per worker and in total, and the buffer handed to all-reduce."""
    per_worker = 2 * (workers - 1) / workers * param_bytes
    return {"allreduce_buffer_per_worker": param_bytes, "ring_per_worker": per_worker,
            "ring_total": workers * per_worker}


def partition(model: nn.Sequential, stages: int, how: str) -> list[int]:
    """Block counts per stage: ``uniform`` or ``parameters`` (min-max parameter count)."""
    if how == "uniform":
        return uniform(len(model), stages)
    if how == "parameters":
        return by_parameters(model, stages)
    raise ValueError(f"partition={how!r} is unknown; choose one of {', '.join(PARTITION_CHOICES)}")


def count_bytes(model: nn.Sequential, info: DataInfo, batch: int, balance: Sequence[int], *, updates: int = 2,
                method: str = "spectrain", executor: str = "local", cpus_per_stage: float = 0.5,
                seed: int = 0) -> list[dict[str, int]]:
    """Run ``updates`` updates through real stages and return each stage's ``sent_bytes`` per update.

    Args:
        model: the whole model (copied, not changed).
        info: what its data looks like.
        batch: samples per update (one micro-batch per update).
        balance: block counts per stage.
        updates: updates to run; the counters are divided by it.
        method: a method with one micro-batch per update (``COUNT_METHODS``).
        executor: ``local`` (``LocalExecutor``) or ``ray`` (``RayExecutor``; Ray must be running).
        cpus_per_stage: CPUs per stage actor on Ray.
        seed: of the random batches and the stages' random streams.

    Returns:
        Per stage, ``{"F": bytes sent to the next stage, "B": bytes sent to the previous one}`` per update.
    """
    if method not in COUNT_METHODS:
        raise ValueError(f"method={method!r} does not run one micro-batch per update; choose one of "
                         f"{', '.join(COUNT_METHODS)}")
    parts = split(copy.deepcopy(model), balance)
    n = len(parts)
    stages = make_stages(parts, method, StageSpec(lr=0.01, optim=OptimSpec(momentum=0.9), seed=seed))
    schedule = build_schedule(METHODS[method].schedule, n, updates)
    batches = [example_batch(info, batch, seed + i) for i in range(updates)]
    if executor == "local":
        runner: Any = LocalExecutor(stages, method)
    elif executor == "ray":
        from rayspec.exec.ray import RayExecutor

        runner = RayExecutor(stages, method, transport="object_store", cpus_per_stage=cpus_per_stage)
    else:
        raise ValueError(f"executor={executor!r} is unknown; choose local or ray")
    with runner:
        runner.run(schedule, batches)
        stats = runner.stage_stats()
    out = []
    for st in stats:
        sent = st["sent_bytes"]
        if sent["F"] % updates or sent["B"] % updates:
            raise AssertionError(f"stage {st['stage']} sent {sent} over {updates} updates: not the same every update")
        out.append({"F": sent["F"] // updates, "B": sent["B"] // updates})
    return out


def check_counted(counted: Sequence[dict[str, int]], cuts: Sequence[dict[str, int]], what: str) -> None:
    """Stage ``k`` sends boundary ``k``'s activation forward and stage ``k + 1`` its gradient back; nothing else.

    Raises:
        AssertionError: naming the first stage and direction where the counters and the analytic volume differ.
    """
    n = len(counted)
    expect = [{"F": cuts[k]["F"] if k < n - 1 else 0, "B": cuts[k - 1]["B"] if k > 0 else 0} for k in range(n)]
    for k, (got, want) in enumerate(zip(counted, expect)):
        if got != want:
            raise AssertionError(f"{what}: stage {k} counted {got} bytes per update but the analytic volume is {want}")


def dp_counted(updates: int = 3) -> dict[str, Any]:
    """Train a tiny MLP with 2 data-parallel Ray Train workers; return its all-reduce counters against ``P * 4``."""
    from rayspec.config import from_mapping
    from rayspec.config.compose import compose
    from rayspec.training import run_training
    from rayspec.training.prepare import prepare

    overrides = ["pipeline.method=dataparallel", "model=mlp", "model.size=tiny", "pipeline.stages=2",
                 f"train.max_steps={updates}", f"train.log_every={updates}", "train.batch_size=64",
                 "data.train_size=256", "data.val_size=64", "train.eval_every=0"]
    config = from_mapping(compose(overrides))
    expected = parameter_bytes(prepare(config).model)
    with tempfile.TemporaryDirectory() as run_dir:
        summary = run_training(config, run_dir)
    per_worker = [st["sent_bytes"]["allreduce"] / updates for st in summary["stage_stats"]]
    if summary["bytes_per_update"] != expected or any(b != expected for b in per_worker):
        raise AssertionError(f"dataparallel counted {summary['bytes_per_update']} bytes per update "
                             f"(workers: {per_worker}) but P * 4 = {expected}")
    return {"model": "mlp", "size": "tiny", "workers": 2, "updates": updates, "param_bytes": expected,
            "counted_bytes_per_update": summary["bytes_per_update"], "counted_per_worker": per_worker}


def run_model(name: str, size: str, stage_counts: Sequence[int], how: str, count_batch: int, updates: int) -> dict:
    """Analytic and counted MP volumes and the DP volumes of one model at every stage count."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, info = build(name, size)
    batch = BATCH[info.kind]
    blocks = block_bytes(model, info, batch)
    small = block_bytes(model, info, count_batch)
    params = parameter_bytes(model)
    result: dict[str, Any] = {"model": name, "size": size, "kind": info.kind, "batch": batch,
                              "input_shape": list(info.input_shape), "blocks": len(model),
                              "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                              "param_bytes": params, "block_bytes": blocks, "count_batch": count_batch, "stages": {}}
    for n in stage_counts:
        if n > len(model):
            print(f"  {name}: {n} stages skipped, the model has {len(model)} blocks")
            continue
        balances = {p: partition(model, n, p) for p in PARTITION_CHOICES}
        balance = balances[how]
        cuts = boundaries(blocks, balance)
        counted = count_bytes(model, info, count_batch, balance, updates=updates)
        check_counted(counted, boundaries(small, balance), f"{name} N={n}")
        mp = mp_total(cuts)
        dp = dp_bytes(params, n)
        result["stages"][str(n)] = {
            "partition": how, "balance": balance, "boundaries": cuts, "mp_bytes_per_update": mp,
            "mp_counted_per_update_at_count_batch": sum(c["F"] + c["B"] for c in counted),
            "mp_analytic_per_update_at_count_batch": mp_total(boundaries(small, balance)),
            "mp_counted_per_stage_at_count_batch": counted,
            "mp_bytes_per_update_by_partition": {p: mp_total(boundaries(blocks, b)) for p, b in balances.items()},
            "balance_by_partition": balances,
            **{f"dp_{k}": v for k, v in dp.items()},
            "ratio_dp_over_mp": dp["ring_total"] / mp,
        }
    result["seconds"] = time.perf_counter() - t0
    return result


def ray_check(size: str, count_batch: int, updates: int, how: str) -> dict[str, Any]:
    """The transformer on 2 stage actors: ``RayExecutor``'s counters equal ``LocalExecutor``'s and the analytic ones."""
    torch.manual_seed(0)
    model, info = build("transformer", size)
    balance = partition(model, 2, how)
    cuts = boundaries(block_bytes(model, info, count_batch), balance)
    on_ray = count_bytes(model, info, count_batch, balance, updates=updates, executor="ray", cpus_per_stage=0.5)
    local = count_bytes(model, info, count_batch, balance, updates=updates)
    check_counted(on_ray, cuts, "transformer N=2 on RayExecutor")
    if on_ray != local:
        raise AssertionError(f"RayExecutor counted {on_ray} but LocalExecutor {local}")
    return {"model": "transformer", "size": size, "stages": 2, "balance": balance, "batch": count_batch,
            "ray_per_stage": on_ray, "local_per_stage": local, "analytic_boundaries": cuts}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model sizes instead of full")
    ap.add_argument("--models", default="", help="comma-separated model names (default: the paper's and the extras)")
    ap.add_argument("--size", default=None, help="model size (default full; tiny with --quick)")
    ap.add_argument("--stages", default="2,4", help="comma-separated stage / worker counts")
    ap.add_argument("--partition", default="uniform", choices=PARTITION_CHOICES)
    ap.add_argument("--count-batch", type=int, default=2, help="samples per update of the counted runs")
    ap.add_argument("--updates", type=int, default=2, help="updates of each counted run")
    ap.add_argument("--no-ray", action="store_true", help="skip the RayExecutor and Ray Train checks")
    args = ap.parse_args(argv)
    size = args.size or ("tiny" if args.quick else "full")
    names = [n for n in args.models.split(",") if n] or [*PAPER_MODELS, *EXTRA_MODELS]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: {', '.join(unknown)} not registered; choose from {', '.join(sorted(MODELS))}")
    try:
        stage_counts = [int(s) for s in args.stages.split(",") if s]
    except ValueError:
        ap.error(f"--stages={args.stages!r} must be comma-separated integers, e.g. --stages 2,4")
    if not stage_counts or min(stage_counts) < 2:
        ap.error(f"--stages={args.stages!r} needs counts >= 2: one device has no boundary and no all-reduce")
    if args.count_batch < 2 or args.updates < 1:
        ap.error(f"--count-batch={args.count_batch} must be >= 2 (BatchNorm needs two samples) and "
                 f"--updates={args.updates} >= 1")

    results, skipped = [], {}
    for name in names:
        try:
            r = run_model(name, size, stage_counts, args.partition, args.count_batch, args.updates)
        except ModelError as err:
            skipped[name] = str(err)
            print(f"{name}: skipped: {err}")
            continue
        results.append(r)
        print(f"{name} ({size}, {r['blocks']} blocks): counted = analytic at batch {args.count_batch} for N = "
              f"{', '.join(r['stages'])} ({r['seconds']:.1f} s)", flush=True)

    checks: dict[str, Any] = {}
    if not args.no_ray:
        import ray

        start_ray()
        try:
            checks["ray_executor"] = ray_check(size, args.count_batch, args.updates, args.partition)
            print(f"RayExecutor: transformer ({size}) on 2 stage actors counted {checks['ray_executor']['ray_per_stage']}"
                  " bytes per update per stage, equal to LocalExecutor and the analytic volume")
            checks["dataparallel"] = dp_counted()
            print(f"dataparallel: mlp (tiny) on 2 Ray Train workers all-reduced "
                  f"{checks['dataparallel']['counted_bytes_per_update']:.0f} bytes per worker per update = P * 4")
        finally:
            ray.shutdown()

    other = next(p for p in PARTITION_CHOICES if p != args.partition)

    def ratio(value: float) -> str:
        return f"{value:.1f}x" if value >= 10 else f"{value:.2f}x"

    rows = []
    for r in results:
        for n, s in r["stages"].items():
            rows.append({
                "model": r["model"] + ("" if r["model"] in PAPER_MODELS else "*"), "N": n,
                "params": f"{r['parameters'] / 1e6:.2f}M", "balance": str(s["balance"]),
                "MP total": human_bytes(s["mp_bytes_per_update"]),
                f"counted@{args.count_batch}": human_bytes(s["mp_counted_per_update_at_count_batch"]),
                "DP P*4/worker": human_bytes(s["dp_allreduce_buffer_per_worker"]),
                "DP ring/worker": human_bytes(s["dp_ring_per_worker"]),
                "DP ring total": human_bytes(s["dp_ring_total"]),
                "DP/MP": ratio(s["ratio_dp_over_mp"]),
                f"DP/MP {other}": ratio(s["dp_ring_total"] / s["mp_bytes_per_update_by_partition"][other]),
            })
    means: dict[str, dict[str, dict[str, float]]] = {}  # models -> mean kind -> N -> ratio
    for label, pool in (("paper", PAPER_MODELS), ("all", None)):
        for n in stage_counts:
            ratios = [r["stages"][str(n)]["ratio_dp_over_mp"] for r in results
                      if str(n) in r["stages"] and (pool is None or r["model"] in pool)]
            if ratios:
                by_kind = means.setdefault(label, {"arithmetic": {}, "geometric": {}})
                by_kind["arithmetic"][str(n)] = statistics.mean(ratios)
                by_kind["geometric"][str(n)] = statistics.geometric_mean(ratios)
    if rows:
        print(f"\nBytes per update ({size} models; batch 128 images / 256 sequences; {args.partition} partition). "
              "MP total = sum over stage boundaries of activation (F) + its gradient (B); "
              f"counted@{args.count_batch} = the stages' counters at batch {args.count_batch} (= analytic). "
              "DP: P*4 = gradient bytes handed to all-reduce per worker; ring = 2(N-1)/N * P*4 sent per worker, "
              f"total = N times that. DP/MP = DP ring total / MP total; DP/MP {other} = the same with the {other} "
              "partition. * = not in the paper.")
        print(table(rows, list(rows[0])))
        for label, by_kind in means.items():
            print(f"DP/MP over {'the paper models' if label == 'paper' else 'all models'}: " + "; ".join(
                f"{kind} mean " + ", ".join(f"N={n} {ratio(v)}" for n, v in by_n.items())
                for kind, by_n in by_kind.items()))
    path = write("communication", {
        "size": size, "partition": args.partition, "batch": BATCH, "count_batch": args.count_batch,
        "updates": args.updates, "count_method": "spectrain",
        "definitions": {
            "mp_bytes_per_update": "sum over the N-1 stage boundaries of forward activation bytes (all tensors) "
                                   "plus backward gradient bytes (floating-point tensors), one batch, all devices",
            "dp_allreduce_buffer_per_worker": "P * 4: gradient bytes handed to all-reduce per worker per update "
                                              "(what summary['bytes_per_update'] of dataparallel counts)",
            "dp_ring_per_worker": "2 (N-1)/N * P * 4: bytes a ring all-reduce sends per worker per update",
            "dp_ring_total": "2 (N-1) * P * 4: ring all-reduce bytes per update over all N workers",
            "ratio_dp_over_mp": "dp_ring_total / mp_bytes_per_update",
        },
        "models": results, "mean_ratio_dp_over_mp": means, "checks": checks, "skipped": skipped,
    }, quick=args.quick)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
