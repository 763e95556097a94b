"""Repeated blocks: the nodes of sibling modules that compute the same thing on the same types.

A block is what one numbered child of a container runs: `layers.3` of a decoder's `layers`,
`layer2.1` of a ResNet stage (the outermost numbered module on a node's module path). Two blocks of
one container repeat each other when their nodes match op for op, in graph order: the same op
and target (with each block's own prefix removed: `layers.3.mlp` and `layers.0.mlp` are both
`mlp`), the same arguments relative to the block (a node of the block by its position, a value
from outside by the order the block first reads it, constants equal), the same module classes,
parameters and buffers (shape, dtype), and the same types (shape, dtype) of every value read and
made. A node of a repeat costs what the same node of the first block it repeats costs, so
`fxpipe.passes.annotate_costs` measures that one and reuses its times.

The types come from the values a run recorded (`value_type`), by default from the nodes' own
`meta["val"]` (torch.export's fake tensors) or `meta["tensor_meta"]` (fx's `ShapeProp`). A block
with a node of unknown type repeats nothing. `meta_types` gives the types the capture recorded,
where it recorded every block node's: repeats known before anything runs. `counterparts` pairs
a repeat's nodes, and the values it reads from outside, with those of the block it repeats.

Example (three equal layers of one container: the second and third repeat the first):

>>> import torch
>>> from torch import fx, nn
>>> from torch.fx.passes.shape_prop import ShapeProp
>>> from fxpipe.passes.blocks import repeated_blocks
>>> class Stack(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
...     def forward(self, x):
...         for layer in self.layers:
...             x = layer(x)
...         return x
>>> gm = fx.symbolic_trace(Stack())
>>> _ = ShapeProp(gm).propagate(torch.randn(2, 4))
>>> {node.name: first.name for node, first in repeated_blocks(gm).items()}
{'layers_1': 'layers_0', 'layers_2': 'layers_0'}
"""

from __future__ import annotations

import re
from typing import Any, Hashable, Mapping

import torch
import torch.fx as fx
from torch import nn

from .graph_values import attr_value
from .capture import module_path

UNKNOWN = object()    # the type of a value nobody recorded: equal to nothing else


def repeated_blocks(gm: fx.GraphModule, types: Mapping[fx.Node, Hashable] | None = None
                    ) -> dict[fx.Node, fx.Node]:
    """Each node of a repeated block -> the same node of the first block of its container that
    it repeats. `types[node]` is `value_type` of the node's value (default: from its meta)."""
    if types is None:
        types = {n: value_type(n.meta["val"] if "val" in n.meta else n.meta["tensor_meta"])
                 for n in gm.graph.nodes if "val" in n.meta or "tensor_meta" in n.meta}
    by_container: dict[str, dict[str, list[fx.Node]]] = {}
    for name, nodes in blocks(gm).items():
        by_container.setdefault(name.rpartition(".")[0], {})[name] = nodes
    repeats: dict[fx.Node, fx.Node] = {}
    for siblings in by_container.values():
        firsts: list[tuple[list, list[fx.Node]]] = []     # (key, nodes) of each block repeated
        for name, nodes in siblings.items():
            key = _block_key(gm, name, nodes, types)
            first = next((kept for kept_key, kept in firsts if kept_key == key), None)
            if first is not None:
                repeats.update(zip(nodes, first))
            elif UNKNOWN not in _flat(key):
                firsts.append((key, nodes))
    return repeats


def meta_types(gm: fx.GraphModule) -> dict[fx.Node, Hashable] | None:
    """`value_type` of every node's value as the capture recorded it (`meta["val"]`, else
    `meta["tensor_meta"]`), a symbolic size by its expression (`s0`: equal where the same);
    None where a node of a block has neither, or a value of a type `value_type` cannot tell."""
    types: dict[fx.Node, Hashable] = {}
    in_blocks = {n for nodes in blocks(gm).values() for n in nodes}
    for n in gm.graph.nodes:
        recorded = n.meta.get("val", n.meta.get("tensor_meta"))
        if recorded is None:
            if n in in_blocks:
                return None
            continue
        try:
            types[n] = _symbols_named(value_type(recorded))
            hash(types[n])
        except TypeError:          # a symbolic value that cannot be hashed or compared
            if n in in_blocks:
                return None
            types.pop(n, None)
    return types


def _symbols_named(value: Any) -> Any:
    """`value` (a `value_type`) with each symbolic size or scalar (a `torch.SymInt`, ...) as the
    text of its expression: two equal ones compare equal, without guarding on them."""
    if isinstance(value, tuple):
        return tuple(_symbols_named(v) for v in value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("symbol", str(value))
    return value


def counterparts(first: list[fx.Node], nodes: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """For a block (`nodes`) repeating `first` (`repeated_blocks`): each node of `first` -> the
    same node of the block, and each value `first` reads from outside -> the one the block reads
    in its place (the same argument of the same node)."""
    found = dict(zip(first, nodes))
    for a, b in zip(first, nodes):
        read_a: list[fx.Node] = []
        read_b: list[fx.Node] = []
        fx.node.map_arg((a.args, a.kwargs), read_a.append)
        fx.node.map_arg((b.args, b.kwargs), read_b.append)
        for x, y in zip(read_a, read_b):
            found.setdefault(x, y)
    return found


def blocks(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """The nodes of each block (the outermost numbered module on their path), in graph order."""
    found: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        name = block_of(n)
        if name is not None:
            found.setdefault(name, []).append(n)
    return found


def block_of(n: fx.Node) -> str | None:
    """The block `n` belongs to (`layers.3` for `layers.3.mlp.up`), None outside any."""
    if n.op in ("placeholder", "output"):
        return None
    path = n.target if n.op == "get_attr" else module_path(n)
    parts = path.split(".") if path else []
    numbered = next((i for i, part in enumerate(parts) if part.isdecimal()), None)
    return None if numbered is None else ".".join(parts[:numbered + 1])


def value_type(value: Any) -> Hashable:
    """What a value's cost depends on, as a hashable: each tensor's (or tensor metadata's) shape
    and dtype, scalars as they are, containers by their items, anything else by its type."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(value_type(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, value_type(v)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):   # as captured
        return ("symbol", str(value))
    return type(value).__qualname__


def _block_key(gm: fx.GraphModule, name: str, nodes: list[fx.Node],
               types: Mapping[fx.Node, Hashable]) -> list:
    """What must be equal for two blocks to cost the same, node by node (see the module)."""
    position = {n: i for i, n in enumerate(nodes)}
    outside: dict[fx.Node, int] = {}

    def relative(v: Any) -> Any:
        if isinstance(v, fx.Node):
            if v in position:
                return ("node", position[v])
            return ("input", outside.setdefault(v, len(outside)), types.get(v, UNKNOWN))
        if isinstance(v, torch.Tensor):
            return value_type(v)
        if isinstance(v, slice):
            return ("slice", relative(v.start), relative(v.stop), relative(v.step))
        if isinstance(v, (list, tuple)):
            return tuple(relative(x) for x in v)
        if isinstance(v, dict):
            return tuple((k, relative(x)) for k, x in v.items())
        return v

    prefix = re.escape(name) + r"(\.|$)"
    key = []
    for n in nodes:
        target = re.sub(f"^{prefix}", "", n.target) if isinstance(n.target, str) else n.target
        state: Any = ()
        if n.op == "call_module":
            state = _module_type(gm.get_submodule(n.target))
        elif n.op == "get_attr":
            value = attr_value(gm, n.target)
            state = _module_type(value) if isinstance(value, nn.Module) else value_type(value)
        key.append((n.op, target, relative(n.args), relative(n.kwargs), state,
                    types.get(n, UNKNOWN)))
    return key


def _module_type(module: nn.Module) -> Hashable:
    """A module's class, its settings as it prints them, and its parameters' and buffers'
    names, shapes and dtypes."""
    return (type(module), module.extra_repr(),
            tuple((k, tuple(t.shape), t.dtype, t.requires_grad)
                  for k, t in [*module.named_parameters(), *module.named_buffers()]))


def _flat(value: Any) -> list:
    """The leaves of nested tuples and lists."""
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _flat(v)]
    return [value]
