"""Shared fixtures: one Ray instance per test session, small models and data."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os

import pytest
import torch

from rayspec.core.methods import METHODS as REGISTRY
from rayspec.core.optim import OptimSpec
from rayspec.core.schedule import build_schedule
from rayspec.core.stage import make_stages as stages_for
from rayspec.core.stage_spec import StageSpec
from rayspec.data import build_data
from rayspec.exec import LocalExecutor
from rayspec.models import build_model
from rayspec.partition import split, uniform

METHODS = ("vanilla", "gpipe", "async", "pipedream", "spectrain")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session: 2 CPUs, stage actors take fractions of them."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a recorded head
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny():
    """A tiny MLP (7 blocks) and its synthetic data."""
    torch.manual_seed(0)
    data = build_data("synthetic_image", seed=0, train_size=2048, val_size=256)
    model = build_model("mlp", data.info, "tiny")
    return model, data


def spec_of(optimizer="sgd", **settings):
    """A ``StageSpec`` from flat settings: ``optimizer`` and ``OptimSpec``'s fields (``momentum``, ``betas``, ...) go
    into its ``optim``, the rest are ``StageSpec``'s own (``lr``, ``group``, ``clip_grad_norm``, ...)."""
    optim = {k: settings.pop(k) for k in OPTIM_FIELDS & set(settings)}
    return StageSpec(optim=OptimSpec(optimizer, **optim), **settings)


OPTIM_FIELDS = {f.name for f in dataclasses.fields(OptimSpec)} - {"name"}


def make_stages(model, method, n, *, lr=0.05, momentum=0.9, weight_decay=1e-4, group=None, record=False,
                backward="mixed", nesterov=False, predictor="linear", probe=4096, **settings):
    """``settings``: more stage settings (``optimizer``, ``betas``, ``clip_grad_norm``, ...; ``spec_of``)."""
    parts = split(copy.deepcopy(model), uniform(len(model), n))
    return stages_for(parts, method, spec_of(lr=lr, momentum=momentum, weight_decay=weight_decay, group=group or 1,
                                             record=record, backward=backward, nesterov=nesterov, predictor=predictor,
                                             probe=probe, **settings))


def microbatches(data, updates, batch, group=1):
    """``updates`` batches of ``batch`` samples, each split into ``group`` micro-batches."""
    x, y = data.train.tensors
    x, y = x[: updates * batch], y[: updates * batch]
    return list(zip(x.split(batch // group), y.split(batch // group)))


@contextlib.contextmanager
def threads(count):
    """torch's intra-op threads for a while: a stage actor computes at one thread, and a matmul's rounding may
    depend on how many threads split it (enough to move AdamW, which divides by the root of tiny moments)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_local(model, data, method, n, updates=16, batch=32, group=None, variant="paper", **kw):
    group = group or (4 if method == "gpipe" else 1)
    stages = make_stages(model, method, n, group=group, **kw)
    ex = LocalExecutor(stages, method, variant)
    schedule = build_schedule(REGISTRY[method].schedule, n, updates * group, group=group)
    losses = ex.run(schedule, microbatches(data, updates, batch, group))
    return ex, losses, schedule


def plain_sgd(model, data, updates, batch, lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=False):
    """The reference: torch.optim.SGD on the whole model, one update per batch."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    for x, y in microbatches(data, updates, batch):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


ADAMW = {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.01, "betas": (0.9, 0.99), "eps": 1e-8}
"""Stage settings of the AdamW runs the tests compare (a rate at which a few updates move the tiny MLP)."""


def torch_optimizer(params, optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=False,
                    betas=(0.9, 0.999), eps=1e-8, fused=True, **_):
    """torch's optimizer that a stage's ``Optimizer`` with these settings equals, of the same (fused) kernel."""
    kernel = {"fused": True} if fused else {}
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                               **kernel)
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kernel)


def plain_torch(model, data, updates, batch, clip_grad_norm=None, precision="fp32", every=None, **settings):
    """The reference: torch's optimizer (``torch_optimizer(**settings)``) on the whole unpartitioned model, one update
    per batch, gradients clipped by ``clip_grad_norm_`` when given; with ``every``, called with the weights after
    each update."""
    model = copy.deepcopy(model)
    opt = torch_optimizer(model.parameters(), **settings)
    for i, (x, y) in enumerate(microbatches(data, updates, batch)):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        opt.step()
        if every is not None:
            every(i, model.state_dict())
    return model.state_dict()


def assert_same_weights(a, b, **tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


class Stop(Exception):
    """Raised by a callback to stop a run in the middle of a segment, as a crash would."""


class StopAfter:
    """Stops a run at the loss record of ``step``: the newest checkpoint is the one before."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_metrics(self, record: dict) -> None:
        if "loss" in record and record["step"] >= self.step:
            raise Stop(record["step"])
