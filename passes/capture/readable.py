"""Graphs that read like the model: an export graph made readable (`readable`), the module a
node ran in (`module_path`), and the model's state kept as the model holds it.

An export graph is made readable before anyone sees it: nodes are named after the module they
ran in (`model_layers_0_self_attn_q_proj`, `model_layers_0_mlp_mul`), each parameter is read
(`get_attr`) just before its first use, and export's own checks, which pin the example's
device, are dropped. It keeps export's calling convention: it takes and returns what the model
does (see `fxpipe.passes.signature`).
"""

from __future__ import annotations

import copy
import re
from collections import Counter

import torch
import torch.fx as fx
from torch import nn

def readable(exported: fx.GraphModule, class_name: str) -> fx.GraphModule:
    """`ExportedProgram.module()` as a plain GraphModule that reads like the model.

    Nodes are named after their module, each `get_attr` sits just before its first user (dead
    ones go), and export's checks go: `_guards_fn` and `_assert_tensor_metadata` assert the
    example's device, and a pipeline moves stages to other devices. The graph keeps export's
    codegen, so the module takes and returns what the model does. A plain GraphModule, unlike
    `_StatefulGraphModule`, accepts `.train()` (which cannot change the captured mode).
    """
    graph = fx.Graph()
    graph._codegen = copy.copy(exported.graph._codegen)
    names = _module_names(exported.graph)
    env: dict[fx.Node, fx.Node] = {}

    def value(n: fx.Node) -> fx.Node:
        if n not in env:               # a get_attr, first used here
            env[n] = graph.node_copy(n)
        return env[n]

    for n in exported.graph.nodes:
        if n.op == "get_attr" or _is_export_check(n):
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), value)
        env[n] = graph.create_node(n.op, n.target, args, kwargs, name=names.get(n, n.name),
                                   type_expr=n.type)
        env[n].meta = dict(n.meta)
    for module in exported.modules():  # export's checks inside higher-order ops' bodies, too
        if isinstance(module, fx.GraphModule) and module is not exported:
            for n in list(module.graph.nodes):
                if _is_export_check(n) and not n.users:
                    module.graph.erase_node(n)
            module.recompile()
    gm = fx.GraphModule(exported, graph, class_name)
    _copy_state(exported, gm)
    return gm


def _is_export_check(n: fx.Node) -> bool:
    return ((n.op == "call_module" and n.target == "_guards_fn") or
            n.target is torch.ops.aten._assert_tensor_metadata.default)


def _module_names(graph: fx.Graph) -> dict[fx.Node, str]:
    """A name for each call_function node from the module it ran in.

    The only op of a module takes the module's name (`model_layers_0_self_attn_q_proj`), others
    add their op (`model_layers_0_mlp_mul`); the graph numbers repeats. Top-level ops keep theirs.
    """
    paths = {n: module_path(n) for n in graph.nodes if n.op == "call_function"}
    ops_in = Counter(paths.values())
    names = {}
    for n, path in paths.items():
        if path:
            stem = re.sub(r"\W+", "_", path).strip("_")
            names[n] = stem if ops_in[path] == 1 else f"{stem}_{re.sub(r'_[0-9]+$', '', n.name)}"
    return names


def module_path(node: fx.Node) -> str:
    """The qualified name of the innermost module `node` ran in; "" at the model's top level.

    Works for fx graphs (a `call_module` node's target, else `nn_module_stack`) and export graphs.
    """
    if node.op == "call_module":
        return node.target
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if not path.startswith("_empty_nn_module_stack")]
    return re.sub(r"@[0-9]+$", "", paths[-1]) if paths else ""


def _copy_state(source: nn.Module, target: fx.GraphModule) -> None:
    """Give `target` the parameters and buffers of `source`, under the same names, in its order.

    `fx.GraphModule` copies only what nodes reference, in node order, and registers every tensor
    as a persistent buffer. The pipeline must hold the model's state as the model does: unused
    parameters too, non-persistent buffers (and export's lifted constants) out of `state_dict()`,
    and a tied parameter under the model's first name for it.
    """
    bodies = {name: child for name, child in target.named_children()
              if isinstance(child, fx.GraphModule)}       # higher-order ops' bodies
    for name in [*target._modules, *target._parameters, *target._buffers]:
        delattr(target, name)
    for path, module in source.named_modules(remove_duplicate=False):
        if isinstance(module, fx.GraphModule) and module is not source:
            continue
        owner = target
        for part in path.split(".") if path else ():
            if not isinstance(getattr(owner, part, None), nn.Module):
                setattr(owner, part, nn.Module())
            owner = getattr(owner, part)
        for name, p in module._parameters.items():
            if p is not None:
                owner.register_parameter(name, p)
        for name, b in module._buffers.items():
            owner.register_buffer(name, b, persistent=name not in module._non_persistent_buffers_set)
        for name, v in vars(module).items():   # lifted constants: plain tensor attributes
            if isinstance(v, torch.Tensor) and not name.startswith("_"):
                owner.register_buffer(name, v, persistent=False)
    for name, body in bodies.items():
        setattr(target, name, body)


def keep_non_persistent(source: nn.Module, target: fx.GraphModule) -> None:
    """Mark non-persistent in `target` the buffers `source` holds as non-persistent, and the
    tensor constants tracing made (`_tensor_constant0`: a `torch.tensor(...)` in forward):
    `fx.GraphModule` registers every tensor it copies as a persistent buffer, and the
    pipeline's `state_dict()` must be the model's (a rotary `inv_freq` is in no checkpoint,
    a constant in no model's `state_dict`)."""
    own = {name for name, _ in source.named_parameters(remove_duplicate=False)} | {
        name for name, _ in source.named_buffers(remove_duplicate=False)}
    for path, owner in target.named_modules(remove_duplicate=False):
        for name in owner._buffers:
            if ".".join(filter(None, (path, name))) not in own:
                owner._non_persistent_buffers_set.add(name)
    for path, module in source.named_modules(remove_duplicate=False):
        for name in module._non_persistent_buffers_set:
            try:
                owner = target.get_submodule(path)
            except AttributeError:
                continue
            if owner is not module and name in owner._buffers:
                owner._non_persistent_buffers_set.add(name)
