"""A small CNN that plain ``torch.fx.symbolic_trace`` cannot trace.

Not a published architecture: it exists to exercise the fallback paths of a
tracer.  Everything is ordinary and fx-friendly except one small submodule,
:class:`AdaptiveDownsample`, which halves the feature map with a weight-shared
stride-2 convolution *until* the spatial size is at most ``target``::

    while x.shape[-1] > self.target:
        x = relu(conv(x))

The loop count depends on the input resolution.  Under torch.fx symbolic
tracing ``x.shape[-1]`` is a Proxy, and using ``Proxy > int`` as a loop
condition raises ``torch.fx.proxy.TraceError`` ("symbolically traced variables
cannot be used as inputs to control flow").  Two things do work:

* ``torch.export.export(model, args, strict=False)``: shapes are concrete
  during export, so the loop is simply unrolled for the example resolution;
* torch.fx with :class:`AdaptiveDownsample` as a leaf module (see
  :data:`FX_LEAF_MODULES` and :func:`symbolic_trace_with_leaves`): the loop
  then runs eagerly inside one ``call_module`` node.

The model is deterministic, keeps batch on dim 0 and never mixes samples (the
loop count depends only on height/width, never on the batch size or values).
Control flow on tensor *values* (``if x.sum() > 0``) was deliberately not used:
without ``torch.cond`` it breaks torch.export as well, and a whole-batch
statistic would make micro-batched outputs differ from full-batch ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn


class AdaptiveDownsample(nn.Module):
    """Shared stride-2 conv applied until width <= ``target`` (shape-dependent loop)."""

    def __init__(self, channels: int, target: int = 4) -> None:
        super().__init__()
        self.target = target
        self.reduce = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        while x.shape[-1] > self.target:  # <- breaks torch.fx symbolic tracing
            x = F.relu(self.reduce(x))
        return x


class ResidualBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity shortcut."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


class DynamicNet(nn.Module):
    """stem -> residual block -> AdaptiveDownsample -> residual block -> head."""

    def __init__(self, channels: int = 64, num_classes: int = 1000, target: int = 4, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.block1 = ResidualBlock(channels)
        self.downsample = AdaptiveDownsample(channels, target)
        self.block2 = ResidualBlock(channels)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.downsample(self.block1(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


#: Module types that must be fx leaves for :class:`DynamicNet` to trace.
FX_LEAF_MODULES: tuple[type[nn.Module], ...] = (AdaptiveDownsample,)


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, FX_LEAF_MODULES) or super().is_leaf_module(m, module_qualified_name)


def symbolic_trace_with_leaves(model: nn.Module) -> fx.GraphModule:
    """torch.fx trace of ``model`` keeping :data:`FX_LEAF_MODULES` opaque."""
    graph = _LeafTracer().trace(model)
    return fx.GraphModule(model, graph, model.__class__.__name__)


PRESETS = {
    "tiny": (dict(channels=8, num_classes=10), (3, 32, 32)),
    "small": (dict(channels=32, num_classes=100), (3, 64, 64)),
    "full": (dict(channels=64, num_classes=1000), (3, 224, 224)),
}


def from_preset(size: str) -> tuple[nn.Module, tuple[int, ...]]:
    """Return ``(model, per_sample_input_shape)`` for a zoo size."""
    kwargs, shape = PRESETS[size]
    return DynamicNet(**kwargs), shape
