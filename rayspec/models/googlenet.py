"""GoogLeNet (Szegedy et al. 2015) from torchvision, adapted to 32x32 images, as blocks.

Adaptation (as CIFAR GoogLeNets commonly do): ``aux_logits=False``, ``transform_input=False``;
the stem's 7x7 stride-2 conv is a 3x3 stride-1 conv (taking the data's channels) and both stem
max-pools are gone, so the Inception modules run at 32 (3a-3b), 16 (4a-4e) and 8 (5a-5b) pixels.
The modules are torchvision's ``BasicConv2d`` and ``Inception`` (whose "5x5" branch is 3x3, as in
torchvision) and the forward is ``GoogLeNet.forward``; weights are initialised as torchvision
does. ``full`` has the paper's widths, ``small`` half and ``tiny`` an eighth of every width.

Blocks: conv1, conv2, conv3, each Inception module (a max-pool before 4a and 5a goes with it),
then avgpool+dropout+fc: 13 blocks at every size.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torchvision.models.googlenet import BasicConv2d, GoogLeNet, Inception

from rayspec.data import DataInfo
from rayspec.models import register
from rayspec.models._util import image_channels, no_options, pick

# width divisor per size
_SIZES = {"full": 1, "small": 2, "tiny": 8}

# torchvision's Inception widths: in, 1x1, 3x3 reduce, 3x3, "5x5" reduce, "5x5", pool projection
_INCEPTION = {
    "3a": (192, 64, 96, 128, 16, 32, 32),
    "3b": (256, 128, 128, 192, 32, 96, 64),
    "4a": (480, 192, 96, 208, 16, 48, 64),
    "4b": (512, 160, 112, 224, 24, 64, 64),
    "4c": (512, 128, 128, 256, 24, 64, 64),
    "4d": (512, 112, 144, 288, 32, 64, 64),
    "4e": (528, 256, 160, 320, 32, 128, 128),
    "5a": (832, 256, 160, 320, 32, 128, 128),
    "5b": (832, 384, 192, 384, 48, 128, 128),
}


class CifarGoogLeNet(GoogLeNet):
    """torchvision's ``GoogLeNet`` (its ``forward``) with a CIFAR stem, no aux heads, any width.

    ``GoogLeNet.__init__`` hard-codes the ImageNet stem and widths, so this constructor builds
    the modules ``GoogLeNet.forward`` uses itself, with the same names.

    Args:
        div: every width is divided by ``div`` (1 is torchvision's GoogLeNet).
        in_channels: channels of the input images.
        num_classes: number of output classes.
        dropout: dropout probability before the classifier.
    """

    def __init__(self, div: int, in_channels: int, num_classes: int, dropout: float = 0.2) -> None:
        nn.Module.__init__(self)
        self.aux_logits = False
        self.transform_input = False
        self.conv1 = BasicConv2d(in_channels, 64 // div, kernel_size=3, stride=1, padding=1)
        self.maxpool1 = nn.Identity()
        self.conv2 = BasicConv2d(64 // div, 64 // div, kernel_size=1)
        self.conv3 = BasicConv2d(64 // div, 192 // div, kernel_size=3, padding=1)
        self.maxpool2 = nn.Identity()
        for name, widths in _INCEPTION.items():
            setattr(self, f"inception{name}", Inception(*(w // div for w in widths)))
        self.maxpool3 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.maxpool4 = nn.MaxPool2d(2, stride=2, ceil_mode=True)
        self.aux1 = None
        self.aux2 = None
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(1024 // div, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.trunc_normal_(m.weight, mean=0.0, std=0.01, a=-2, b=2)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)


def torchvision_net(name: str, size: str, info: DataInfo) -> CifarGoogLeNet:
    """The adapted torchvision GoogLeNet at ``size`` for ``info``'s images (``name``: ``googlenet``)."""
    return CifarGoogLeNet(pick(_SIZES, size, name), image_channels(name, info), info.num_classes)


def to_blocks(net: GoogLeNet) -> nn.Sequential:
    """Cut ``net`` into its three stem convs, its nine Inception modules and the head."""
    n = net
    blocks = [
        nn.Sequential(n.conv1, n.maxpool1),
        n.conv2,
        nn.Sequential(n.conv3, n.maxpool2),
        n.inception3a,
        n.inception3b,
        nn.Sequential(n.maxpool3, n.inception4a),
        n.inception4b,
        n.inception4c,
        n.inception4d,
        n.inception4e,
        nn.Sequential(n.maxpool4, n.inception5a),
        n.inception5b,
        nn.Sequential(n.avgpool, nn.Flatten(1), n.dropout, n.fc),
    ]
    return nn.Sequential(*blocks)


@register("googlenet")
def googlenet(size: str, info: DataInfo, **options: Any) -> nn.Sequential:
    """GoogLeNet for 32x32 images; see the module docstring."""
    no_options("googlenet", options)
    return to_blocks(torchvision_net("googlenet", size, info))
