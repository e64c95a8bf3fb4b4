"""After a lost node: wait until the cluster holds every stage again, or go on with the stages it still holds
(``fault.elastic``), re-split from the newest checkpoint.

[Note: elastic] When a node holding a stage bundle goes, Ray places that bundle again on the nodes that remain
(the placement group is ``RESCHEDULING`` until then). Before a restart the run loop asks ``fit_cluster`` whether
that happened. It waits up to ``REPLACE_TIMEOUT_S`` for the bundles to be placed again; with ``fault.elastic`` it
does not wait when the live nodes cannot hold them all by their total resources (``bundle_capacity``). When the
bundles do not all come back, an elastic run goes on with as many stages as bundles remain (at least
``MIN_STAGES``), with the partition chosen again for that many stages and the checkpoint's state re-split onto it
(``rayspec.training.resplit``); a run without it fails with a message that names the setting. The run's own group
is replaced by a new one of that many bundles (Ray keeps trying to place a group that lost a bundle, and its
control process spends CPU on it all the while: on this machine it slowed actor starts to a minute); a given
group (a Tune trial's, which also holds the driver actor) cannot be replaced, so there the stages go into the
bundles that remain. Counting the bundles that survived rather than what the nodes could hold keeps to what is
known to fit. Fewer than 2 stages is refused: on one stage an asynchronous method would lose its staleness and
become another method, and a one-stage pipeline is a plain sequential run.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from rayspec.config import ConfigError
from rayspec.partition import choose_partition
from rayspec.training.context import RunContext
from rayspec.training.failures import RunFailed
from rayspec.training.prepare import Prepared

__all__ = ["MIN_STAGES", "fit_cluster", "shrunk"]

log = logging.getLogger(__name__)

MIN_STAGES = 2
"""The fewest stages ``fault.elastic`` goes on with."""


def fit_cluster(ctx: RunContext, resume: dict[str, Any] | None) -> str | None:
    """Before a restart of a Ray run in a placement group: wait for its stage bundles to be placed again, or, with
    ``fault.elastic``, go on with those that remain (``ctx.prepared`` and ``ctx.bundles`` changed in place).

    Args:
        ctx: the run, with its placement group.
        resume: the checkpoint the restart goes on from (None: the start).

    Returns:
        The reason of the layout change for ``summary.json``'s ``layout_changes``; None when the stages stay.

    Raises:
        RunFailed: the bundles did not all come back and ``fault.elastic`` is off, or fewer than ``MIN_STAGES``
            remain, or the settings do not allow the stage count that remains.
    """
    c = ctx.config
    if c.pipeline.executor != "ray" or ctx.placement_group is None:
        return None
    from rayspec.exec.ray.cluster import REPLACE_TIMEOUT_S, wait_for_bundles  # Ray only here

    bundles, elastic = ctx.stage_bundles(), c.fault.elastic

    def short(fits: int) -> None:
        if not elastic:
            log.warning("the cluster's live nodes can hold %d of the %d stage bundles; waiting up to %g s for nodes to "
                        "join (with fault.elastic=true the run would go on with the stages that remain)", fits,
                        len(bundles), REPLACE_TIMEOUT_S)

    t0 = time.monotonic()
    placed = wait_for_bundles(ctx.placement_group, bundles, REPLACE_TIMEOUT_S, until_short=elastic, on_short=short)
    if ctx.restarts.records:  # what of the recovery time was Ray's: noticing the node gone, placing its bundles
        ctx.restarts.records[-1]["placement_wait_s"] = time.monotonic() - t0
    if len(placed) == len(bundles):
        return None
    step = 0 if resume is None else int(resume["step"])
    lost = f"the cluster holds {len(placed)} of the {len(bundles)} stage bundles after losing a node"
    if not elastic:
        raise RunFailed(f"{lost} (none placed again within {REPLACE_TIMEOUT_S:g} s); the last checkpoint is "
                        f"{ctx.last_checkpoint() or 'none'}: add nodes and rerun with checkpoint.resume=auto, or set "
                        "fault.elastic=true to go on with the stages that remain")
    if len(placed) < MIN_STAGES:
        raise RunFailed(f"{lost}; fault.elastic goes on with {MIN_STAGES} stages at least: add nodes and rerun with "
                        f"checkpoint.resume=auto (the last checkpoint is {ctx.last_checkpoint() or 'none'})")
    old = list(ctx.prepared.balance)
    ctx.prepared = shrunk(ctx, len(placed))
    where = _regroup(ctx, placed)
    log.warning("fault.elastic: %s; going on with %d stages instead of %d from update %d, the partition %s "
                "re-split onto %s (%s)", lost, len(placed), len(bundles), step, old, ctx.prepared.balance, where)
    return f"fault.elastic: {lost}"


def _regroup(ctx: RunContext, placed: list[int]) -> str:
    """Put the stages of the smaller run where they go: a new group of as many bundles in place of the run's own
    (Ray keeps trying to place a group that lost a bundle, which costs its control process CPU while it lasts), or
    the bundles that remain of a given one (a Tune trial's, which holds the driver actor too); says where."""
    from ray.util.placement_group import remove_placement_group

    from rayspec.exec.ray.cluster import REPLACE_TIMEOUT_S, bundle_resources, reserve_stages

    if not ctx.own_group:
        ctx.bundles = placed
        return f"in the bundles that remain, {placed}"
    cpus, gpus = bundle_resources(ctx.placement_group, placed[0])
    remove_placement_group(ctx.placement_group)  # its stage actors have gone with their run
    try:
        group = reserve_stages(len(placed), cpus, gpus, ctx.config.pipeline.placement.upper(), REPLACE_TIMEOUT_S)
    except ConfigError as err:
        raise RunFailed(f"fault.elastic could not reserve {len(placed)} stage bundles: {err}") from err
    if ctx.reserved is not None:
        remove_placement_group(ctx.reserved)
    ctx.placement_group, ctx.bundle_offset, ctx.bundles, ctx.reserved = group, 0, None, group
    return f"in a new placement group of {len(placed)} bundles"


def shrunk(ctx: RunContext, stages: int) -> Prepared:
    """``ctx.prepared`` for ``stages`` stages: ``pipeline.stages`` lowered, ``pipeline.balance`` dropped, the
    partition chosen again from the blocks' profiles; ``RunFailed`` when the settings do not allow that count."""
    prepared = ctx.prepared
    try:  # each section checks itself where it is made, the whole config in validate()
        p = dataclasses.replace(prepared.config.pipeline, stages=stages, balance=None)
        config = dataclasses.replace(prepared.config, pipeline=p).validate()
    except ConfigError as err:
        raise RunFailed(f"fault.elastic cannot go on with {stages} stages: {err}") from err
    profiles = prepared.plan.profiles if prepared.plan is not None else None
    plan = choose_partition(prepared.model, p.chunks, partition=p.partition, profiles=profiles)
    return dataclasses.replace(prepared, config=config, balance=list(plan.balance), plan=plan)
