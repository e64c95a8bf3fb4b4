"""DenseNet-121 (Huang et al. 2017) from torchvision, adapted to 32x32 images, as blocks.

Adaptation: torchvision's ``DenseNet`` with its 7x7 stride-2 stem conv replaced by a 3x3
stride-1 conv (taking the data's channels) and no stem max-pool, so the four dense blocks run at
32, 16, 8 and 4 pixels. ``full`` is torchvision's ``densenet121`` (growth 32, blocks 6-12-24-16,
64 stem features); ``small`` keeps the blocks with growth 12 and 24 stem features (DenseNet-BC
k=12 widths); ``tiny`` has growth 8, 16 stem features and two layers per dense block. All are
built by torchvision's own ``DenseNet`` constructor.

Blocks: the stem, one per dense layer (``x -> cat([x, layer(x)])``, which is what the dense
block computes, one layer at a time), one per transition, then norm+ReLU+pool+classifier.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.densenet import DenseNet

from rayspec.data import DataInfo
from rayspec.models import register
from rayspec.models._util import image_channels, no_options, pick

# (growth rate, layers per dense block, stem features) per size
_SIZES = {"full": (32, (6, 12, 24, 16), 64), "small": (12, (6, 12, 24, 16), 24), "tiny": (8, (2, 2, 2, 2), 16)}


def torchvision_net(name: str, size: str, info: DataInfo) -> DenseNet:
    """torchvision's ``DenseNet`` at ``size`` with the CIFAR stem (``name`` must be ``densenet121``)."""
    channels = image_channels(name, info, min_size=8)
    growth, layers, stem = pick(_SIZES, size, name)
    net = DenseNet(growth_rate=growth, block_config=layers, num_init_features=stem, num_classes=info.num_classes)
    net.features.conv0 = nn.Conv2d(channels, stem, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(net.features.conv0.weight)
    net.features.pool0 = nn.Identity()
    return net


class DenseLayer(nn.Module):
    """One torchvision ``_DenseLayer`` whose new features are appended to its input's."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.layer(x)], 1)


class Head(nn.Module):
    """``DenseNet.forward`` after the dense blocks: final norm, ReLU, global pool and classifier."""

    def __init__(self, norm: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.norm5 = norm
        self.classifier = classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.adaptive_avg_pool2d(F.relu(self.norm5(x), inplace=True), (1, 1))
        return self.classifier(torch.flatten(out, 1))


def to_blocks(net: DenseNet) -> nn.Sequential:
    """Cut ``net`` into the stem, each dense layer, each transition and the head."""
    f = net.features
    blocks: list[nn.Module] = [nn.Sequential(f.conv0, f.norm0, f.relu0, f.pool0)]
    for name, module in f.named_children():
        if name.startswith("denseblock"):
            blocks += [DenseLayer(layer) for layer in module.values()]
        elif name.startswith("transition"):
            blocks.append(module)
    blocks.append(Head(f.norm5, net.classifier))
    return nn.Sequential(*blocks)


@register("densenet121")
def densenet121(size: str, info: DataInfo, **options: Any) -> nn.Sequential:
    """DenseNet-121 for 32x32 images; see the module docstring."""
    no_options("densenet121", options)
    return to_blocks(torchvision_net("densenet121", size, info))
