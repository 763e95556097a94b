"""Swin Transformer (shifted-window attention).

Follows Liu et al., "Swin Transformer: Hierarchical Vision Transformer using
Shifted Windows" (ICCV 2021), version 1:

* patch partition + linear embedding (a strided convolution) + LayerNorm;
* four stages of Swin blocks, consecutive blocks alternating between regular
  and shifted windows.  Windows are cut out of the (B, H, W, C) feature map
  with ``view``/``permute``/``reshape`` (``window_partition``) and put back
  with the inverse (``window_reverse``); shifting is a cyclic ``torch.roll``
  plus a fixed attention mask (a buffer) that keeps tokens that were not
  neighbours before the roll from attending to each other;
* attention inside a window adds a learned relative position bias, gathered
  from a ``(2*M-1)**2 x heads`` table by an integer index buffer;
* patch merging between stages: concatenate each 2x2 neighbourhood (4C
  channels), LayerNorm, and a linear reduction to 2C;
* final LayerNorm, mean over tokens, linear head.

As in the paper, a stage whose resolution is not larger than the window uses
one window covering the whole map and no shift (Swin-T's last stage).
Stochastic depth is omitted (it is the identity at inference).  The "full"
preset is Swin-T; resolutions are fixed at construction.

Inside the blocks dim 0 temporarily holds ``batch * windows``; samples are
never mixed, so running micro-batches separately gives the same outputs.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def window_partition(x: torch.Tensor, window: int, height: int, width: int, channels: int) -> torch.Tensor:
    """(B, H, W, C) -> (B * num_windows, window * window, C)."""
    x = x.view(-1, height // window, window, width // window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, channels)


def window_reverse(windows: torch.Tensor, window: int, height: int, width: int, channels: int) -> torch.Tensor:
    """(B * num_windows, window * window, C) -> (B, H, W, C)."""
    x = windows.view(-1, height // window, width // window, window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, height, width, channels)


def relative_position_index(window: int) -> torch.Tensor:
    """(N, N) int64 index into the (2M-1)^2 bias table, N = M * M tokens."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
    return rel[..., 0] * (2 * window - 1) + rel[..., 1]


def shifted_window_mask(height: int, width: int, window: int, shift: int) -> torch.Tensor:
    """(num_windows, 1, N, N) additive mask: 0 within a region, -100 across."""
    regions = torch.zeros(1, height, width, 1)
    label = 0
    cuts = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for hs in cuts:
        for ws in cuts:
            regions[:, hs, ws, :] = label
            label += 1
    labels = window_partition(regions, window, height, width, 1).squeeze(-1)  # (nW, N)
    diff = labels.unsqueeze(1) - labels.unsqueeze(2)
    return torch.zeros_like(diff).masked_fill(diff != 0, -100.0).unsqueeze(1)


class WindowAttention(nn.Module):
    """Multi-head attention within windows, with relative position bias."""

    def __init__(self, dim: int, window: int, num_heads: int) -> None:
        super().__init__()
        self.window = window
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, num_heads) * 0.02)
        self.register_buffer("relative_position_index", relative_position_index(window))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        tokens = self.window * self.window
        qkv = self.qkv(x).reshape(-1, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (B * nW, heads, N, head_dim)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        # Use buffers only as arguments of ops that also take a traced value, so
        # torch.fx records them as get_attr nodes instead of baking constants.
        bias = self.relative_position_bias_table[self.relative_position_index]  # (N, N, heads)
        attn = attn + bias.permute(2, 0, 1).unsqueeze(0)
        if mask is not None:  # decided at construction (buffer or None), not by data
            num_windows = mask.shape[0]  # mask: (nW, 1, N, N)
            attn = attn.view(-1, num_windows, self.num_heads, tokens, tokens) + mask
            attn = attn.view(-1, self.num_heads, tokens, tokens)
        out = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(-1, tokens, self.num_heads * self.head_dim)
        return self.proj(out)


class SwinBlock(nn.Module):
    """LN -> (shifted) window attention -> residual; LN -> MLP -> residual."""

    def __init__(self, dim: int, resolution: tuple[int, int], num_heads: int, window: int, shift: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.dim = dim
        self.height, self.width = resolution
        if min(resolution) <= window:
            window, shift = min(resolution), 0
        self.window, self.shift = window, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, window, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        mask = shifted_window_mask(self.height, self.width, window, shift) if shift else None
        self.register_buffer("attn_mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H * W, C)
        h, w, c, s = self.height, self.width, self.dim, self.shift
        shortcut = x
        x = self.norm1(x).view(-1, h, w, c)
        if s:
            x = torch.roll(x, shifts=(-s, -s), dims=(1, 2))
        windows = window_partition(x, self.window, h, w, c)
        windows = self.attn(windows, self.attn_mask)
        x = window_reverse(windows, self.window, h, w, c)
        if s:
            x = torch.roll(x, shifts=(s, s), dims=(1, 2))
        x = shortcut + x.reshape(-1, h * w, c)
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """(B, H*W, C) -> (B, H/2 * W/2, 2C) by concatenating 2x2 neighbours."""

    def __init__(self, dim: int, resolution: tuple[int, int]) -> None:
        super().__init__()
        self.dim = dim
        self.height, self.width = resolution
        if self.height % 2 or self.width % 2:
            raise ValueError(f"patch merging needs an even resolution, got {resolution}")
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, self.height, self.width, self.dim)
        x0 = x[:, 0::2, 0::2, :]
        x1 = x[:, 1::2, 0::2, :]
        x2 = x[:, 0::2, 1::2, :]
        x3 = x[:, 1::2, 1::2, :]
        x = torch.cat([x0, x1, x2, x3], -1).view(-1, (self.height // 2) * (self.width // 2), 4 * self.dim)
        return self.reduction(self.norm(x))


class SwinTransformer(nn.Module):
    """Swin classifier; defaults give Swin-T."""

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 4,
        in_channels: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 96,
        depths: Sequence[int] = (2, 2, 6, 2),
        num_heads: Sequence[int] = (3, 6, 12, 24),
        window: int = 7,
        mlp_ratio: float = 4.0,
    ) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(in_channels, embed_dim, patch_size, stride=patch_size)
        self.embed_norm = nn.LayerNorm(embed_dim)
        res = image_size // patch_size
        dim = embed_dim
        layers: list[nn.Module] = []
        for i, (depth, heads) in enumerate(zip(depths, num_heads)):
            for j in range(depth):
                shift = window // 2 if j % 2 else 0
                layers.append(SwinBlock(dim, (res, res), heads, window, shift, mlp_ratio))
            if i != len(depths) - 1:
                layers.append(PatchMerging(dim, (res, res)))
                res, dim = res // 2, dim * 2
        self.layers = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed_norm(self.patch_embed(x).flatten(2).transpose(1, 2))  # (B, H*W, C)
        x = self.norm(self.layers(x))
        return self.head(x.mean(dim=1))


PRESETS = {
    # 64px / patch 2 -> resolutions 32, 16, 8, 4 with 4x4 windows: shifted
    # windows in the first three stages, one global window in the last (as Swin-T).
    "tiny": (dict(image_size=64, patch_size=2, embed_dim=16, num_heads=(1, 2, 4, 8), window=4, num_classes=10), (3, 64, 64)),
    "small": (dict(image_size=128, patch_size=4, embed_dim=64, num_heads=(2, 4, 8, 16), window=4, num_classes=100), (3, 128, 128)),
    "full": (dict(), (3, 224, 224)),
}


def from_preset(size: str) -> tuple[nn.Module, tuple[int, ...]]:
    """Return ``(model, per_sample_input_shape)`` for a zoo size."""
    kwargs, shape = PRESETS[size]
    return SwinTransformer(**kwargs), shape
