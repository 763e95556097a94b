"""U-Net for dense (per-pixel) prediction.

Follows Ronneberger et al., "U-Net: Convolutional Networks for Biomedical
Image Segmentation" (MICCAI 2015): a contracting path of double 3x3
convolutions and 2x2 max pooling that doubles the channel count at each of
``depth`` levels (64, 128, 256, 512, 1024 in the paper), then an expanding
path where a 2x2 transposed convolution halves the channels and doubles the
resolution, the result is concatenated with the skip connection from the
encoder level of the same resolution, and a double convolution follows.  A
final 1x1 convolution maps to ``num_classes`` output channels.

Two common deviations from the paper: convolutions are padded ("same"), so
skips need no cropping and the output has the input's height and width; and
BatchNorm follows every convolution (``batch_norm=False`` gives the original
conv -> ReLU).  Height and width must be divisible by ``2 ** depth``.

The long skip connections make the first encoder activations live until the
very last decoder level, which is what makes this model interesting for
pipeline partitioning.
"""

from __future__ import annotations

import torch
from torch import nn


class DoubleConv(nn.Sequential):
    """(3x3 conv -> [BN] -> ReLU) twice."""

    def __init__(self, cin: int, cout: int, batch_norm: bool = True) -> None:
        layers: list[nn.Module] = []
        for c_in in (cin, cout):
            layers.append(nn.Conv2d(c_in, cout, 3, padding=1, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm2d(cout))
            layers.append(nn.ReLU(inplace=True))
        super().__init__(*layers)


class Down(nn.Sequential):
    """2x2 max pool then double conv."""

    def __init__(self, cin: int, cout: int, batch_norm: bool) -> None:
        super().__init__(nn.MaxPool2d(2), DoubleConv(cin, cout, batch_norm))


class Up(nn.Module):
    """2x2 transposed conv, concatenate the skip, double conv."""

    def __init__(self, cin: int, cout: int, batch_norm: bool) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.conv = DoubleConv(2 * cout, cout, batch_norm)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], 1))


class UNet(nn.Module):
    """U-Net; defaults give the paper's channel plan (64 ... 1024)."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 2,
        base_channels: int = 64,
        depth: int = 4,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        chans = [base_channels * 2**i for i in range(depth + 1)]
        self.inc = DoubleConv(in_channels, chans[0], batch_norm)
        self.downs = nn.ModuleList(Down(chans[i], chans[i + 1], batch_norm) for i in range(depth))
        self.ups = nn.ModuleList(Up(chans[i + 1], chans[i], batch_norm) for i in reversed(range(depth)))
        self.head = nn.Conv2d(chans[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inc(x)
        skips = []
        for down in self.downs:
            skips.append(x)
            x = down(x)
        for up, skip in zip(self.ups, reversed(skips)):
            x = up(x, skip)
        return self.head(x)


PRESETS = {
    "tiny": (dict(base_channels=4, depth=4, num_classes=3), (3, 32, 32)),
    "small": (dict(base_channels=16, depth=4, num_classes=3), (3, 96, 96)),
    "full": (dict(base_channels=64, depth=4, num_classes=2), (3, 256, 256)),
}


def from_preset(size: str) -> tuple[nn.Module, tuple[int, ...]]:
    """Return ``(model, per_sample_input_shape)`` for a zoo size."""
    kwargs, shape = PRESETS[size]
    return UNet(**kwargs), shape
