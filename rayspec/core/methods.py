"""The training methods a user can pick (``pipeline.method``): the one place that knows what each is.

A method is a schedule and a staleness policy (docs/design.md §2). Everything else asks this
registry: the config for the choices, the trainer for the schedule and whether there is a
pipeline at all, the stage for its policy, the schedule for whether SpecTrain's version
differences apply. Nothing here imports torch or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayspec.errors import unknown

__all__ = ["Method", "METHODS", "POLICIES", "PREDICTING", "TWO_VERSIONS", "VARIANTS", "BACKWARDS", "method"]

POLICIES = ("none", "stash", "predict", "2bw", "predict-2bw")
"""What a stage does about staleness: nothing, PipeDream's weight stashing, SpecTrain's prediction, PipeDream-2BW's
two versions (the backward at the forward's version, one old copy kept at an update), or 2BW with the forward at a
prediction of the next version, kept for its backward (``rayspec.core.staleness``)."""
PREDICTING = ("predict", "predict-2bw")
"""The policies that predict weights ahead (SpecTrain): version differences, the probe and the optimizer's last step."""
TWO_VERSIONS = ("2bw", "predict-2bw")
"""The policies that keep two weight versions (PipeDream-2BW; ``rayspec.core.two_versions``)."""
VARIANTS = ("paper", "consistent")
"""SpecTrain's prediction targets (the authors' v1 and v2; docs/design.md §2)."""
BACKWARDS = ("mixed", "recompute")
"""How a backward at other weights than its forward runs (docs/design.md §2, mixed backward)."""


@dataclass(frozen=True)
class Method:
    """One training method.

    Attributes:
        name: what ``pipeline.method`` names.
        schedule: the pipeline schedule (``rayspec.core.schedule.SCHEDULES``); None without a pipeline.
        policy: the stages' staleness policy, one of ``POLICIES``.
        group_setting: the setting that gives the micro-batches per update; None: one per update.
        summary: one line for ``--help`` texts and the README.
        flushes: every stage's update happens at a drained pipeline, each stage's next action after all of
            them: an update may wait for every stage (global gradient clipping, ``rayspec.core.grads``).
    """

    name: str
    schedule: str | None
    policy: str
    group_setting: str | None
    summary: str
    flushes: bool = False

    @property
    def pipelined(self) -> bool:
        """Whether the method runs a pipeline of stages (``dataparallel`` runs whole-model replicas)."""
        return self.schedule is not None

    @property
    def predicts(self) -> bool:
        """Whether stages predict weights ahead (SpecTrain): version differences and the prediction probe apply."""
        return self.policy in PREDICTING


_ALL = (
    Method("dataparallel", None, "none", None,
           "Ray Train DDP workers, each the whole model and 1/N of every batch"),
    Method("vanilla", "vanilla", "none", "pipeline.accumulate", "one micro-batch through all stages at a time",
           flushes=True),
    Method("gpipe", "gpipe", "none", "pipeline.microbatches", "fill-drain, an update per group of micro-batches",
           flushes=True),
    Method("async", "1f1b", "none", "pipeline.accumulate", "1F1B, no staleness mitigation"),
    Method("pipedream", "1f1b", "stash", "pipeline.accumulate", "1F1B with weight stashing"),
    Method("spectrain", "1f1b", "predict", "pipeline.accumulate", "1F1B with SpecTrain weight prediction"),
    Method("1f1b", "1f1b-flushed", "none", "pipeline.microbatches",
           "synchronous 1F1B flushed every batch (DeepSpeed, Megatron, torch's Schedule1F1B)", flushes=True),
    Method("zb1p", "zb1p", "none", "pipeline.microbatches",
           "ZB-H1: backward split into input (I) and weight (W) gradients, W deferred into the bubble; synchronous",
           flushes=True),
    Method("interleaved", "interleaved", "none", "pipeline.microbatches",
           "interleaved 1F1B, pipeline.virtual_stages model chunks per stage actor; synchronous", flushes=True),
    Method("pipedream-2bw", "1f1b", "2bw", "pipeline.accumulate",
           "PipeDream-2BW: 1F1B, an update per batch, two weight versions, each backward at its forward's version"),
    Method("spectrain-2bw", "1f1b", "predict-2bw", "pipeline.accumulate",
           "2BW whose forward runs at SpecTrain's prediction of the update its backward will see, and the backward "
           "at the same weights (spectrain: the backward at the stored ones)"),
)
METHODS: dict[str, Method] = {m.name: m for m in _ALL}
"""Every method by name, in the order the README lists them."""


def method(name: str) -> Method:
    """The method called ``name``; ``ConfigError`` naming the choices for an unknown one."""
    if name not in METHODS:
        raise unknown("pipeline.method", name, METHODS)
    return METHODS[name]
