"""ResNet-50 and ResNet-152 (He et al. 2016) from torchvision, adapted to 32x32 images, as blocks.

Adaptation (the usual CIFAR one): the stem is a 3x3 stride-1 conv (taking the data's channels)
and there is no max-pool, so the four stages run at 32, 16, 8 and 4 pixels. Everything else is
torchvision's: its ``Bottleneck`` blocks and ``conv1x1`` shortcuts, the stage layout of its
``_make_layer`` and its ``ResNet.forward``; weights are initialised as ``ResNet`` does. ``full``
has torchvision's stage widths 64..512 (outputs 256..2048) and depths ([3, 4, 6, 3] / [3, 8, 36, 3]);
``small`` keeps the depths at half width; ``tiny`` has base width 8 and one to six bottlenecks
per stage.

Blocks: the stem (conv, BN, ReLU), one per bottleneck, then avgpool+fc.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torchvision.models.resnet import Bottleneck, ResNet, conv1x1

from rayspec.data import DataInfo
from rayspec.models import ModelError, register
from rayspec.models._util import image_channels, no_options, pick

# (bottlenecks per stage, base width) per model and size
_SIZES = {
    "resnet50": {"full": ((3, 4, 6, 3), 64), "small": ((3, 4, 6, 3), 32), "tiny": ((1, 2, 3, 1), 8)},
    "resnet152": {"full": ((3, 8, 36, 3), 64), "small": ((3, 8, 36, 3), 32), "tiny": ((1, 2, 6, 1), 8)},
}


def _stage(inplanes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
    """A stage as ``ResNet._make_layer`` builds it: a projection shortcut first, where needed."""
    out = planes * Bottleneck.expansion
    down = None
    if stride != 1 or inplanes != out:
        down = nn.Sequential(conv1x1(inplanes, out, stride), nn.BatchNorm2d(out))
    rest = (Bottleneck(out, planes) for _ in range(1, blocks))
    return nn.Sequential(Bottleneck(inplanes, planes, stride, down), *rest)


class CifarResNet(ResNet):
    """torchvision's bottleneck ``ResNet`` (its ``forward``) with a CIFAR stem and any base width.

    ``ResNet.__init__`` hard-codes the 7x7 stride-2 stem and the 64..512 widths, so this
    constructor builds the modules ``ResNet.forward`` uses itself, with the same names.

    Args:
        layers: bottlenecks per stage (four stages).
        width: base width (torchvision: 64); stage ``i`` has ``width * 2**i`` planes.
        in_channels: channels of the input images.
        num_classes: number of output classes.
    """

    def __init__(self, layers: tuple[int, ...], width: int, in_channels: int, num_classes: int) -> None:
        nn.Module.__init__(self)
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()
        inplanes = width
        for i, blocks in enumerate(layers):
            planes = width * 2**i
            setattr(self, f"layer{i + 1}", _stage(inplanes, planes, blocks, 1 if i == 0 else 2))
            inplanes = planes * Bottleneck.expansion
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)


def torchvision_net(name: str, size: str, info: DataInfo) -> CifarResNet:
    """The adapted torchvision ResNet ``name`` (``resnet50`` or ``resnet152``) at ``size``."""
    if name not in _SIZES:
        raise ModelError(f"model={name!r} is not a ResNet here; choose one of {', '.join(_SIZES)}")
    layers, width = pick(_SIZES[name], size, name)
    return CifarResNet(layers, width, image_channels(name, info), info.num_classes)


def to_blocks(net: ResNet) -> nn.Sequential:
    """Cut ``net`` into the stem, its bottlenecks and the avgpool+fc head."""
    stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
    bottlenecks = [b for stage in (net.layer1, net.layer2, net.layer3, net.layer4) for b in stage]
    return nn.Sequential(stem, *bottlenecks, nn.Sequential(net.avgpool, nn.Flatten(1), net.fc))


@register("resnet50")
def resnet50(size: str, info: DataInfo, **options: Any) -> nn.Sequential:
    """ResNet-50 for 32x32 images; see the module docstring."""
    no_options("resnet50", options)
    return to_blocks(torchvision_net("resnet50", size, info))


@register("resnet152")
def resnet152(size: str, info: DataInfo, **options: Any) -> nn.Sequential:
    """ResNet-152 for 32x32 images; see the module docstring."""
    no_options("resnet152", options)
    return to_blocks(torchvision_net("resnet152", size, info))
