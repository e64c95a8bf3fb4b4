"""Offline synthetic data with real, learnable structure, deterministic by seed."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from rayspec.data import DataBundle, DataError, DataInfo, register


@register("synthetic_image")
def synthetic_image(
    root: str | None = None,
    seed: int = 0,
    num_classes: int = 10,
    channels: int = 3,
    image_size: int = 8,
    train_size: int = 8192,
    val_size: int = 1024,
    noise: float = 1.0,
) -> DataBundle:
    """Images ``x = prototype[y] + noise * N(0, 1)`` with one smooth random prototype per class.

    Prototypes are low-frequency patterns (a random 2×2 grid upsampled), so neighbouring pixels
    correlate as in real images; at ``noise=1`` a linear model is well above chance and a deeper
    one does better. The same ``seed`` gives the same data everywhere.
    """
    if num_classes < 2 or image_size < 2 or train_size < 1 or val_size < 0:
        raise DataError(
            f"synthetic_image needs num_classes>=2, image_size>=2, train_size>=1, val_size>=0; "
            f"got {num_classes}, {image_size}, {train_size}, {val_size}"
        )
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, channels, 2, 2, generator=g)
    protos = torch.nn.functional.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=True)
    protos = protos / protos.flatten(1).std(dim=1).view(-1, 1, 1, 1)

    def split(n: int) -> TensorDataset:
        y = torch.randint(num_classes, (n,), generator=g)
        x = protos[y] + noise * torch.randn(n, channels, image_size, image_size, generator=g)
        return TensorDataset(x, y)

    train = split(train_size)
    val = split(val_size) if val_size else None
    return DataBundle(train, val, DataInfo("image", num_classes, (channels, image_size, image_size)))
