"""Inception-v4 (Szegedy et al. 2016, "Inception-v4, Inception-ResNet and ...") for 32x32 images.

Faithful to the paper's Figures 3-9: stem, 4x Inception-A, Reduction-A (k, l, m, n = 192, 224,
256, 384), 7x Inception-B, Reduction-B, 3x Inception-C, average pooling, dropout (keep 0.8) and
a linear classifier; every conv is conv (no bias) + BatchNorm (eps 1e-3) + ReLU, as in the
reference implementations. torchvision has no Inception-v4, so this is written here.

Adaptation to 32x32: the stem keeps its layers and branches but all its convs and pools are
stride 1 with "same" padding (32x32 in, 32x32x384 out, where the paper goes 299 -> 35), and the
reductions' stride-2 convs and pools have padding 1, so the grids are 32, 16 and 8 (paper: 35,
17, 8). ``small`` halves every width and has 2/4/2 Inception-A/B/C modules; ``tiny`` divides
every width by 8 and has one module of each kind.

Blocks: stem convs 1-3, the three stem mixing modules, each Inception and Reduction module, then
pool+dropout+linear (21 blocks at ``full``).
"""

from __future__ import annotations

import torch
from torch import nn

from rayspec.data import DataInfo
from rayspec.models import ModelError, register
from rayspec.models._util import image_channels, pick

# (width divisor, Inception-A/B/C repeats) per size
_SIZES = {"full": (1, (4, 7, 3)), "small": (2, (2, 4, 2)), "tiny": (8, (1, 1, 1))}


def conv(cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1) -> nn.Sequential:
    """Conv + BN + ReLU; "same" padding at stride 1, padding 1 (3x3 kernels) at stride 2."""
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    return nn.Sequential(
        nn.Conv2d(cin, cout, (kh, kw), stride=stride, padding=(kh // 2, kw // 2), bias=False),
        nn.BatchNorm2d(cout, eps=1e-3),
        nn.ReLU(inplace=True),
    )


def _pool(stride: int = 1) -> nn.MaxPool2d:
    return nn.MaxPool2d(3, stride=stride, padding=1)


def _avg_proj(cin: int, cout: int) -> nn.Sequential:
    """The pooling branch of Inception-A/B/C: 3x3 average pooling, then a 1x1 conv."""
    return nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False), conv(cin, cout, 1))


class Branches(nn.Module):
    """Parallel branches whose outputs are concatenated along channels."""

    def __init__(self, *branches: nn.Module) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.branches], 1)


class Split(nn.Module):
    """A 1xk and a kx1 conv side by side on the same input (Inception-C's split branches)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.a = conv(cin, cout, (1, 3))
        self.b = conv(cin, cout, (3, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], 1)


def stem(cin: int, d: int) -> list[nn.Module]:
    """The stem (paper Figure 3) as four blocks: convs 1-3 and the three filter concatenations."""
    return [
        nn.Sequential(conv(cin, 32 // d, 3), conv(32 // d, 32 // d, 3), conv(32 // d, 64 // d, 3)),
        Branches(_pool(), conv(64 // d, 96 // d, 3)),
        Branches(
            nn.Sequential(conv(160 // d, 64 // d, 1), conv(64 // d, 96 // d, 3)),
            nn.Sequential(
                conv(160 // d, 64 // d, 1),
                conv(64 // d, 64 // d, (7, 1)),
                conv(64 // d, 64 // d, (1, 7)),
                conv(64 // d, 96 // d, 3),
            ),
        ),
        Branches(conv(192 // d, 192 // d, 3), _pool()),
    ]


def inception_a(d: int) -> Branches:
    """Inception-A (Figure 4) on the 384-channel grid."""
    c = 384 // d
    return Branches(
        conv(c, 96 // d, 1),
        nn.Sequential(conv(c, 64 // d, 1), conv(64 // d, 96 // d, 3)),
        nn.Sequential(conv(c, 64 // d, 1), conv(64 // d, 96 // d, 3), conv(96 // d, 96 // d, 3)),
        _avg_proj(c, 96 // d),
    )


def reduction_a(d: int) -> Branches:
    """Reduction-A (Figure 7, Inception-v4's k, l, m, n = 192, 224, 256, 384): 384 -> 1024 channels."""
    c = 384 // d
    return Branches(
        _pool(2),
        conv(c, 384 // d, 3, stride=2),
        nn.Sequential(conv(c, 192 // d, 1), conv(192 // d, 224 // d, 3), conv(224 // d, 256 // d, 3, stride=2)),
    )


def inception_b(d: int) -> Branches:
    """Inception-B (Figure 5) on the 1024-channel grid."""
    c = 1024 // d
    return Branches(
        conv(c, 384 // d, 1),
        nn.Sequential(conv(c, 192 // d, 1), conv(192 // d, 224 // d, (1, 7)), conv(224 // d, 256 // d, (7, 1))),
        nn.Sequential(
            conv(c, 192 // d, 1),
            conv(192 // d, 192 // d, (1, 7)),
            conv(192 // d, 224 // d, (7, 1)),
            conv(224 // d, 224 // d, (1, 7)),
            conv(224 // d, 256 // d, (7, 1)),
        ),
        _avg_proj(c, 128 // d),
    )


def reduction_b(d: int) -> Branches:
    """Reduction-B (Figure 8): 1024 -> 1536 channels, half the grid."""
    c = 1024 // d
    return Branches(
        _pool(2),
        nn.Sequential(conv(c, 192 // d, 1), conv(192 // d, 192 // d, 3, stride=2)),
        nn.Sequential(
            conv(c, 256 // d, 1),
            conv(256 // d, 256 // d, (1, 7)),
            conv(256 // d, 320 // d, (7, 1)),
            conv(320 // d, 320 // d, 3, stride=2),
        ),
    )


def inception_c(d: int) -> Branches:
    """Inception-C (Figure 6) on the 1536-channel grid."""
    c = 1536 // d
    return Branches(
        conv(c, 256 // d, 1),
        nn.Sequential(conv(c, 384 // d, 1), Split(384 // d, 256 // d)),
        nn.Sequential(
            conv(c, 384 // d, 1),
            conv(384 // d, 448 // d, (1, 3)),
            conv(448 // d, 512 // d, (3, 1)),
            Split(512 // d, 256 // d),
        ),
        _avg_proj(c, 256 // d),
    )


@register("inception_v4")
def inception_v4(size: str, info: DataInfo, dropout: float = 0.2) -> nn.Sequential:
    """Inception-v4 for 32x32 images; see the module docstring.

    Args:
        size: ``full``, ``small`` or ``tiny``.
        info: the image data set's description.
        dropout: dropout probability before the classifier (the paper keeps 0.8).
    """
    if not 0 <= dropout < 1:
        raise ModelError(f"model.dropout={dropout} must be in [0, 1)")
    d, (na, nb, nc) = pick(_SIZES, size, "inception_v4")
    blocks = stem(image_channels("inception_v4", info), d)
    blocks += [inception_a(d) for _ in range(na)] + [reduction_a(d)]
    blocks += [inception_b(d) for _ in range(nb)] + [reduction_b(d)]
    blocks += [inception_c(d) for _ in range(nc)]
    classifier = nn.Linear(1536 // d, info.num_classes)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Dropout(dropout), classifier)
    return nn.Sequential(*blocks, head)
