"""MobileNetV3-Large.

Follows Howard et al., "Searching for MobileNetV3" (ICCV 2019), Table 1:
a hardswish stem, fifteen inverted-residual blocks (1x1 expansion, depthwise
kxk convolution, optional squeeze-and-excitation, linear 1x1 projection, and
an identity shortcut when stride is 1 and the channel count is unchanged), a
1x1 conv to 960 channels, global pooling, and a two-layer classifier with a
1280-wide hidden layer.

Squeeze-and-excitation pools each sample on its own (global average pool ->
1x1 conv -> ReLU -> 1x1 conv -> hardsigmoid -> channel-wise scale), so nothing
mixes samples across the batch.  ``width`` is the paper's width multiplier;
channel counts are rounded to multiples of ``divisor`` as in the paper.
"""

from __future__ import annotations

import torch
from torch import nn


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round ``value`` to a multiple of ``divisor`` without losing >10%."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


# kernel, expanded channels, output channels, squeeze-excite, activation, stride
LARGE_CONFIG = [
    (3, 16, 16, False, "RE", 1),
    (3, 64, 24, False, "RE", 2),
    (3, 72, 24, False, "RE", 1),
    (5, 72, 40, True, "RE", 2),
    (5, 120, 40, True, "RE", 1),
    (5, 120, 40, True, "RE", 1),
    (3, 240, 80, False, "HS", 2),
    (3, 200, 80, False, "HS", 1),
    (3, 184, 80, False, "HS", 1),
    (3, 184, 80, False, "HS", 1),
    (3, 480, 112, True, "HS", 1),
    (3, 672, 112, True, "HS", 1),
    (5, 672, 160, True, "HS", 2),
    (5, 960, 160, True, "HS", 1),
    (5, 960, 160, True, "HS", 1),
]


def _activation(kind: str) -> nn.Module:
    return nn.Hardswish() if kind == "HS" else nn.ReLU()


class ConvBNAct(nn.Sequential):
    """Convolution (optionally depthwise) -> BatchNorm -> optional activation."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: str | None = "RE") -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, kernel, stride=stride, padding=(kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01),
        ]
        if act is not None:
            layers.append(_activation(act))
        super().__init__(*layers)


class SqueezeExcite(nn.Module):
    """Per-sample channel attention with a hardsigmoid gate."""

    def __init__(self, channels: int, divisor: int) -> None:
        super().__init__()
        squeezed = make_divisible(channels / 4, divisor)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.relu = nn.ReLU()
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.gate(self.fc2(self.relu(self.fc1(self.pool(x)))))
        return x * scale


class InvertedResidual(nn.Module):
    """expand 1x1 -> depthwise kxk -> [SE] -> project 1x1 (linear) [+ x]."""

    def __init__(self, cin: int, kernel: int, expanded: int, cout: int, use_se: bool, act: str, stride: int, divisor: int) -> None:
        super().__init__()
        self.use_residual = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(ConvBNAct(cin, expanded, 1, act=act))
        layers.append(ConvBNAct(expanded, expanded, kernel, stride=stride, groups=expanded, act=act))
        if use_se:
            layers.append(SqueezeExcite(expanded, divisor))
        layers.append(ConvBNAct(expanded, cout, 1, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        if self.use_residual:  # a Python bool fixed at construction: fx-safe
            out = out + x
        return out


class MobileNetV3(nn.Module):
    """MobileNetV3-Large classifier; ``width=1.0`` is the paper's network."""

    def __init__(
        self,
        num_classes: int = 1000,
        width: float = 1.0,
        divisor: int = 8,
        last_channels: int = 1280,
        dropout: float = 0.2,
        in_channels: int = 3,
    ) -> None:
        super().__init__()

        def ch(c: int) -> int:
            return make_divisible(c * width, divisor)

        cin = ch(16)
        layers: list[nn.Module] = [ConvBNAct(in_channels, cin, 3, stride=2, act="HS")]
        for kernel, expanded, cout, use_se, act, stride in LARGE_CONFIG:
            layers.append(InvertedResidual(cin, kernel, ch(expanded), ch(cout), use_se, act, stride, divisor))
            cin = ch(cout)
        last_conv = 6 * cin  # 960 for the full network
        layers.append(ConvBNAct(cin, last_conv, 1, act="HS"))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        hidden = make_divisible(last_channels * width, divisor) if width > 1.0 else last_channels
        self.classifier = nn.Sequential(
            nn.Linear(last_conv, hidden),
            nn.Hardswish(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


PRESETS = {
    "tiny": (dict(width=0.25, divisor=4, last_channels=64, num_classes=10), (3, 64, 64)),
    "small": (dict(width=0.5, divisor=8, last_channels=256, num_classes=100), (3, 96, 96)),
    "full": (dict(width=1.0, num_classes=1000), (3, 224, 224)),
}


def from_preset(size: str) -> tuple[nn.Module, tuple[int, ...]]:
    """Return ``(model, per_sample_input_shape)`` for a zoo size."""
    kwargs, shape = PRESETS[size]
    return MobileNetV3(**kwargs), shape
