"""Split a node too costly for one stage along its output features, so that stages share it.

A pipeline's step is bounded by its slowest stage, and a stage holds whole nodes: one node that
costs more than a stage's share of the graph (a language model's vocabulary head) is a floor
under the bottleneck that no partition lowers. A node computing output features independently
from one weight splits along them: a linear layer (`nn.Linear`, `F.linear`, `aten.linear`,
`addmm`, and `mm` / `matmul` by a 2-D weight) by its weight's output columns, a convolution
(`nn.Conv2d`, `F.conv2d`, `aten.conv2d`, one group) by its output channels. Each part is a node
of its own, which the partitioner may put in any stage, and the parts are joined (`cat` on the
feature dimension) where the result is read:

    lm_head = linear(x, lm_head_weight)          # 50257 output features
  becomes
    lm_head_weight_0 = narrow(lm_head_weight, 0, 0, 25129)
    lm_head_part_0 = linear(x, lm_head_weight_0)
    lm_head_weight_1 = narrow(lm_head_weight, 0, 25129, 25128)
    lm_head_part_1 = linear(x, lm_head_weight_1)
    lm_head_cat = cat([lm_head_part_0, lm_head_part_1], -1)

The parts read slices (views, `narrow`) of the one parameter, the model's own, so gradients
from every part add up in its `.grad` and `state_dict()` keeps the model's names and the whole
weight. Each slice is a node of its own: in the part's stage, that stage reads the parameter
(codegen's `get_attr` rule: the same tensor on its home's device, sent from the home stage to
another device); in the stage holding the weight, the part's stage receives the slice alone.

Costs: a node's measured cost (every device kind's) is shared among its parts in proportion to
their features, each part, slice and join priced at least the graph's cheapest node (an op's
overhead), with the bytes it passes on. Not priced: the join's copy of the output, and in
training each slice's backward, which writes a gradient the size of the whole weight (torch's
`narrow` backward) before it is added to `.grad`.

Example (a linear layer of 6 output features in two parts; the same output):

>>> import torch
>>> from torch import fx, nn
>>> from fxpipe.passes.split_wide import split_wide
>>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 6)))
>>> x = torch.randn(2, 4)
>>> whole = gm(x)
>>> gm = split_wide(gm, {"_0": 2})
>>> [n.name for n in gm.graph.nodes if n.name.startswith("_0_part") or n.name == "_0_cat"]
['_0_part_0', '_0_part_1', '_0_cat']
>>> torch.allclose(gm(x), whole)
True
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .cost_model import NodeCost
from .errors import PartitionError
from .graph_values import attr_value
from .randomness import _KEPT_META as KEPT_META    # what a node's replacements keep of its meta

_LINEAR = (F.linear, torch.ops.aten.linear.default)
_CONV2D = (F.conv2d, torch.conv2d, torch.ops.aten.conv2d.default)
_ADDMM = (torch.addmm, torch.ops.aten.addmm.default)
_MATMUL = (torch.mm, torch.matmul, operator.matmul, torch.ops.aten.mm.default,
           torch.ops.aten.matmul.default)


@dataclass(frozen=True)
class _Place:
    """Where an operand sits in a call: positional `index`, else keyword `name`."""

    index: int
    name: str

    def read(self, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        return args[self.index] if self.index < len(args) else kwargs.get(self.name)

    def write(self, args: list, kwargs: dict, value: Any) -> None:
        if self.index < len(args):
            args[self.index] = value
        else:
            kwargs[self.name] = value


@dataclass(frozen=True)
class _Split:
    """How one node splits: `target(*args, **kwargs)` per part, with `weight` (a node, or a
    call_module's parameter to read) narrowed along `weight_dim` at `weight_at`, its bias (if
    any) at `bias_at` along `bias_dim`; the parts joined on `out_dim`."""

    features: int
    target: Callable
    args: tuple
    kwargs: dict
    weight: fx.Node | str
    weight_at: _Place
    weight_dim: int
    bias: fx.Node | str | None
    bias_at: _Place | None
    bias_dim: int
    out_dim: int


def splittable(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `split_wide` can split `node` along its output features."""
    return _split_of(gm, node) is not None


PARTS_PER_STAGE = 4     # the most parts of one node per stage worth trying, in inference


def wide_nodes(gm: fx.GraphModule, num_stages: int, training: bool = False) -> dict[str, int]:
    """The nodes of `gm` (costed: `node.meta["cost"]`) whose cost exceeds a stage's share of the
    graph's (its total over `num_stages`) and that can be split, each with the most parts worth
    trying, at most one per output feature: in inference `PARTS_PER_STAGE` per stage (finer
    parts fill what the rest of the graph leaves of a stage's share: a head of 1.5 shares on 2
    stages balances in 4 parts, not in 2); in training one per stage, since what the split
    leaves unpriced grows with the parts (each slice's backward writes a gradient the size of
    the whole weight: a 40000-word head in 8 parts on 2 stages under torchrun, predicted 5%
    faster than whole, ran at 0.69x torch's hand split, whole at 1.13x). In training a node's
    cost is its forward plus its backward."""
    time_s = {n: c.fwd_s + (c.bwd_s if training else 0.0) for n in gm.graph.nodes
              if (c := n.meta.get("cost")) is not None}
    share_s = sum(time_s.values()) / num_stages
    found = {}
    for n, t in time_s.items():
        split = _split_of(gm, n) if num_stages > 1 and t > share_s else None
        if split is not None:
            found[n.name] = min((1 if training else PARTS_PER_STAGE) * num_stages, split.features)
    return found


def split_wide(gm: fx.GraphModule, parts: Mapping[str, int]) -> fx.GraphModule:
    """Split each node named in `parts` into that many parts along its output features (see the
    module docstring); modifies and returns `gm`. Names are deterministic: node `n` becomes
    `n_weight_<i>` (and `n_bias_<i>`) slices, `n_part_<i>` parts and `n_cat`, its readers'
    value. Costs on the node (`meta["cost"]`, `meta["costs"]`) are shared among its parts."""
    by_name = {n.name: n for n in gm.graph.nodes}
    floors = _floors(gm)
    for name, count in parts.items():
        node = by_name.get(name)
        split = None if node is None else _split_of(gm, node)
        if split is None or not 2 <= count <= split.features:
            raise PartitionError(
                f"cannot split node {name!r} into {count} parts\n"
                + ("the graph has no such node" if node is None else
                   f"{node.format_node()} is not a node split_wide splits (a linear layer, "
                   f"addmm, mm or matmul by a 2-D weight, a one-group conv2d; with no hooks, "
                   f"touching no buffer written in forward)" if split is None else
                   f"it has {split.features} output features")
                + "\nsplit only nodes `splittable` accepts, into 2 to their features' parts")
        _rewrite(gm, node, split, count, floors)
    gm.graph.lint()
    gm.recompile()
    return gm


def _rewrite(gm: fx.GraphModule, node: fx.Node, split: _Split, count: int,
             floors: Mapping[str | None, NodeCost]) -> None:
    """Replace `node` by `count` parts of nearly equal features, their slices and their join,
    which takes its place in its readers; each new node keeps its stack trace, module and grad
    mode, and gets its share of the costs (per device kind, at least that kind's `floors`)."""
    graph, name = gm.graph, node.name
    kept = {k: v for k, v in node.meta.items() if k in KEPT_META}
    if node.op == "call_module":      # the functional calls still name the module they ran in
        kept.setdefault("nn_module_stack", {node.target: (
            node.target, type(gm.get_submodule(node.target)))})

    def made(op: Callable, args: tuple, kwargs: dict, suffix: str,
             share: Callable[[NodeCost], NodeCost]) -> fx.Node:
        new = graph.create_node("call_function", op, args, kwargs, name=f"{name}_{suffix}")
        new.meta.update(kept)

        def priced(cost: NodeCost, floor: NodeCost) -> NodeCost:
            mine = share(cost)
            return dataclasses.replace(mine, fwd_s=max(mine.fwd_s, floor.fwd_s),
                                       bwd_s=max(mine.bwd_s, floor.bwd_s) if cost.bwd_s else 0.0)
        if "cost" in node.meta:
            new.meta["cost"] = priced(node.meta["cost"], floors[None])
            new.meta["costs"] = {k: priced(c, floors.get(k, floors[None]))
                                 for k, c in node.meta.get("costs", {}).items()}
        return new

    with graph.inserting_before(node):
        weight, bias = (_read(graph, v) for v in (split.weight, split.bias))
        bounds = [round(i * split.features / count) for i in range(count + 1)]
        pieces = []
        for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
            fraction = (end - start) / split.features
            args, kwargs = list(split.args), dict(split.kwargs)
            for role, whole, at, dim in (("weight", weight, split.weight_at, split.weight_dim),
                                         ("bias", bias, split.bias_at, split.bias_dim)):
                if whole is not None:       # a view: an op's overhead, its share of the bytes
                    sliced = NodeCost(out_bytes=round(_bytes(gm, whole) * fraction),
                                      new_bytes=0)
                    at.write(args, kwargs, made(torch.narrow, (whole, dim, start, end - start),
                                                {}, f"{role}_{i}", lambda c: sliced))
            pieces.append(made(split.target, tuple(args), kwargs, f"part_{i}",
                               lambda c: _share(c, fraction)))
        joined = made(torch.cat, (pieces, split.out_dim), {}, "cat",
                      lambda c: NodeCost(out_bytes=c.out_bytes))     # an op's overhead
    for key in ("val", "tensor_meta"):
        if key in node.meta:
            joined.meta[key] = node.meta[key]
    node.replace_all_uses_with(joined)
    graph.erase_node(node)


def _floors(gm: fx.GraphModule) -> dict[str | None, NodeCost]:
    """Per device kind (None: `meta["cost"]`), the cheapest computing node's forward and
    backward times: what any op costs however little it computes (its dispatch), the least a
    part, slice or join is priced at, so splitting a small node does not look free."""
    found: dict[str | None, list[NodeCost]] = {}
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module") and "cost" in n.meta:
            for kind, cost in [(None, n.meta["cost"]), *n.meta.get("costs", {}).items()]:
                found.setdefault(kind, []).append(cost)

    def least(times: list[float]) -> float:
        return min((t for t in times if t > 0), default=0.0)
    return {kind: NodeCost(fwd_s=least([c.fwd_s for c in costs]),
                           bwd_s=least([c.bwd_s for c in costs]))
            for kind, costs in found.items()} or {None: NodeCost()}


def _share(cost: NodeCost, fraction: float) -> NodeCost:
    """A part's share of a node's cost: that fraction of each time and byte count."""
    return dataclasses.replace(
        cost, fwd_s=cost.fwd_s * fraction, bwd_s=cost.bwd_s * fraction,
        out_bytes=round(cost.out_bytes * fraction), param_bytes=round(cost.param_bytes * fraction),
        saved_bytes=round(cost.saved_bytes * fraction),
        new_bytes=None if cost.new_bytes is None else round(cost.new_bytes * fraction))


def _bytes(gm: fx.GraphModule, weight: fx.Node) -> int:
    """The bytes of a weight a parameter read gives (0 where the graph does not hold it)."""
    value = attr_value(gm, weight.target) if weight.op == "get_attr" else None
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _read(graph: fx.Graph, value: fx.Node | str | None) -> fx.Node | None:
    """A call_module's parameter (its qualified name) as a `get_attr` node; nodes as they are."""
    return graph.get_attr(value) if isinstance(value, str) else value


def _split_of(gm: fx.GraphModule, node: fx.Node) -> _Split | None:
    """How `node` splits along its output features, or None when it does not."""
    args, kwargs = tuple(node.args), dict(node.kwargs)
    if node.meta.get("state"):      # touches a buffer written in forward: its unit stays whole
        return None
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if type(module) not in (nn.Linear, nn.Conv2d) or _hooked(module) or len(args) != 1 or (
                kwargs):
            return None
        weight, bias = f"{node.target}.weight", (
            f"{node.target}.bias" if module.bias is not None else None)
        if type(module) is nn.Linear:
            return _Split(module.out_features, F.linear, (args[0], None, None), {}, weight,
                          _Place(1, "weight"), 0, bias, _Place(2, "bias"), 0, -1)
        if type(module) is nn.Conv2d and module.groups == 1 and module.padding_mode == "zeros":
            return _Split(module.out_channels, F.conv2d,
                          (args[0], None, None, module.stride, module.padding, module.dilation),
                          {}, weight, _Place(1, "weight"), 0, bias, _Place(2, "bias"), 0, -3)
        return None
    if node.op != "call_function":
        return None
    target = node.target
    if target in _LINEAR or target in _CONV2D:
        weight_at, bias_at = _Place(1, "weight"), _Place(2, "bias")
        weight, bias = weight_at.read(args, kwargs), bias_at.read(args, kwargs)
        shape = _shape(gm, weight)
        if shape is None or len(shape) != (2 if target in _LINEAR else 4) or (
                target in _CONV2D and _Place(6, "groups").read(args, kwargs) not in (None, 1)):
            return None
        return _Split(shape[0], target, args, kwargs, weight, weight_at, 0, bias, bias_at, 0,
                      -1 if target in _LINEAR else -3)
    if target in _ADDMM or target in _MATMUL:
        weight_at = _Place(2, "mat2") if target in _ADDMM else _Place(1, "mat2")
        weight = weight_at.read(args, kwargs)
        shape = _shape(gm, weight)
        if shape is None or len(shape) != 2:
            return None
        bias, bias_at = None, None
        if target in _ADDMM:          # a bias broadcast along the features stays whole
            bias_shape = _shape(gm, args[0])
            if bias_shape and bias_shape[-1] == shape[1] and shape[1] > 1:
                bias, bias_at = args[0], _Place(0, "input")
        return _Split(shape[1], target, args, kwargs, weight, weight_at, -1, bias, bias_at, -1,
                      -1)
    return None


def _shape(gm: fx.GraphModule, value: Any) -> tuple[int, ...] | None:
    """The shape of a node's value where the graph knows it: a parameter read, or the value
    a front-end recorded (`val`, `tensor_meta`)."""
    if not isinstance(value, fx.Node):
        return None
    if value.op == "get_attr":
        found = attr_value(gm, value.target)
    else:
        found = value.meta.get("val", value.meta.get("tensor_meta"))
    shape = getattr(found, "shape", None)
    return tuple(shape) if shape is not None and all(isinstance(d, int) for d in shape) else None


def _hooked(module: nn.Module) -> bool:
    """Whether hooks on `module` would no longer fire once it is split into functional calls."""
    return any(getattr(module, attr) for attr in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))
