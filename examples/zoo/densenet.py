"""DenseNet-121.

Follows Huang et al., "Densely Connected Convolutional Networks" (CVPR 2017),
the DenseNet-BC variant: bottleneck layers (BN-ReLU-1x1 conv to
``bn_size * growth_rate`` channels, then BN-ReLU-3x3 conv to ``growth_rate``
channels) and transitions that halve the channel count (compression 0.5) and
the resolution (2x2 average pooling).

Inside a dense block every layer sees the channel-wise concatenation of the
block input and of the outputs of all earlier layers, so the graph has many
long-lived tensors feeding many ``torch.cat`` nodes -- a demanding pattern for
a pipeline partitioner.  DenseNet-121 uses ``block_config=(6, 12, 24, 16)``,
``growth_rate=32`` and a 64-channel stem.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class DenseLayer(nn.Module):
    """BN-ReLU-conv1x1 -> BN-ReLU-conv3x3 producing ``growth_rate`` new maps."""

    def __init__(self, in_channels: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        inner = bn_size * growth_rate
        self.norm1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, inner, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(inner)
        self.conv2 = nn.Conv2d(inner, growth_rate, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(F.relu(self.norm1(x)))
        return self.conv2(F.relu(self.norm2(x)))


class DenseBlock(nn.Module):
    """``num_layers`` dense layers; returns the concatenation of everything."""

    def __init__(self, num_layers: int, in_channels: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DenseLayer(in_channels + i * growth_rate, growth_rate, bn_size) for i in range(num_layers)
        )
        self.out_channels = in_channels + num_layers * growth_rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    """BN-ReLU-conv1x1 (channel compression) then 2x2 average pooling."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(),
            nn.Conv2d(in_channels, out_channels, 1, bias=False),
            nn.AvgPool2d(2, stride=2),
        )


class DenseNet(nn.Module):
    """DenseNet-BC; defaults give DenseNet-121."""

    def __init__(
        self,
        growth_rate: int = 32,
        block_config: Sequence[int] = (6, 12, 24, 16),
        num_init_features: int | None = None,
        bn_size: int = 4,
        compression: float = 0.5,
        num_classes: int = 1000,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        channels = num_init_features if num_init_features is not None else 2 * growth_rate
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, channels, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        for i, num_layers in enumerate(block_config):
            block = DenseBlock(num_layers, channels, growth_rate, bn_size)
            stages.append(block)
            channels = block.out_channels
            if i != len(block_config) - 1:
                out = int(channels * compression)
                stages.append(Transition(channels, out))
                channels = out
        self.features = nn.Sequential(*stages)
        self.norm = nn.BatchNorm2d(channels)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(self.stem(x))
        x = F.relu(self.norm(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.classifier(x)


PRESETS = {
    "tiny": (dict(growth_rate=4, block_config=(6, 12, 24, 16), num_classes=10), (3, 32, 32)),
    "small": (dict(growth_rate=12, block_config=(6, 12, 24, 16), num_classes=100), (3, 64, 64)),
    "full": (dict(growth_rate=32, block_config=(6, 12, 24, 16), num_classes=1000), (3, 224, 224)),
}


def from_preset(size: str) -> tuple[nn.Module, tuple[int, ...]]:
    """Return ``(model, per_sample_input_shape)`` for a zoo size."""
    kwargs, shape = PRESETS[size]
    return DenseNet(**kwargs), shape
