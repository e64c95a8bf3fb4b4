"""VGG-16 (Simonyan & Zisserman 2015) from torchvision, adapted to 32x32 CIFAR images, as blocks.

Adaptation (as CIFAR VGGs commonly do): the features are torchvision's ``make_layers`` of
configuration ``D`` (13 3x3 convs, 5 max-pools), whose first conv takes the data's channels; at
32x32 they end in a 512x1x1 map, so ``avgpool`` is ``AdaptiveAvgPool2d(1)`` and the classifier is
``Linear(512, 512)/ReLU/Dropout, Linear(512, 512)/ReLU/Dropout, Linear(512, classes)`` instead of
the ImageNet 7x7x512 -> 4096 one. ``small`` halves every width and ``tiny`` divides them by 8
(same 13 convs and 3 linears). The convs are initialised as torchvision's ``VGG`` does (He normal,
fan-out); the linear layers keep PyTorch's default initialisation (see ``CifarVGG``).

Blocks: one per conv (with its ReLU and the max-pool that follows), then the pooling+first linear
layer, the second linear layer and the output layer: 16 blocks at every size.

Other image sizes: five 2x2 max-pools halve 32 down to 1 exactly, but would leave nothing of a side
that is not a multiple of 32 (28 -> 14 -> 7 -> 3 -> 1 -> 0 for MNIST). For such inputs the pools round
up (``ceil_mode=True``: 28 -> 14 -> 7 -> 4 -> 2 -> 1), which changes no weight; inputs whose sides are
multiples of 32 get exactly the layers above. Sides down to 16 are accepted (there the last pool passes
a 1x1 map through).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchvision.models.vgg import VGG, cfgs, make_layers

from rayspec.data import DataInfo
from rayspec.models import register
from rayspec.models._util import image_channels, no_options, pick

# width divisor per size
_SIZES = {"full": 1, "small": 2, "tiny": 8}


class CifarVGG(VGG):
    """torchvision's ``VGG`` (its ``forward``) with the CIFAR classifier on a 1x1 feature map.

    ``VGG.__init__`` always builds the 25088 -> 4096 ImageNet classifier, so this constructor
    sets the three parts ``VGG.forward`` uses itself. Its convs are initialised as ``VGG`` does.
    Its linear layers are not: ``VGG`` draws them from N(0, 0.01), a scale meant for 4096-wide
    layers. On this 512-wide classifier (64 wide at ``tiny``) that scale shrinks the logits and every
    gradient below it by about 10^3 to 10^6. Trained tiny on 32x32 synthetic images for 320 updates
    (SGD, momentum 0.9), it stayed at chance (10.7 %) at every learning rate from 0.003 to 1. With
    PyTorch's default ``nn.Linear`` initialisation it reached 54 % at lr 0.03.

    Args:
        features: the conv layers, as built by ``torchvision.models.vgg.make_layers``.
        width: channels of the last feature map and width of the hidden linear layers.
        num_classes: number of output classes.
        dropout: dropout probability of the hidden linear layers.
    """

    def __init__(self, features: nn.Sequential, width: int, num_classes: int, dropout: float = 0.5) -> None:
        nn.Module.__init__(self)
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Sequential(
            nn.Linear(width, width),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(width, width),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(width, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)


def torchvision_net(name: str, size: str, info: DataInfo) -> CifarVGG:
    """The adapted torchvision VGG-16 at ``size`` for ``info``'s images (``name`` must be ``vgg16``)."""
    channels = image_channels(name, info, min_size=16)
    div = pick(_SIZES, size, name)
    cfg = [v if v == "M" else int(v) // div for v in cfgs["D"]]
    features = make_layers(cfg)
    first = features[0]
    features[0] = nn.Conv2d(channels, first.out_channels, kernel_size=3, padding=1)
    if any(side % 32 for side in info.input_shape[1:]):  # e.g. 28x28: round the pools up (module docstring)
        for layer in features:
            if isinstance(layer, nn.MaxPool2d):
                layer.ceil_mode = True
    return CifarVGG(features, 512 // div, info.num_classes)


class _Head(nn.Module):
    """``VGG.forward`` after the features: pool, flatten and the first classifier layer."""

    def __init__(self, avgpool: nn.Module, first: nn.Sequential) -> None:
        super().__init__()
        self.avgpool = avgpool
        self.classifier = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(x), 1))


def to_blocks(net: VGG) -> nn.Sequential:
    """Cut ``net`` after each conv's ReLU (a following max-pool stays with it) and each linear layer."""
    convs: list[nn.Sequential] = []
    for layer in net.features:
        if isinstance(layer, nn.Conv2d):
            convs.append(nn.Sequential(layer))
        else:
            convs[-1].append(layer)
    c = net.classifier
    return nn.Sequential(*convs, _Head(net.avgpool, c[0:3]), c[3:6], c[6])


@register("vgg16")
def vgg16(size: str, info: DataInfo, **options: Any) -> nn.Sequential:
    """VGG-16 for 32x32 images (or others of at least 16x16); see the module docstring."""
    no_options("vgg16", options)
    return to_blocks(torchvision_net("vgg16", size, info))
