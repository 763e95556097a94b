"""Two small lookups every pass needs: the tensors inside a value, and a `get_attr` target's value."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) value, in a fixed order."""
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def attr_value(gm: fx.GraphModule, target: str) -> Any:
    """What a `get_attr` node with this target reads from `gm`."""
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)
