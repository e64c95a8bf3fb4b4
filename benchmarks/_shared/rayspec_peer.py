"""rayspec on the peer benchmark's 2 stage actors: one runner on a ``RayExecutor`` (``RayspecRunner``)."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence

from torch import nn

from benchmarks._shared.peer_setup import (
    PeerConfig,
    make_batches,
    microbatches,
    rayspec_schedule,
    runner_method,
    runner_name,
)
from benchmarks._shared.processes import process_cpu_s, process_tree, ray_system_pids, self_cpu_s
from rayspec.core.optim import OptimSpec
from rayspec.core.stage import make_stages
from rayspec.core.stage_spec import StageSpec


class RayspecRunner:
    """One rayspec runner on a ``RayExecutor`` with 2 stage actors; needs ``ray.init()`` first. ``parts``: the runner's
    stages (4 chunks for interleaved: ``build_parts(cfg, 4)``, actor r holding chunks r and r + 2)."""

    def __init__(self, parts: Sequence[nn.Module], cfg: PeerConfig, runner: str, transport: str,
                 cpus_per_stage: float = 1.0) -> None:
        from rayspec.exec.ray import RayExecutor

        self.runner, self.cfg = runner_name(runner), cfg
        method = runner_method(runner)
        schedule = rayspec_schedule(runner, cfg.microbatches, 1)
        self.group = schedule.group
        spec = StageSpec(lr=cfg.lr, optim=OptimSpec(momentum=cfg.momentum, compile=cfg.compile), group=self.group)
        stages = make_stages([copy.deepcopy(p) for p in parts], method, spec)
        self.batches = make_batches(cfg)
        self.done = 0
        self.executor = RayExecutor(stages, method, transport=transport, cpus_per_stage=cpus_per_stage,
                                    virtual=schedule.virtual)
        import ray

        self.stage_pids = ray.get([a.__ray_call__.remote(lambda _self: os.getpid()) for a in self.executor.actors])
        self.last_cpu_s: dict[str, float] = {}

    def _cpu(self) -> dict[str, float]:
        stages = sum(process_cpu_s(p) for p in self.stage_pids)
        tree = set(process_tree(ray_system_pids())) - set(self.stage_pids) - {os.getpid()}
        return {"stages": stages, "driver": self_cpu_s(), "ray_system": sum(process_cpu_s(p) for p in tree)}

    def steps(self, count: int) -> tuple[float, list[float]]:
        """Train ``count`` batches in one ``run``: seconds and per-batch losses (mean over the batch)."""
        m = self.cfg.microbatches
        schedule = rayspec_schedule(self.runner, m, count)
        mbs = microbatches(self.batches, self.done, count, m)
        cpu0 = self._cpu()
        t0 = time.perf_counter()
        losses = self.executor.run(schedule, mbs)
        elapsed = time.perf_counter() - t0
        self.last_cpu_s = {k: v - cpu0[k] for k, v in self._cpu().items()}
        self.done += count
        scale = self.group / m  # gpipe losses are scaled by 1/group: back to the batch mean
        return elapsed, [sum(losses[i * m:(i + 1) * m]) * scale for i in range(count)]

    def busy_per_action_s(self) -> dict[tuple[int, str], float]:
        """Mean seconds per F, B, I and W inside each stage (``StageStats.busy_s``) so far, fused last-stage calls
        included; 0 for a kind the schedule has none of."""
        out = {}
        for st in self.executor.stage_stats():
            for kind in "FBIW":
                out[(st["stage"], kind)] = st["busy_s"].get(kind, 0.0) / max(1, st["actions"].get(kind, 0))
        return out

    def close(self) -> None:
        self.executor.close()
