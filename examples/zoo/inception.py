"""Inception-v3.

Follows Szegedy et al., "Rethinking the Inception Architecture for Computer
Vision" (CVPR 2016): a convolutional stem followed by

    3 x InceptionA  (35x35 grid; 1x1 / 5x5 / double-3x3 / pool branches)
    1 x InceptionB  (grid reduction 35 -> 17)
    4 x InceptionC  (17x17 grid; 7x7 convolutions factorised into 1x7 + 7x1)
    1 x InceptionD  (grid reduction 17 -> 8)
    2 x InceptionE  (8x8 grid; branches that fan out again into 1x3 and 3x1)

Every block runs parallel branches and joins them with ``torch.cat`` on the
channel axis.  Every convolution is conv (no bias) -> BatchNorm -> ReLU.  The
auxiliary classifier used only during training is left out.

Channel counts are those of the paper scaled by ``width`` (never below
``min_channels``).  The real network takes 299x299 images; because several
reductions use unpadded convolutions the smallest input that survives all of
them is 75x75, which is what the "tiny" preset uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Scale:
    """Maps a channel count of the paper to the scaled network."""

    def __init__(self, width: float, min_channels: int) -> None:
        self.width = width
        self.min_channels = min_channels

    def __call__(self, channels: int) -> int:
        return max(self.min_channels, int(round(channels * self.width)))


class ConvBN(nn.Module):
    """Convolution without bias, BatchNorm (eps 1e-3) and ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, eps=1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    """35x35 block: 1x1 | 1x1->5x5 | 1x1->3x3->3x3 | avgpool->1x1."""

    def __init__(self, cin: int, c: _Scale, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = ConvBN(cin, c(64), 1)
        self.branch5x5 = nn.Sequential(ConvBN(cin, c(48), 1), ConvBN(c(48), c(64), 5, padding=2))
        self.branch3x3dbl = nn.Sequential(
            ConvBN(cin, c(64), 1),
            ConvBN(c(64), c(96), 3, padding=1),
            ConvBN(c(96), c(96), 3, padding=1),
        )
        self.branch_pool = ConvBN(cin, c(pool_features), 1)
        self.out_channels = c(64) + c(64) + c(96) + c(pool_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pool = F.avg_pool2d(x, 3, stride=1, padding=1)
        return torch.cat(
            [self.branch1x1(x), self.branch5x5(x), self.branch3x3dbl(x), self.branch_pool(pool)], 1
        )


class InceptionB(nn.Module):
    """Grid reduction 35 -> 17: 3x3/2 | 1x1->3x3->3x3/2 | maxpool/2."""

    def __init__(self, cin: int, c: _Scale) -> None:
        super().__init__()
        self.branch3x3 = ConvBN(cin, c(384), 3, stride=2)
        self.branch3x3dbl = nn.Sequential(
            ConvBN(cin, c(64), 1),
            ConvBN(c(64), c(96), 3, padding=1),
            ConvBN(c(96), c(96), 3, stride=2),
        )
        self.out_channels = c(384) + c(96) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pool = F.max_pool2d(x, 3, stride=2)
        return torch.cat([self.branch3x3(x), self.branch3x3dbl(x), pool], 1)


class InceptionC(nn.Module):
    """17x17 block with 7x7 convolutions factorised into 1x7 and 7x1."""

    def __init__(self, cin: int, c: _Scale, channels_7x7: int) -> None:
        super().__init__()
        c7 = c(channels_7x7)
        self.branch1x1 = ConvBN(cin, c(192), 1)
        self.branch7x7 = nn.Sequential(
            ConvBN(cin, c7, 1),
            ConvBN(c7, c7, (1, 7), padding=(0, 3)),
            ConvBN(c7, c(192), (7, 1), padding=(3, 0)),
        )
        self.branch7x7dbl = nn.Sequential(
            ConvBN(cin, c7, 1),
            ConvBN(c7, c7, (7, 1), padding=(3, 0)),
            ConvBN(c7, c7, (1, 7), padding=(0, 3)),
            ConvBN(c7, c7, (7, 1), padding=(3, 0)),
            ConvBN(c7, c(192), (1, 7), padding=(0, 3)),
        )
        self.branch_pool = ConvBN(cin, c(192), 1)
        self.out_channels = 4 * c(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pool = F.avg_pool2d(x, 3, stride=1, padding=1)
        return torch.cat(
            [self.branch1x1(x), self.branch7x7(x), self.branch7x7dbl(x), self.branch_pool(pool)], 1
        )


class InceptionD(nn.Module):
    """Grid reduction 17 -> 8: 1x1->3x3/2 | 1x1->1x7->7x1->3x3/2 | maxpool/2."""

    def __init__(self, cin: int, c: _Scale) -> None:
        super().__init__()
        self.branch3x3 = nn.Sequential(ConvBN(cin, c(192), 1), ConvBN(c(192), c(320), 3, stride=2))
        self.branch7x7x3 = nn.Sequential(
            ConvBN(cin, c(192), 1),
            ConvBN(c(192), c(192), (1, 7), padding=(0, 3)),
            ConvBN(c(192), c(192), (7, 1), padding=(3, 0)),
            ConvBN(c(192), c(192), 3, stride=2),
        )
        self.out_channels = c(320) + c(192) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pool = F.max_pool2d(x, 3, stride=2)
        return torch.cat([self.branch3x3(x), self.branch7x7x3(x), pool], 1)


class InceptionE(nn.Module):
    """8x8 block whose 3x3 branches split again into parallel 1x3 and 3x1."""

    def __init__(self, cin: int, c: _Scale) -> None:
        super().__init__()
        self.branch1x1 = ConvBN(cin, c(320), 1)
        self.branch3x3_1 = ConvBN(cin, c(384), 1)
        self.branch3x3_2a = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.branch3x3_2b = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = ConvBN(cin, c(448), 1)
        self.branch3x3dbl_2 = ConvBN(c(448), c(384), 3, padding=1)
        self.branch3x3dbl_3a = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.branch_pool = ConvBN(cin, c(192), 1)
        self.out_channels = c(320) + 4 * c(384) + c(192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        bp = self.branch_pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([b1, b3, bd, bp], 1)


class InceptionV3(nn.Module):
    """Inception-v3 classifier; ``width=1.0`` is the paper's network."""

    def __init__(
        self,
        num_classes: int = 1000,
        width: float = 1.0,
        min_channels: int = 4,
        in_channels: int = 3,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        c = _Scale(width, min_channels)
        self.stem = nn.Sequential(
            ConvBN(in_channels, c(32), 3, stride=2),
            ConvBN(c(32), c(32), 3),
            ConvBN(c(32), c(64), 3, padding=1),
            nn.MaxPool2d(3, stride=2),
            ConvBN(c(64), c(80), 1),
            ConvBN(c(80), c(192), 3),
            nn.MaxPool2d(3, stride=2),
        )
        blocks: list[nn.Module] = []
        cin = c(192)
        for pool_features in (32, 64, 64):
            blocks.append(InceptionA(cin, c, pool_features))
            cin = blocks[-1].out_channels
        blocks.append(InceptionB(cin, c))
        cin = blocks[-1].out_channels
        for channels_7x7 in (128, 160, 160, 192):
            blocks.append(InceptionC(cin, c, channels_7x7))
            cin = blocks[-1].out_channels
        blocks.append(InceptionD(cin, c))
        cin = blocks[-1].out_channels
        for _ in range(2):
            blocks.append(InceptionE(cin, c))
            cin = blocks[-1].out_channels
        self.blocks = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(self.dropout(x))


PRESETS = {
    "tiny": (dict(width=0.125, num_classes=10), (3, 75, 75)),
    "small": (dict(width=0.25, num_classes=100), (3, 139, 139)),
    "full": (dict(width=1.0, num_classes=1000), (3, 299, 299)),
}


def from_preset(size: str) -> tuple[nn.Module, tuple[int, ...]]:
    """Return ``(model, per_sample_input_shape)`` for a zoo size."""
    kwargs, shape = PRESETS[size]
    return InceptionV3(**kwargs), shape
