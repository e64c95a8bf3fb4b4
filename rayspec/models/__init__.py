"""Model registry: every model is an ``nn.Sequential`` of blocks the partitioner may cut between.

A block's ``forward`` takes one argument, a tensor or a tuple of tensors (skip tensors, masks,
recurrent state), and returns one; composing the blocks computes exactly the whole model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from rayspec.data import DataInfo
from rayspec.errors import RayspecError, unknown

__all__ = ["MODELS", "SIZES", "register", "build_model", "ModelError"]

SIZES = ("full", "small", "tiny")
MODELS: dict[str, Callable[..., nn.Sequential]] = {}


class ModelError(RayspecError):
    """An unknown model name, size or option."""


def register(name: str) -> Callable[[Callable[..., nn.Sequential]], Callable[..., nn.Sequential]]:
    """Register ``fn(size, info, **options) -> nn.Sequential`` under ``name``."""

    def wrap(fn: Callable[..., nn.Sequential]) -> Callable[..., nn.Sequential]:
        MODELS[name] = fn
        return fn

    return wrap


def build_model(name: str, info: DataInfo, size: str = "full", **options: Any) -> nn.Sequential:
    """Build model ``name`` at ``size`` for a data set described by ``info``."""
    if name not in MODELS:
        raise unknown("model", name, sorted(MODELS))
    if size not in SIZES:
        raise unknown("model.size", size, SIZES)
    accepted = inspect.signature(MODELS[name]).parameters
    extra = [k for k in options if k not in accepted or k in ("size", "info")]
    if extra and not any(q.kind is q.VAR_KEYWORD for q in accepted.values()):
        known = [k for k in accepted if k not in ("size", "info")]
        raise ModelError(f"model.{extra[0]}={options[extra[0]]!r} is not an option of model={name}; its options "
                         f"are size, {', '.join(known)} (check the spelling, or remove it)")
    model = MODELS[name](size, info, **options)
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise ModelError(f"model {name!r} must build a non-empty nn.Sequential of blocks")
    return model


def model_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The builder options of a model config: everything but ``name`` and ``size``."""
    return {k: v for k, v in cfg.items() if k not in ("name", "size")}


# Importing a model module registers it.
from rayspec.models import (  # noqa: E402
    cnn,  # noqa: E402,F401
    densenet,  # noqa: E402,F401
    googlenet,  # noqa: E402,F401
    inception_v4,  # noqa: E402,F401
    mlp,  # noqa: E402,F401
    residual_lstm,  # noqa: E402,F401
    resnet,  # noqa: E402,F401
    snn,  # noqa: E402,F401
    transformer,  # noqa: E402,F401
    vgg,  # noqa: E402,F401
)
