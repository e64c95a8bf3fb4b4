"""Where the time of one stage-to-stage hop goes on Ray, split into its parts, and what the workers' priority costs.

    python -m benchmarks.hops [--quick] [--kib 16,512] [--count 200] [--rounds 2]

Ray starts its worker processes (the stage actors) at ``nice 15`` (``RAY_worker_niceness``); the driver,
the raylet and the GCS run at 0. On a machine whose cores are all busy the kernel then gives a stage
actor a small share of a core whenever a nice-0 process wants one. This benchmark measures each part of a
hop under Ray's default and with ``RAY_worker_niceness=0``, alternating the two ``--rounds`` times (one Ray
instance each), for each activation size:

* ``pickle``: pickling the tensor and back (Ray's cloudpickle), in the driver (no process boundary);
* ``put_get``: ``ray.put`` and ``ray.get`` in the driver (object store write and read);
* ``call``: an empty actor method call, driver -> actor -> driver;
* ``call_tensor``: the same call sending the tensor and getting it back;
* ``hop``: actor to actor, a chain of ``--count`` dependent calls alternating between 2 actors that
  each return a fresh tensor of the size (as a stage does); seconds per call;
* ``hop_busy``: the same chain while 2 processes at nice 0 keep both cores busy (what a training
  stage's neighbours and Ray's own threads are to it on a 2-core machine);
* ``compiled_hop``: the same hop inside a Ray Compiled Graph (``pipeline.transport=compiled``): a chain
  of ``echo`` calls between the 2 actors over shared-memory channels, no task per call;
* ``p2p_hop``: the hop of ``pipeline.transport=p2p``: rayspec's message (header and bytes in one buffer)
  from actor to actor over their gloo group, timed inside the actors (ping-pong);
* ``gloo_in_actors``: torch's gloo ``send``/``recv`` of one buffer between the same 2 actors (the reference
  for ``p2p_hop``: what rayspec's message adds to a gloo message, in the same processes);
* ``ray_cpu_per_hop``: CPU seconds that all of Ray's processes (raylet, GCS, the two actors, ...) and
  the driver spend per hop of the chain (2 cores give at most 2 CPU seconds per second);
* torch ``dist.send``/``recv`` over gloo between 2 plain processes (nice 0), one way: the data path of
  ``torch.distributed.pipelining``.

Figures are medians over rounds, in ms; the ratios are of figures measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import ray
import torch

from benchmarks._shared.one_hop import compiled_hop_s, p2p_hop_s
from benchmarks._shared.peer_setup import PeerConfig, build_parts
from benchmarks._shared.processes import process_cpu_s, process_tree, ray_system_pids, self_cpu_s
from benchmarks._shared.results import table, write
from benchmarks._shared.torch_peer import TorchPeer


@ray.remote(num_cpus=0.01)
class Hop:
    def __init__(self, numel: int) -> None:
        self.numel = numel

    def niceness(self) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    def noop(self) -> None:
        return None

    def echo(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def fwd(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty(self.numel).copy_(x)  # a fresh activation of the same size, as a stage returns


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _per_call(fn: Any, count: int) -> float:
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(count):
        fn()
    return (time.perf_counter() - t0) / count


def _chain(actors: list, x: torch.Tensor, count: int) -> float:
    ref: Any = x
    t0 = time.perf_counter()
    for i in range(count):
        ref = actors[i % 2].fwd.remote(ref)
    ray.get(ref)
    return (time.perf_counter() - t0) / count


def measure_ray(niceness: int | None, sizes: list[int], count: int) -> dict[str, Any]:
    """One Ray instance (workers at Ray's default niceness if ``None``): every part for every size, ms."""
    import multiprocessing as mp

    if niceness is None:
        os.environ.pop("RAY_worker_niceness", None)
    else:
        os.environ["RAY_worker_niceness"] = str(niceness)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}})
    try:
        out: dict[str, Any] = {"sizes": {}}
        for kib in sizes:
            numel = kib * 1024 // 4
            x = torch.randn(numel)
            actors = [Hop.remote(numel) for _ in range(2)]
            out["actor_niceness"] = ray.get(actors[0].niceness.remote())
            ray.get([a.noop.remote() for a in actors])
            row = {
                "pickle": _per_call(lambda x=x: ray.cloudpickle.loads(ray.cloudpickle.dumps(x)), count),
                "put_get": _per_call(lambda x=x: ray.get(ray.put(x)), count),
                "call": _per_call(lambda a=actors[0]: ray.get(a.noop.remote()), count),
                "call_tensor": _per_call(lambda a=actors[0], x=x: ray.get(a.echo.remote(x)), count),
            }
            _chain(actors, x, 10)
            system = process_tree(ray_system_pids())  # GCS, raylet and their children: the two actors too
            cpu0 = sum(process_cpu_s(p) for p in system) + self_cpu_s()
            row["hop"] = _chain(actors, x, count)
            cpu1 = sum(process_cpu_s(p) for p in system) + self_cpu_s()
            row["ray_cpu_per_hop"] = (cpu1 - cpu0) / count
            spinners = [mp.get_context("fork").Process(target=_spin, args=(60.0,), daemon=True) for _ in range(2)]
            for p in spinners:
                p.start()
            try:
                row["hop_busy"] = _chain(actors, x, max(20, count // 4))
            finally:
                for p in spinners:
                    p.kill()
                    p.join()
            row["compiled_hop"] = compiled_hop_s(actors, (numel,), max(10, min(count, 50)))
            row["p2p_hop"] = p2p_hop_s((numel,), count)
            row["gloo_in_actors"] = p2p_hop_s((numel,), count, plain=True)
            out["sizes"][kib] = {k: v * 1e3 for k, v in row.items()}
            for a in actors:
                ray.kill(a)
        return out
    finally:
        ray.shutdown()


def measure_torch(sizes: list[int], count: int) -> dict[int, float]:
    """One-way ms of a tensor over gloo ``send``/``recv`` between 2 processes, per size in KiB."""
    cfg = PeerConfig(model="mlp", size="tiny", batch=16, microbatches=2, pool=1)
    parts, _ = build_parts(cfg)
    with TorchPeer(parts, cfg) as peer:
        return {kib: peer.hop_s((kib * 1024 // 4,), count) * 1e3 for kib in sizes}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kib", default="16,512", help="activation sizes in KiB")
    ap.add_argument("--count", type=int, default=200, help="calls per measurement")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two niceness settings")
    ap.add_argument("--quick", action="store_true", help="1 round of 20 calls (a smoke test of this script)")
    args = ap.parse_args(argv)
    sizes = [int(v) for v in args.kib.split(",")]
    count, rounds = (20, 1) if args.quick else (args.count, args.rounds)
    runs: dict[str, list[dict[str, Any]]] = {"default": [], "nice0": []}
    torch_ms: list[dict[int, float]] = []
    for _ in range(rounds):
        runs["default"].append(measure_ray(None, sizes, count))
        runs["nice0"].append(measure_ray(0, sizes, count))
        torch_ms.append(measure_torch(sizes, count))
    parts = ["pickle", "put_get", "call", "call_tensor", "hop", "hop_busy", "compiled_hop", "p2p_hop", "gloo_in_actors",
             "ray_cpu_per_hop"]
    rows = []
    for kib in sizes:
        torch_hop = statistics.median(t[kib] for t in torch_ms)
        for name, measured in runs.items():
            row: dict[str, Any] = {"kib": kib, "workers": f"{name} (nice {measured[0]['actor_niceness']})"}
            for part in parts:
                row[part] = round(statistics.median(m["sizes"][kib][part] for m in measured), 3)
            row["torch_gloo_hop"] = round(torch_hop, 3)
            row["hop_over_torch"] = round(row["hop"] / torch_hop, 1)
            row["compiled_over_torch"] = round(row["compiled_hop"] / torch_hop, 1)
            row["p2p_over_torch"] = round(row["p2p_hop"] / torch_hop, 2)
            row["p2p_over_gloo_in_actors"] = round(row["p2p_hop"] / row["gloo_in_actors"], 2)
            row["busy_over_idle"] = round(row["hop_busy"] / row["hop"], 2)
            rows.append(row)
    print(table(rows, ["kib", "workers", *parts, "torch_gloo_hop", "hop_over_torch", "compiled_over_torch",
                       "p2p_over_torch", "p2p_over_gloo_in_actors", "busy_over_idle"]))
    print(f"wrote {write('hops', {'count': count, 'rounds': rounds, 'unit': 'ms', 'rows': rows}, quick=args.quick)}")


if __name__ == "__main__":
    main()
