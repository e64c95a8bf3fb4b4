"""One stage-to-stage hop between two Ray actors, per transport: seconds per hop of a chain of dependent calls
(``object_store``, RDT), of compiled-graph ops (``compiled``), or of ``p2p`` messages over a gloo group."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ray_hop_s", "p2p_hop_s", "compiled_hop_s", "gloo_pingpong_s"]


def ray_hop_s(transport: str, shape: tuple[int, ...], count: int = 50) -> float:
    """Seconds per hop of a chain of ``count`` dependent calls alternating between 2 actors, each returning a fresh tensor.

    Each call receives the previous call's tensor and returns a fresh one of the same shape,
    like an activation going from stage to stage (submitted by the driver, as ``RayExecutor`` does).
    """
    import ray

    @ray.remote(enable_tensor_transport=True)  # type: ignore[call-overload]
    class Hop:
        def __init__(self) -> None:
            torch.set_num_threads(1)
            warnings.filterwarnings("ignore", message="Zero-copy tensor serialization is enabled")

        def echo(self, x: torch.Tensor) -> torch.Tensor:
            return x + 0.0

        def total(self, x: torch.Tensor) -> float:
            return float(x.sum())

    if transport == "p2p":
        return p2p_hop_s(shape, count)
    env = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}} if transport == "object_store" else None
    actors = [Hop.options(num_cpus=0.5, runtime_env=env).remote() for _ in range(2)]  # type: ignore[attr-defined]
    try:
        ray.get([a.total.remote(torch.zeros(1)) for a in actors])
        if transport == "compiled":
            return compiled_hop_s(actors, shape, count)
        if transport != "object_store":
            from ray.experimental.collective import create_collective_group

            create_collective_group(actors, backend=transport)

        def chain(n: int) -> float:
            x = torch.randn(shape)
            t0 = time.perf_counter()
            r: Any = x
            for i in range(n):
                call = actors[i % 2].echo
                r = (call.options(tensor_transport=transport) if transport != "object_store" else call).remote(r)
            ray.get(actors[n % 2].total.remote(r))
            return time.perf_counter() - t0

        chain(5)
        # The chain's fixed cost (first submission, last fetch) cancels in the difference of two lengths.
        per_hop = (chain(count) - chain(count // 5)) / (count - count // 5)
        ray.get([a.total.remote(torch.zeros(1)) for a in actors])
        time.sleep(1.0)  # let Ray's RDT monitor see the last transfers complete before the actors go
        return per_hop
    finally:
        for a in actors:
            ray.kill(a)


def p2p_hop_s(shape: tuple[int, ...], count: int = 50, plain: bool = False) -> float:
    """One-way seconds of a tensor between 2 Ray actors on ``pipeline.transport=p2p``'s data path: rayspec's
    message (its header and bytes) over their gloo group, ping-pong timed inside the actors; ``plain``: torch's
    gloo ``send``/``recv`` of one buffer between the same two actors instead (what the message adds is the
    difference, Ray's processes and their priority left out)."""
    import ray

    from rayspec.exec.ray.p2p import P2PEndpoint

    @ray.remote(num_cpus=0.5)
    class P2PHop:
        def __init__(self) -> None:
            torch.set_num_threads(1)
            self.p2p = P2PEndpoint(None)  # type: ignore[arg-type]  # sends and receives only: no stage

        def rendezvous(self, world: int, timeout_s: float) -> tuple[str, int]:
            return self.p2p.rendezvous(world, timeout_s)

        def join(self, address: str, port: int, rank: int, world: int, timeout_s: float) -> None:
            self.p2p.join(address, port, rank, world, timeout_s)

        def pingpong(self, rank: int, n: int) -> float:
            x = torch.randn(shape)
            t0 = time.perf_counter()
            if plain:  # as benchmarks._shared.torch_peer times torch's hop
                return gloo_pingpong_s(x, rank, n)
            for i in range(n):
                if rank == 0:
                    self.p2p.send(x, 1, 2 * i)
                    x = self.p2p.recv(1, 2 * i + 1)
                    self.p2p.wait_sends([(1, 2 * i)])  # its reply proves it through, as in a pipeline
                else:
                    x = self.p2p.recv(0, 2 * i)
                    if i:
                        self.p2p.wait_sends([(0, 2 * i - 1)])
                    self.p2p.send(x + 0.0, 0, 2 * i + 1)  # a fresh tensor, as a stage sends
            self.p2p.wait_sends()
            return time.perf_counter() - t0

    actors = [P2PHop.remote() for _ in range(2)]  # type: ignore[attr-defined]
    try:
        address, port = ray.get(actors[0].rendezvous.remote(2, 120.0))
        ray.get([a.join.remote(address, port, r, 2, 120.0) for r, a in enumerate(actors)])
        ray.get([a.pingpong.remote(r, 5) for r, a in enumerate(actors)])
        return ray.get([a.pingpong.remote(r, count) for r, a in enumerate(actors)])[0] / (2 * count)
    finally:
        for a in actors:
            ray.kill(a)


def gloo_pingpong_s(buf: torch.Tensor, rank: int, count: int) -> float:
    """Seconds of ``count`` round trips of ``buf`` between ranks 0 and 1 of the default process group, torch's
    blocking gloo ``send``/``recv`` (the caller's clock; a one-way hop is a ``2 * count``-th of it)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    for _ in range(count):
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    return time.perf_counter() - t0


def compiled_hop_s(actors: Sequence[Any], shape: tuple[int, ...], count: int, repeats: int = 10) -> float:
    """Seconds per hop of a compiled graph chaining ``count`` ``echo`` calls between 2 actors (the median run)."""
    from ray.dag import InputNode

    def chain(n: int) -> float:
        with InputNode() as inp:
            node = inp
            for i in range(n):
                node = actors[i % 2].echo.bind(node)
        dag = node.experimental_compile()
        try:
            x = torch.randn(shape)
            for _ in range(3):
                dag.execute(x).get(timeout=-1)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                dag.execute(x).get(timeout=-1)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        finally:
            dag.teardown()

    return (chain(count) - chain(count // 5)) / (count - count // 5)
