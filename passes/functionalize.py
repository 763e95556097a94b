"""Replace in-place tensor ops by out-of-place ones, so every value is written once.

Stages hand tensors to each other by reference. An in-place op (`out += identity`,
`nn.ReLU(inplace=True)`, `x[:, 0] = y`) would then change a value another stage is still reading,
and it hides a dependency the partitioner must see (later readers of `x` need the mutation). This
pass rewrites each in-place op `y = f_(x)` as `y = f(x)` and points every later reader of `x` at `y`,
turning the hidden dependency into an edge. Mutations of views are left alone (their base would
also change); see DESIGN.md.

Export graphs spell in-place ops in ATen (`aten.relu_.default`, `aten.add_.Tensor`): those whose
schema writes their first argument become their out-of-place overload. Writes to parameters and
buffers (`get_attr` nodes, e.g. BatchNorm's `num_batches_tracked.add_(1)` in train mode) are state
updates the model keeps, and stay.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx

_INPLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod, operator.ipow: operator.pow, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor, operator.imatmul: operator.matmul,
    operator.ilshift: operator.lshift, operator.irshift: operator.rshift,
}
_VIEW_METHODS = {"view", "view_as", "reshape", "transpose", "permute", "t", "narrow", "select",
                 "expand", "expand_as", "squeeze", "unsqueeze", "unflatten", "flatten", "split",
                 "chunk", "unbind", "as_strided", "diagonal", "movedim", "unfold", "detach"}


def setitem(x: torch.Tensor, index, value) -> torch.Tensor:
    """`x[index] = value` without writing on `x`: returns the updated copy."""
    out = x.clone()
    out[index] = value
    return out


def functionalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite `gm`'s in-place ops out of place, in place on `gm`; returns `gm`.

    In-place submodules without parameters (`nn.ReLU(inplace=True)`) are replaced in `gm` by copies
    with `inplace=False`; the user's model is not touched.
    """
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        mutated = _mutated_input(gm, node)
        if mutated is None or _is_view(mutated) or mutated.op == "get_attr":
            continue
        if isinstance(node.target, torch._ops.OpOverload):
            node.target = _out_of_place_aten(node.target)
        elif node.op == "call_function" and node.target in _INPLACE_OPERATORS:
            node.target = _INPLACE_OPERATORS[node.target]
        elif node.op == "call_function" and node.target is operator.setitem:
            node.target = setitem
        elif node.op == "call_function":
            node.target = getattr(torch, node.target.__name__[:-1])
        elif node.op == "call_method":
            node.target = node.target[:-1]
        elif node.op == "call_module":
            module = copy.deepcopy(gm.get_submodule(node.target))
            module.inplace = False
            _set_submodule(gm, node.target, module)
        _read_after(node, mutated, position)
    gm.graph.lint()
    gm.recompile()
    return gm


def _mutated_input(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The node whose value `node` writes in place, if `node` is a known in-place op."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        inplace = _out_of_place_aten(target) is not None
    elif node.op == "call_function":
        inplace = (target in _INPLACE_OPERATORS or target is operator.setitem or
                   (getattr(target, "__module__", None) in ("torch", "torch._C._VariableFunctions")
                    and callable(getattr(torch, getattr(target, "__name__", "")[:-1] or "_", None))
                    and target.__name__.endswith("_") and not target.__name__.startswith("_")))
    elif node.op == "call_method":
        inplace = (target.endswith("_") and not target.startswith("_")
                   and hasattr(torch.Tensor, target[:-1]))
    elif node.op == "call_module":
        module = gm.get_submodule(target)
        inplace = getattr(module, "inplace", False) is True and not any(
            True for _ in module.parameters())
    else:
        inplace = False
    if not inplace:
        return None
    # `x += y` on a non-tensor (an int from x.size(0)) is not a mutation.
    value = node.args[0].meta.get("example_value", node.args[0].meta.get("val"))
    return node.args[0] if value is None or isinstance(value, torch.Tensor) else None


def _is_view(node: fx.Node) -> bool:
    if isinstance(node.target, torch._ops.OpOverload):   # ATen: its result aliases an input
        return any(r.alias_info is not None for r in node.target._schema.returns)
    return ((node.op == "call_method" and node.target in _VIEW_METHODS) or
            (node.op == "call_function" and node.target in (operator.getitem, torch.flatten,
                                                            torch.transpose, torch.narrow)))


def _out_of_place_aten(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """`aten.relu.default` for `aten.relu_.default`: the same overload without the write, if any."""
    schema = op._schema
    name = schema.name.split("::")[-1]
    first = schema.arguments[0].alias_info if schema.arguments else None
    if not name.endswith("_") or name.startswith("_") or first is None or not first.is_write:
        return None
    packet = getattr(getattr(torch.ops, op.namespace), name[:-1], None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def _read_after(node: fx.Node, mutated: fx.Node, position: dict[fx.Node, int]) -> None:
    """Point every reader of `mutated` that comes after `node` at `node`'s (updated) value."""
    for user in list(mutated.users):
        if position[user] > position[node]:
            user.replace_input_with(mutated, node)


def _set_submodule(gm: fx.GraphModule, target: str, module: torch.nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, module)
