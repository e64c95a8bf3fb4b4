"""A checkpoint's stage states cut along another partition: weights and optimizer state re-split by parameter name.

[Note: re-split] (docs/design.md §7) Stage modules keep the model's parameter names
(``rayspec.partition.split``), so the union of the stage states of one partition is the whole model's,
and it can be cut along any other partition. A stage state (``Stage.checkpoint_state``) holds:

* ``module``, a ``state_dict``: merged by key and cut along the new stage modules' keys;
* per-parameter entries, at the top level or in nested dicts: a list with one item (a tensor or None) per
  trainable parameter of the stage in ``Stage.params`` order (the optimizer's kept directions), or a dict
  keyed by parameter index (torch's optimizer ``state``: SGD's momentum, which is also SpecTrain's velocity,
  Adam's moments and step counts; a parameter without state has no key): merged by parameter name and cut
  along the new stages. ``parameters``, the stage's count of them, is the new stage's. Anything else
  outside the stage's own entries must be the same on every stage (the optimizer's name) and is copied to
  every new stage; an entry that is neither cannot be re-split and raises.
* the stage's own entries, which belong to one stage and cannot be cut:
  ``version``, equal on every stage at a drained checkpoint, is kept; ``rng``: each new stage gets a stream
  seeded from the run's seed, its index and the update of the checkpoint (reproducible, and not a replay of
  the run's first masks); ``stats`` (actions, busy time, bytes sent) start at zero; ``probe``, SpecTrain's
  sample of the stage's weight coordinates with its sums, its pending predictions and the ``adaptive``
  damping, is dropped: each new stage's probe starts afresh.

PipeDream's stash is empty at a checkpoint (drained), so nothing else is lost: for the synchronous methods
(``vanilla``, ``gpipe``) a re-split run goes on exactly as the unchanged layout would, to rounding.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rayspec.core.stage import StageStats
from rayspec.partition import split

__all__ = ["OWN", "RESUMED", "layout_change", "parameter_names", "resplit", "resumed_states", "stream_seed"]

OWN = ("module", "version", "rng", "stats", "probe")
"""The entries of a stage state that are not per parameter nor shared (see the module's note)."""


def parameter_names(model: nn.Sequential, balance: Sequence[int]) -> list[list[str]]:
    """Per stage of ``balance``, the names of its trainable parameters in ``Stage.params`` order."""
    return [[name for name, p in part.named_parameters() if p.requires_grad] for part in split(model, balance)]


def stream_seed(seed: int, stage: int, step: int) -> int:
    """The seed of new stage ``stage``'s random stream when a checkpoint of update ``step`` is re-split."""
    digest = hashlib.sha256(f"rayspec re-split seed={seed} stage={stage} step={step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def resplit(states: Sequence[dict[str, Any]], model: nn.Sequential, old: Sequence[int], new: Sequence[int], *,
            seed: int, step: int) -> list[dict[str, Any]]:
    """The stage states of partition ``new`` from those of partition ``old`` (see the module's note).

    Args:
        states: ``Stage.checkpoint_state()`` of every stage of ``old``, stage 0 first.
        model: the whole model (its block names and parameters; its values are not read).
        old, new: block counts per stage.
        seed: the run's seed (the new random streams).
        step: the update of the checkpoint.

    Raises:
        ValueError: the states do not fit ``old``, differ in version, or hold an entry that cannot be re-split.
    """
    if len(states) != len(old):
        raise ValueError(f"{len(states)} stage states for a partition of {len(old)} stages {list(old)}")
    old_names, new_names = parameter_names(model, old), parameter_names(model, new)
    versions = {int(st["version"]) for st in states}
    if len(versions) != 1:
        raise ValueError(f"the stages are at versions {sorted(versions)}; only a drained checkpoint can be re-split")
    weights: dict[str, torch.Tensor] = {}
    for st in states:
        weights.update(st["module"])
    out: list[dict[str, Any]] = []
    for k, part in enumerate(split(model, new)):
        missing = [key for key in part.state_dict() if key not in weights]
        if missing:
            raise ValueError(f"the checkpoint holds no {', '.join(missing[:3])} for stage {k} of {list(new)}")
        out.append({"module": {key: weights[key] for key in part.state_dict()}})
    shared = [key for key in states[0] if key not in OWN]
    for state, names in zip(out, new_names):
        if "parameters" in shared:
            state["parameters"] = len(names)
    for key in (k for k in shared if k != "parameters"):
        values = [st.get(key) for st in states]
        for state, value in zip(out, _cut(key, values, old_names, new_names)):
            state[key] = value
    version, fresh = versions.pop(), json.dumps(dataclasses.asdict(StageStats()))
    for k, state in enumerate(out):
        generator = torch.Generator().manual_seed(stream_seed(seed, k, step))
        state.update(version=version, rng=[generator.get_state()], stats=fresh)
    return out


def _cut(key: str, values: list[Any], old: list[list[str]], new: list[list[str]]) -> list[Any]:
    """One entry of every old stage's state (``values``), as the entry of every new stage."""
    if all(_by_index(v, names) for v, names in zip(values, old)):
        indexed = {names[i]: item for v, names in zip(values, old) for i, item in v.items()}
        return [{i: indexed[name] for i, name in enumerate(names) if name in indexed} for names in new]
    if all(isinstance(v, dict) for v in values) and all(v.keys() == values[0].keys() for v in values):
        cut = {k: _cut(f"{key}.{k}", [v[k] for v in values], old, new) for k in values[0]}
        return [{k: cut[k][j] for k in values[0]} for j in range(len(new))]
    if all(_per_parameter(v, names) for v, names in zip(values, old)):
        by_name = {name: item for v, names in zip(values, old) for name, item in zip(names, v)}
        return [[by_name[name] for name in names] for names in new]
    if all(_same(v, values[0]) for v in values[1:]):
        return [values[0] for _ in new]
    raise ValueError(
        f"the checkpoint's stage entry {key!r} is neither one item per parameter nor the same on every stage, so it "
        "cannot be re-split; resume with the checkpoint's pipeline.stages and balance"
    )


def _by_index(value: Any, names: list[str]) -> bool:
    """A dict keyed by parameter index, as torch's optimizer ``state`` is (no other stage entry has int keys)."""
    return isinstance(value, dict) and all(isinstance(i, int) and 0 <= i < len(names) for i in value)


def _per_parameter(value: Any, names: list[str]) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == len(names)
            and all(v is None or isinstance(v, torch.Tensor) for v in value))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


RESUMED = "resumed on another layout"
"""The ``reason`` of a layout change that the resuming run's settings asked for (``pipeline.stages``, ``balance``)."""


def layout_change(update: int, old: Sequence[int], new: Sequence[int], reason: str, train_s: float) -> dict[str, Any]:
    """One entry of ``summary.json``'s ``layout_changes``: the update the run went on from, the stage counts before
    and after, why, the partitions (blocks per stage) and the training seconds at the change."""
    return {"update": update, "from_stages": len(old), "to_stages": len(new), "reason": reason, "from": list(old),
            "to": list(new), "train_s": train_s}


def _entry(change: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's layout change as ``layout_change`` writes it (checkpoints before ``reason`` had ``step``)."""
    if "update" in change:
        return dict(change)
    return layout_change(int(change["step"]), change["from"], change["to"], RESUMED, float(change["train_s"]))


def resumed_states(resume: dict[str, Any], model: nn.Sequential, balance: Sequence[int], seed: int,
                   reason: str = RESUMED) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The stage states to load for partition ``balance`` from the checkpoint ``resume`` (re-split when it was
    written with another partition), and the run's layout changes so far (``summary.json``'s ``layout_changes``):
    the checkpoint's, plus this one, for ``reason``, when the partition changes here."""
    changes = [_entry(c) for c in resume.get("layout_changes", [])]
    old = list(resume["balance"])
    if old == list(balance):
        return list(resume["stages"]), changes
    states = resplit(resume["stages"], model, old, balance, seed=seed, step=int(resume["step"]))
    changes.append(layout_change(int(resume["step"]), old, balance, reason, float(resume["train_s"])))
    return states, changes
