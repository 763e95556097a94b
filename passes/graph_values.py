"""Small helpers every pass needs: the tensors inside a value, a `get_attr` target's value, and
an Interpreter that runs a graph on examples as its generated code would.

The Interpreter gives calls plain lists, as generated code does: a function may edit its list
arguments.

Example (a value's tensors in order, a parameter by its target, the graph run node by node):

>>> import torch
>>> from torch import fx, nn
>>> from fxpipe.passes.graph_values import PlainInterpreter, attr_value, tensors
>>> a, b = torch.zeros(1), torch.ones(2)
>>> [t.shape for t in tensors({"first": a, "rest": [b, 3, None]})]
[torch.Size([1]), torch.Size([2])]
>>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
>>> attr_value(gm, "0.weight") is gm.get_submodule("0").weight
True
>>> x = torch.randn(3, 2)
>>> torch.equal(PlainInterpreter(gm).run(x), gm(x))
True
"""

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


class PlainInterpreter(fx.Interpreter):
    """An `fx.Interpreter` that calls each node with fresh plain lists and dicts, as the graph's
    generated code does: fx keeps a node's arguments in immutable lists, and a function that
    edits a list it is given (torchvision's `shifted_window_attention_3d` adapts `window_size`)
    must not fail, or change the graph, when an example runs."""

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple, dict]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return plain(args), plain(kwargs)


def plain(value: Any) -> Any:
    """`value` with fx's immutable lists and dicts (at any depth) as fresh plain ones."""
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return (list if isinstance(value, list) else tuple)(plain(v) for v in value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value
