"""The benchmarks' inputs: a registered model built on CIFAR-like images if it takes them, else on text."""

from __future__ import annotations

import torch

from rayspec.data import DataInfo
from rayspec.models import ModelError, build_model

IMAGE = DataInfo("image", 10, (3, 32, 32))
TEXT = DataInfo("text", 2, (256,), 20000)


def build(name: str, size: str) -> tuple[torch.nn.Sequential, DataInfo]:
    """The model on images if it takes them, else on text; ``ModelError`` when neither builds."""
    try:
        return build_model(name, IMAGE, size), IMAGE
    except ModelError as image_error:
        try:
            return build_model(name, TEXT, size), TEXT
        except ModelError as text_error:
            raise ModelError(f"model={name} builds for neither image ({image_error}) nor text ({text_error})") from None
