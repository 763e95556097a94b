"""Vision Transformer (ViT).

Follows Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for
Image Recognition at Scale" (ICLR 2021): non-overlapping patches are embedded
by a strided convolution, a learnable class token is prepended, a learnable
position embedding is added, and ``depth`` pre-norm transformer encoder blocks
follow::

    x = x + Attention(LayerNorm(x))
    x = x + MLP(LayerNorm(x))          # Linear -> GELU -> Linear

The final LayerNorm output of the class token feeds a linear head.  The "full"
preset is ViT-B/16 (224px, dim 768, 12 blocks, 12 heads).

Attention is written out by hand (qkv projection, reshape/permute into heads,
softmax(q k^T / sqrt(d)) v) rather than via ``nn.MultiheadAttention``, so that
torch.fx sees every matmul and reshape instead of one opaque leaf module.
"""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    """Multi-head self-attention over the token axis of a (B, N, C) tensor."""

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens = x.shape[0], x.shape[1]
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, heads, N, head_dim)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = self.attn_drop(attn.softmax(dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(batch, tokens, -1)
        return self.proj(out)


class MLP(nn.Sequential):
    """Linear -> GELU -> Linear (with dropout)."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__(
            nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim), nn.Dropout(dropout)
        )


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, dropout)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLP(dim, int(dim * mlp_ratio), dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """ViT classifier; defaults give ViT-B/16."""

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        in_channels: int = 3,
        num_classes: int = 1000,
        dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError("image_size must be a multiple of patch_size")
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.pos_drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(EncoderBlock(dim, num_heads, mlp_ratio, dropout) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        nn.init.normal_(self.cls_token, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.blocks(self.pos_drop(x))
        x = self.norm(x)
        return self.head(x[:, 0])


PRESETS = {
    "tiny": (dict(image_size=32, patch_size=8, dim=48, depth=12, num_heads=3, num_classes=10), (3, 32, 32)),
    # ViT-Ti/8 on 64px images
    "small": (dict(image_size=64, patch_size=8, dim=192, depth=12, num_heads=3, num_classes=100), (3, 64, 64)),
    "full": (dict(image_size=224, patch_size=16, dim=768, depth=12, num_heads=12, num_classes=1000), (3, 224, 224)),
}


def from_preset(size: str) -> tuple[nn.Module, tuple[int, ...]]:
    """Return ``(model, per_sample_input_shape)`` for a zoo size."""
    kwargs, shape = PRESETS[size]
    return VisionTransformer(**kwargs), shape
