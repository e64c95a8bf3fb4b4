"""Ray cluster helpers: size and reserve the stage bundles, read what a failure means (starting or joining Ray:
``rayspec.exec.ray.connect``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayspec.errors import ConfigError
from rayspec.partition import BlockProfile, profile_blocks

__all__ = ["stage_resources", "default_gpus", "reserve_stages", "bundle_resources", "actor_died",
           "task_cause", "profile_in_bundle", "REPLACE_TIMEOUT_S", "bundle_capacity", "placed_bundles",
           "wait_for_bundles"]

REPLACE_TIMEOUT_S = 120.0
"""How long a restart waits for Ray to place a lost node's stage bundles again (as long as ``reserve_stages``
waits for the first placement)."""


def stage_resources(cpus: float | None, gpus: float | None, stages: int, reserved_cpus: float = 0.0) -> tuple[float, float]:
    """CPUs and GPUs of one stage actor (or worker): by default the cluster's CPUs, less ``reserved_cpus``,
    shared among ``stages`` (at most 1 each), and one GPU each when the cluster has GPUs."""
    if cpus is None:
        total = ray.cluster_resources().get("CPU", 1.0) - reserved_cpus
        cpus = max(0.01, math.floor(min(1.0, total / stages) * 100) / 100)
    if gpus is None:  # the cluster's GPUs, not the driver's: a job's driver may run on a CPU-only head
        gpus = default_gpus(ray.cluster_resources().get("GPU", 0.0), stages)
    return float(cpus), float(gpus)


def default_gpus(available: float, stages: int) -> float:
    """GPUs per stage when ``pipeline.gpus_per_stage`` is null: one each on a cluster with GPUs, none without."""
    if 0 < available < stages:
        raise ConfigError(
            f"{stages} stages need one GPU each but the Ray cluster has {available:g}; lower pipeline.stages, "
            "or set pipeline.gpus_per_stage (0 for CPU stages)"
        )
    return 1.0 if available else 0.0


def reserve_stages(stages: int, cpus: float, gpus: float, strategy: str = "PACK",
                   timeout_s: float = 120.0) -> PlacementGroup:
    """A placement group of one ``{CPU: cpus, GPU: gpus}`` bundle per stage, ready; raises ``ConfigError``
    naming what is missing when the cluster cannot place it within ``timeout_s``."""
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    group = ray.util.placement_group([bundle] * stages, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        have = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise ConfigError(
            f"the Ray cluster could not place {stages} stage bundle(s) of {bundle} ({strategy}) in {timeout_s:g} s; "
            f"it has {have or 'none'} free: lower pipeline.stages or pipeline.cpus_per_stage/gpus_per_stage, "
            "or add nodes"
        )
    return group


def bundle_resources(group: PlacementGroup, index: int) -> tuple[float, float]:
    """The CPUs and GPUs that bundle ``index`` of ``group`` holds."""
    spec = group.bundle_specs[index]
    return float(spec.get("CPU", 0.0)), float(spec.get("GPU", 0.0))


def bundle_capacity(bundle: dict[str, float]) -> int:
    """How many bundles like ``bundle`` the live nodes could hold in all, by their total resources (an upper bound:
    other work may hold some of them)."""
    need = {k: v for k, v in bundle.items() if v > 0}
    fits = 0
    for node in ray.nodes():
        if node.get("Alive") and need:
            have = node.get("Resources", {})
            fits += min(int(math.floor(have.get(k, 0.0) / v + 1e-9)) for k, v in need.items())
    return fits


def placed_bundles(group: PlacementGroup, bundles: Sequence[int]) -> list[int]:
    """Those of ``bundles`` (indices in ``group``) that Ray has placed on a node it holds alive; after a node was
    lost, Ray places that node's bundles again where they fit (the group is ``RESCHEDULING`` until then)."""
    alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
    table = placement_group_table(group)
    where = table.get("bundles_to_node_id", {}) if table.get("state") != "REMOVED" else {}
    return [b for b in bundles if where.get(b) in alive]


@ray.remote(num_cpus=0)
def _answer() -> bool:
    return True


def wait_for_bundles(group: PlacementGroup, bundles: Sequence[int], timeout_s: float = REPLACE_TIMEOUT_S,
                     until_short: bool = False, on_short: Callable[[int], None] | None = None,
                     poll_s: float = 0.5) -> list[int]:
    """Wait up to ``timeout_s`` until every one of ``bundles`` of ``group`` is placed on a live node; returns those
    placed when it returns (all of them, or fewer at the timeout).

    A bundle counts once a task placed in it has answered: a lost node is held alive for seconds after its
    processes went (until Ray's health checks fail), and its bundles look placed until then.

    Args:
        until_short: return as soon as the live nodes cannot hold every bundle (``bundle_capacity``) rather
            than wait for nodes to join.
        on_short: called once, with ``bundle_capacity``, when the live nodes are found unable to hold them all.
    """
    deadline, bundle = time.monotonic() + timeout_s, group.bundle_specs[bundles[0]]
    asked: dict[int, Any] = {}
    answered: set[int] = set()
    warned = False
    try:
        while True:
            now = placed_bundles(group, bundles)
            for b in now:
                if b not in asked:
                    asked[b] = _answer.options(  # type: ignore[attr-defined]
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=group, placement_group_bundle_index=b)).remote()
            pending = {ref: b for b, ref in asked.items() if b not in answered}
            if pending:
                done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=poll_s)
                for ref in done:
                    try:
                        ray.get(ref)
                        answered.add(pending[ref])
                    except Exception:  # failed with its node: ask again where Ray places the bundle now
                        del asked[pending[ref]]
            placed = [b for b in bundles if b in answered]
            if len(placed) == len(bundles):
                return placed
            fits = bundle_capacity(bundle)
            if fits < len(bundles) and not warned:
                warned = True
                if on_short is not None:
                    on_short(fits)
            settled = all(b in answered for b in now)  # every bundle on a live node has answered
            if (until_short and fits < len(bundles) and settled) or time.monotonic() >= deadline:
                return placed
            if not pending:
                time.sleep(poll_s)
    finally:
        for b, ref in asked.items():
            if b not in answered:
                ray.cancel(ref)


def actor_died(err: BaseException) -> bool:
    """Whether ``err`` (or what it wraps) says a stage actor or an object it made was lost."""
    from ray.exceptions import ObjectLostError, RayActorError

    seen = 0
    cause: BaseException | None = err
    while cause is not None and seen < 10:
        if isinstance(cause, (RayActorError, ObjectLostError)):
            return True
        cause, seen = getattr(cause, "cause", None) or cause.__cause__, seen + 1
    return False


def task_cause(err: BaseException) -> BaseException:
    """The exception a stage raised inside its actor, unwrapped from Ray's ``RayTaskError``; else ``err``."""
    from ray.exceptions import RayTaskError

    while isinstance(err, RayTaskError) and isinstance(getattr(err, "cause", None), BaseException):
        err = err.cause
    return err


def profile_in_bundle(model: Any, sample: Any, group: PlacementGroup, index: int, warmup: int = 1,
                      repeats: int = 3) -> list[BlockProfile]:
    """``profile_blocks`` where stage actors run: in bundle ``index`` of ``group``, with its CPUs and GPUs, on its GPU
    when it holds one (each timed block bracketed by a CUDA synchronization). Call it before the stage actor
    of that bundle starts; the bundle is free again when it returns."""
    cpus, gpus = bundle_resources(group, index)
    task = ray.remote(_profile).options(  # type: ignore[attr-defined]
        num_cpus=cpus, num_gpus=gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index))
    return ray.get(task.remote(model, sample, warmup, repeats))


def _profile(model: Any, sample: Any, warmup: int, repeats: int) -> list[BlockProfile]:
    import torch

    device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
    return profile_blocks(model, sample, device, warmup=warmup, repeats=repeats)
