"""Peer comparison: rayspec on Ray against ``torch.distributed.pipelining`` on the same 2-stage split.

    python -m benchmarks.peer [--quick] [--model mlp] [--size full] [--batch 256] [--microbatches 8]
                              [--steps 20] [--pairs 7] [--microbatch-size B] [--transports p2p,compiled,object_store]

The model (default: the ``full`` MLP, 8 hidden 1024-wide blocks, on ``(3, 32, 32)`` images) is cut
into 2 stages by parameters; both sides start from the same weights, see the same batches
(``--batch`` samples in ``--microbatches`` micro-batches) and use SGD with the same lr and
momentum, 1 torch thread per stage process and nothing else of theirs running.

* torch: 2 processes (``torch.multiprocessing``, spawn), gloo, ``PipelineStage`` +
  ``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleavedZeroBubble`` (one stage per rank),
  ``torch.optim.SGD``, one ``step`` + ``opt.step()`` per batch. All torch schedules are *flushed*:
  every batch fills and drains the pipeline and applies one synchronous update.
* rayspec: ``RayExecutor`` with 2 stage actors (``cpus_per_stage=1``) after
  ``ray.init(num_cpus=2)``, on each of ``--transports`` (``p2p``, ``compiled``, ``object_store``, ``gloo``), one ``run`` over all timed
  batches (as the trainer runs a segment). Runners:

  - ``gpipe``: fill-drain, one update per batch: like-for-like with ``ScheduleGPipe``.
  - ``1f1b``: ``pipeline.method=1f1b``, synchronous 1F1B flushed every batch
    (``build_schedule("1f1b-flushed", 2, M * batches, group=M)``): exactly torch's ``Schedule1F1B``
    order and semantics, so the like-for-like comparison for it. ``1f1b-flushed``, its former name,
    still selects it.
  - ``zb1p``: ``pipeline.method=zb1p``, ZB-H1 (the backward split into I and W, W deferred into the
    drain's bubble), flushed every batch: torch's ``ScheduleInterleavedZeroBubble`` order with one
    stage per rank; runs on the ``p2p`` transports only (the others refuse a split backward).
  - ``interleaved``: ``pipeline.method=interleaved`` with 2 model chunks per stage actor (the model cut into 4 by
    parameters, actor r holding chunks r and r + 2), flushed every batch: torch's ``ScheduleInterleaved1F1B`` with
    the same 4 chunks, 2 ``PipelineStage`` objects per rank; ``p2p`` transports only (on the others its row holds
    the refusal, as does any runner a transport cannot run).
  - ``spectrain``: asynchronous 1F1B with weight prediction, one update per micro-batch
    (``M`` updates per batch) and no flush between batches: rayspec's method, not
    like-for-like (different optimisation, no bubble between batches, prediction work).
  - ``spectrain-grouped``: the same with ``pipeline.accumulate = M``: one update per batch of ``M``
    micro-batches, as torch, and 1F1B streaming on across batches (no flush); only the actions that
    straddle an update run at a stale or predicted version. Same updates, samples per update and
    kernels as torch's ``Schedule1F1B``; not like-for-like in the numbers (staleness at the seams).

Start-up is excluded: ``--warmup`` batches run on each side first. Each measurement of a rayspec
runner is paired with one of the matching torch schedule right before it (torch weights reset
to the same start first), so load drifts on a shared machine hit both alike; the ratio is the
median over pairs of ``torch seconds / rayspec seconds`` (= throughput rayspec / torch). For the
synchronous runners the per-batch losses of both sides are compared too (same numbers, up to
float summation order).

To explain gaps, the benchmark also measures: the compute of each stage alone (F and B of one
micro-batch at 1 thread; the ideal makespan of each schedule from it), and one hop of the
activation between two processes: torch ``dist.send``/``recv`` over gloo (ping-pong), and each
transport's hop between two Ray actors (``p2p``: rayspec's message over their gloo group; the others:
a chain of dependent actor calls, or of compiled-graph ops).

The findings, with the commands that made them: ``benchmarks/peer/README.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict

import torch
from torch import nn

from benchmarks._shared.one_hop import ray_hop_s
from benchmarks._shared.peer_setup import (
    IMAGE,
    LIKE_FOR_LIKE,
    NOT_ON_RAY,
    PEER_OF,
    RAYSPEC_RUNNERS,
    TORCH_SCHEDULES,
    PeerConfig,
    build_parts,
    chunks_per_rank,
    ideal_step_s,
    profile_stages,
    rayspec_schedule,
    runner_name,
)
from benchmarks._shared.processes import start_ray
from benchmarks._shared.rayspec_peer import RayspecRunner
from benchmarks._shared.results import table, write
from benchmarks._shared.torch_peer import TorchPeer
from benchmarks.peer import crossover
from rayspec.errors import RayspecError


# ----------------------------------------------------------------------------- the comparison
def compare(parts: Sequence[nn.Module], cfg: PeerConfig, peer: TorchPeer, runner: str, transport: str, *,
            steps: int, warmup: int, repeats: int, cpus_per_stage: float = 1.0) -> dict:
    """Pair ``repeats`` measurements of a rayspec runner with its torch schedule's; both start from the same weights.

    Returns:
        Throughputs, the median pair ratio, per-batch losses of both, and where the time goes:
        mean ms per F and B inside each stage on both sides and CPU ms per batch by process group.
    """
    runner = runner_name(runner)
    if runner in NOT_ON_RAY:
        return refused(parts, cfg, runner, transport, cpus_per_stage)
    torch_name = PEER_OF[runner]
    peer.reset(torch_name)
    try:
        ours = RayspecRunner(parts, cfg, runner, transport, cpus_per_stage)
    except RayspecError as e:  # e.g. model chunks per actor on a transport whose actors host one stage
        return _refusal(runner, transport, e)
    try:
        _, tl = peer.steps(torch_name, warmup)
        try:
            _, rl = ours.steps(warmup)
        except RayspecError as e:  # e.g. a split backward on a transport that runs none
            return _refusal(runner, transport, e)
        before = ours.executor.stage_stats()
        t_times, r_times, t_losses, r_losses = [], [], list(tl), list(rl)
        t_cpu: list[dict[str, float]] = []
        r_cpu: list[dict[str, float]] = []
        t_busy: list[dict[tuple[int, str], float]] = []
        for _ in range(repeats):
            t, tl = peer.steps(torch_name, steps)
            t_cpu.append(peer.last_cpu_s)
            t_busy.append(peer.last_busy_s)
            r, rl = ours.steps(steps)
            r_cpu.append(ours.last_cpu_s)
            t_times.append(t)
            r_times.append(r)
            t_losses += tl
            r_losses += rl
        after = ours.executor.stage_stats()
    finally:
        ours.close()
    r_busy = {(a["stage"], kind): (a["busy_s"].get(kind, 0.0) - b["busy_s"].get(kind, 0.0))
              / max(1, a["actions"].get(kind, 0) - b["actions"].get(kind, 0))
              for a, b in zip(after, before) for kind in "FBIW"}
    batches = steps * repeats
    samples = steps * cfg.batch
    ratios = [t / r for t, r in zip(t_times, r_times)]
    synchronous = LIKE_FOR_LIKE[runner]
    return {
        "runner": runner, "transport": transport, "torch": torch_name, "like_for_like": synchronous,
        "torch_samples_per_s": samples / statistics.median(t_times),
        "rayspec_samples_per_s": samples / statistics.median(r_times),
        "ratio": statistics.median(ratios), "ratios": ratios,
        "torch_step_ms": statistics.median(t_times) / steps * 1e3,
        "rayspec_step_ms": statistics.median(r_times) / steps * 1e3,
        "torch_losses": t_losses, "rayspec_losses": r_losses,
        "losses_finite": all(math.isfinite(v) for v in t_losses + r_losses),
        # equal up to summation order when like-for-like; otherwise how far staleness moved the losses
        "max_loss_diff": max(abs(a - b) for a, b in zip(t_losses, r_losses)),
        "rayspec_busy_ms": {f"{k}{kind}": v * 1e3 for (k, kind), v in r_busy.items()},
        "torch_busy_ms": {f"{k}{kind}": statistics.mean(b[(k, kind)] for b in t_busy) * 1e3 for (k, kind) in r_busy},
        "torch_cpu_ms_per_batch": {k: sum(c[k] for c in t_cpu) / batches * 1e3 for k in t_cpu[0]},
        "rayspec_cpu_ms_per_batch": {k: sum(c[k] for c in r_cpu) / batches * 1e3 for k in r_cpu[0]},
    }


def refused(parts: Sequence[nn.Module], cfg: PeerConfig, runner: str, transport: str,
            cpus_per_stage: float = 1.0) -> dict:
    """The row of a runner the Ray executor refuses (``NOT_ON_RAY``): the refusal, in place of the figures."""
    try:
        ours = RayspecRunner(parts, cfg, runner, transport, cpus_per_stage)
    except RayspecError as e:
        return _refusal(runner, transport, e)
    try:
        ours.steps(1)
    except RayspecError as e:
        return _refusal(runner, transport, e)
    finally:
        ours.close()
    raise RuntimeError(f"runner {runner} ran on Ray: pair it with torch's {TORCH_SCHEDULES[PEER_OF[runner]]}")


def _refusal(runner: str, transport: str, error: Exception) -> dict:
    """A row that holds the refusal of a runner on a transport, in place of the figures."""
    return {"runner": runner, "transport": transport, "torch": PEER_OF[runner],
            "like_for_like": LIKE_FOR_LIKE[runner], "error": f"refused: {error}"}


def _crossover(parts: Sequence[nn.Module], cfg: PeerConfig, sizes: list[int], peer: TorchPeer,
               rows: list[dict]) -> dict:
    """The predicted crossover of spectrain per micro-batch against torch's 1F1B (``crossover.py``), printed beside
    the ratio measured at this run's micro-batch size."""
    costs = crossover.update_costs(parts, cfg, cfg.compile)
    b = cfg.batch // cfg.microbatches
    table_rows = crossover.predict(parts, cfg, sorted(set(sizes) | {b}), costs, peer.hop_s)
    measured = {r["transport"]: r["ratio"] for r in rows if r["runner"] == "spectrain"}
    for row in table_rows:
        row["measured_ratio"] = ", ".join(f"{t} {v:.2f}" for t, v in measured.items()) if row["microbatch_size"] == b \
            else "-"
    size = crossover.crossover(table_rows)
    print("\nspectrain per micro-batch against torch's Schedule1F1B, ms per batch predicted from the compute alone, "
          "the hop and the update (ratio: torch / spectrain; above 1 spectrain is faster):")
    print("update per micro-batch (step + prediction), ms: " + ", ".join(
        f"stage {k} {c['update'] * 1e3:.2f} (torch's step alone {c['step'] * 1e3:.2f})" for k, c in costs.items()))
    print(table(table_rows, list(table_rows[0])))
    print(f"predicted crossover: spectrain per micro-batch beats torch's 1F1B from micro-batch size {size} on"
          if size is not None else "predicted crossover: none among these sizes")
    return {"update_ms": {k: {n: v * 1e3 for n, v in c.items()} for k, c in costs.items()}, "rows": table_rows,
            "crossover_microbatch_size": size, "compiled": cfg.compile}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps, one pair per runner")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--size", default="full")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="timed batches per measurement")
    ap.add_argument("--warmup", type=int, default=2, help="untimed batches first, on each side")
    ap.add_argument("--pairs", "--repeats", dest="repeats", type=int, default=7,
                    help="torch/rayspec measurement pairs per runner; each ratio is printed with its median's spread "
                         "(half its 95 %% bootstrap interval), which says whether they sufficed")
    ap.add_argument("--microbatch-size", type=int, default=None,
                    help="samples per micro-batch (batch = this x microbatches; default: batch / microbatches)")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="rayspec without optim.compile (its predicting runners' update and prediction apart)")
    ap.add_argument("--crossover-sizes", default="8,16,32,64,128",
                    help="micro-batch sizes of the predicted crossover (spectrain against torch's 1F1B); empty: none")
    ap.add_argument("--transports", default="p2p,compiled,object_store")
    ap.add_argument("--runners", default=",".join(RAYSPEC_RUNNERS + NOT_ON_RAY),
                    help="rayspec runners (1f1b-flushed: the former name of 1f1b)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--worker-niceness", type=int, default=None,
                    help="RAY_worker_niceness of the Ray instance this starts (Ray's default: 15)")
    ap.add_argument("--out", default="peer", help="result name: benchmarks/results/OUT.json")
    args = ap.parse_args(argv)
    if args.worker_niceness is not None:
        os.environ["RAY_worker_niceness"] = str(args.worker_niceness)
    steps, repeats = (5, 1) if args.quick else (args.steps, args.repeats)
    batch = args.batch if args.microbatch_size is None else args.microbatch_size * args.microbatches
    cfg = PeerConfig(args.model, args.size, batch, args.microbatches, args.lr, args.momentum, compile=args.compile)
    runners = [runner_name(r) for r in args.runners.split(",") if r]
    transports = [t for t in args.transports.split(",") if t]
    torch.set_num_threads(1)
    parts, balance = build_parts(cfg)
    chunks, chunk_balance = build_parts(cfg, 4) if any(chunks_per_rank(r) > 1 for r in runners) else ([], [])
    m = cfg.microbatches
    mb_shape = (cfg.batch // m, *IMAGE.input_shape)
    act_shape = tuple(parts[0](torch.zeros(mb_shape)).shape)
    compute = profile_stages(parts, cfg)
    chunk_compute = profile_stages(chunks, cfg) if chunks else {}
    print(f"model {cfg.model} ({cfg.size}) split {balance}; batch {cfg.batch} in {m} micro-batches of {mb_shape[0]}; "
          f"activation {list(act_shape)} ({math.prod(act_shape) * 4 / 1024:.0f} KiB); {steps} steps x {repeats} pairs")
    print("compute alone, ms per micro-batch: " + ", ".join(f"stage {k} {kind} {v * 1e3:.2f}"
                                                            for (k, kind), v in compute.items()))
    import ray

    rows: list[dict] = []
    refusals: list[dict] = []
    hops: dict[str, float] = {}
    if chunks:
        print(f"interleaved: 4 chunks {chunk_balance}, rank r holding chunks r and r + 2; compute alone, ms: "
              + ", ".join(f"chunk {k} {kind} {v * 1e3:.2f}" for (k, kind), v in chunk_compute.items()))
    with TorchPeer(parts, cfg, chunks=chunks) as peer:
        hops["torch gloo send/recv"] = peer.hop_s(act_shape)
        start_ray(2)
        try:
            for transport in transports:
                hops[f"ray {transport}"] = ray_hop_s(transport, act_shape)
            for transport in transports:
                for runner in runners:
                    chunked = chunks_per_rank(runner) > 1
                    row = compare(chunks if chunked else parts, cfg, peer, runner, transport, steps=steps,
                                  warmup=args.warmup, repeats=repeats)
                    if "error" in row:
                        refusals.append(row)
                        print(f"  {runner} on {transport}: {row['error']}")
                        continue
                    durations = chunk_compute if chunked else compute
                    row["ideal_step_ms"] = ideal_step_s(runner, m, durations) * 1e3
                    row["torch_ideal_step_ms"] = ideal_step_s(row["torch"], m, durations) * 1e3
                    row["actions_per_batch"] = sum(len(a) for a in rayspec_schedule(runner, m, 1).actions)
                    row["median_spread"] = crossover.median_spread(row["ratios"])
                    rows.append(row)
                    print(f"  {runner} on {transport}: rayspec {row['rayspec_samples_per_s']:.0f} samples/s, "
                          f"torch {row['torch']} {row['torch_samples_per_s']:.0f}, ratio {row['ratio']:.2f} "
                          f"± {row['median_spread']:.2f}")
        finally:
            ray.shutdown()
        sizes = [int(b) for b in args.crossover_sizes.split(",") if b]
        predicted = _crossover(parts, cfg, sizes, peer, rows) if sizes else {}
    print("\nthroughput (samples/s; ratio = rayspec / torch, median over interleaved pairs ± half its 95 % bootstrap "
          "interval):")
    print(table([{
        "rayspec": r["runner"], "transport": r["transport"], "vs torch": r["torch"],
        "like-for-like": "yes" if r["like_for_like"] else "no",
        "rayspec s/s": f"{r['rayspec_samples_per_s']:.0f}", "torch s/s": f"{r['torch_samples_per_s']:.0f}",
        "ratio": f"{r['ratio']:.2f} ± {r['median_spread']:.2f}", "pairs": " ".join(f"{v:.2f}" for v in r["ratios"]),
        "max |loss diff|": "-" if r["max_loss_diff"] is None else f"{r['max_loss_diff']:.1e}",
    } for r in rows], ["rayspec", "transport", "vs torch", "like-for-like", "rayspec s/s", "torch s/s", "ratio",
                       "pairs", "max |loss diff|"]))
    for r in rows:  # the slower rank's busy time per batch (its chunks together), and the rest of the batch (waiting)
        for side in ("rayspec", "torch"):
            b = r[f"{side}_busy_ms"]
            r[f"{side}_bottleneck_busy_ms"] = max(m * sum(v for key, v in b.items() if int(key[:-1]) % 2 == rank)
                                                  for rank in range(2))
            r[f"{side}_idle_ms"] = r[f"{side}_step_ms"] - r[f"{side}_bottleneck_busy_ms"]
    print("\nwhere the time goes, ms per batch of M micro-batches (ideal: the schedule's makespan from the compute "
          "alone; eff = ideal / measured; busy: the slower stage's time inside its actions; idle = batch - busy):")
    print(table([{
        "runner": r["runner"], "transport": r["transport"], "ideal": f"{r['ideal_step_ms']:.0f}",
        "rayspec": f"{r['rayspec_step_ms']:.0f}", "eff": f"{r['ideal_step_ms'] / r['rayspec_step_ms']:.2f}",
        "busy": f"{r['rayspec_bottleneck_busy_ms']:.0f}", "idle": f"{r['rayspec_idle_ms']:.0f}",
        "torch ideal": f"{r['torch_ideal_step_ms']:.0f}", "torch": f"{r['torch_step_ms']:.0f}",
        "torch eff": f"{r['torch_ideal_step_ms'] / r['torch_step_ms']:.2f}",
        "torch busy": f"{r['torch_bottleneck_busy_ms']:.0f}", "torch idle": f"{r['torch_idle_ms']:.0f}",
        "extra/action": f"{(r['rayspec_step_ms'] - r['torch_step_ms']) / r['actions_per_batch']:.2f}",
        "cpu stages": f"{r['rayspec_cpu_ms_per_batch']['stages']:.0f}",
        "cpu driver": f"{r['rayspec_cpu_ms_per_batch']['driver']:.0f}",
        "cpu ray sys": f"{r['rayspec_cpu_ms_per_batch']['ray_system']:.0f}",
        "torch cpu": f"{r['torch_cpu_ms_per_batch']['ranks']:.0f}",
    } for r in rows], ["runner", "transport", "ideal", "rayspec", "eff", "busy", "idle", "torch ideal", "torch",
                       "torch eff", "torch busy", "torch idle", "extra/action", "cpu stages", "cpu driver",
                       "cpu ray sys", "torch cpu"]))
    print("(extra/action: rayspec minus torch ms per batch over the actions of a batch (4M, zb1p 6M); cpu: CPU ms per batch of "
          "rayspec's 2 stage actors, its driver and the rest of its Ray node, and of the 2 torch ranks; "
          "2 cores give 2 CPU ms per wall ms)")
    print("\nms inside a stage per action (rayspec: Stage.forward/backward/backward_input/backward_weight, optimizer "
          "step included; torch: PipelineStage.forward_one_chunk/backward_one_chunk/backward_weight_one_chunk; "
          "I and W: the backward split, zb1p):")
    keys = list(rows[0]["rayspec_busy_ms"]) if rows else []
    print(table([{"runner": "compute alone", "transport": "-",
                  **{k: f"{compute[(int(k[:-1]), k[-1])] * 1e3:.1f}" for k in keys if (int(k[:-1]), k[-1]) in compute}}]
                + [{"runner": f"rayspec {r['runner']}", "transport": r["transport"],
                    **{k: f"{r['rayspec_busy_ms'][k]:.1f}" for k in keys}} for r in rows]
                + [{"runner": f"torch {r['torch']}", "transport": f"(paired with {r['runner']}/{r['transport']})",
                    **{k: f"{r['torch_busy_ms'][k]:.1f}" for k in keys}} for r in rows],
                ["runner", "transport", *keys]))
    print("\none hop of the activation, ms: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in hops.items()))
    path = write(args.out, {"config": asdict(cfg), "worker_niceness": os.environ.get("RAY_worker_niceness", "15"), "balance": balance,
                          "chunk_balance": chunk_balance, "chunk_compute_ms": {f"{k}{kind}": v * 1e3
                                                                               for (k, kind), v in chunk_compute.items()},
                          "steps": steps, "warmup": args.warmup,
                          "repeats": repeats, "activation_shape": list(act_shape),
                          "compute_ms": {f"{k}{kind}": v * 1e3 for (k, kind), v in compute.items()},
                          "hop_ms": {k: v * 1e3 for k, v in hops.items()}, "rows": rows, "refused": refusals,
                          "crossover": predicted},
                  quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
