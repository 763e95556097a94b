"""ResNet-50 with bottleneck residual blocks.

Follows He et al., "Deep Residual Learning for Image Recognition" (CVPR 2016),
in the widely used "v1.5" form where the stride of a down-sampling bottleneck
sits on its 3x3 convolution rather than on the first 1x1 convolution.

Topology (full size)::

    conv7x7/2 (64) -> BN -> ReLU -> maxpool3x3/2
    stage1: 3 x Bottleneck(64 -> 256)
    stage2: 4 x Bottleneck(128 -> 512), first one stride 2
    stage3: 6 x Bottleneck(256 -> 1024), first one stride 2
    stage4: 3 x Bottleneck(512 -> 2048), first one stride 2
    global average pool -> fc

The first block of every stage has a projection shortcut (1x1 conv + BN)
because its channel count (and, after stage 1, its resolution) changes.
``width`` replaces the base width 64 and ``layers`` the block counts, so the
"tiny" preset keeps the real [3, 4, 6, 3] depth at a fraction of the cost.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride) -> 1x1 expand, plus a shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, mid_channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = mid_channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, mid_channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid_channels)
        self.conv2 = nn.Conv2d(mid_channels, mid_channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid_channels)
        self.conv3 = nn.Conv2d(mid_channels, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        if stride != 1 or in_channels != out_channels:
            self.downsample: nn.Module = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.downsample = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Bottleneck ResNet; defaults give ResNet-50 for 1000 ImageNet classes."""

    def __init__(
        self,
        layers: Sequence[int] = (3, 4, 6, 3),
        width: int = 64,
        num_classes: int = 1000,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)

        channels = width
        stages = []
        for i, num_blocks in enumerate(layers):
            mid = width * 2**i
            blocks = []
            for j in range(num_blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(Bottleneck(channels, mid, stride))
                channels = mid * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages

        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


# model kwargs and per-sample input shape for each zoo size
PRESETS = {
    "tiny": (dict(layers=(3, 4, 6, 3), width=8, num_classes=10), (3, 32, 32)),
    "small": (dict(layers=(3, 4, 6, 3), width=16, num_classes=100), (3, 64, 64)),
    "full": (dict(layers=(3, 4, 6, 3), width=64, num_classes=1000), (3, 224, 224)),
}


def from_preset(size: str) -> tuple[nn.Module, tuple[int, ...]]:
    """Return ``(model, per_sample_input_shape)`` for a zoo size."""
    kwargs, shape = PRESETS[size]
    return ResNet(**kwargs), shape
