"""An exported graph's context regions as module calls, so that they survive pickling.

torch.export keeps a `with torch.autocast(...)` or `with torch.no_grad()` block of the model as
one call of a higher-order op (`wrap_with_autocast`, `wrap_with_set_grad_enabled`) on a
submodule holding the block's ops. A `GraphModule` pickles as its generated code, and unpickling
traces that code again: the op then runs its block once, on proxies, and the trace records the
submodule's call without its context. A plan saved and loaded would run the block in the
caller's precision and grad mode: outputs and gradients silently not the model's.

`regions_as_modules(gm)` is `gm` with each such call replaced by the call of a `Region`
module, which enters the same context around the same submodule: a module call is what
unpickling records, and a `Region` is a leaf there. `gm` itself is left as it is.

This is how `with_weights` copies stages through pickle, and how format-4 plans were pickled
(`saved._picklable`); format 5 saves the graph itself as data, so its ops keep their region.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled


class Region(nn.Module):
    """`body(*args)` under a context: `torch.autocast(*autocast)`, or grad mode `grad`."""

    def __init__(self, body: nn.Module, *, autocast: tuple | None = None,
                 grad: bool | None = None):
        super().__init__()
        self.body = body
        self.autocast = autocast
        self.grad = grad

    def forward(self, *args: Any) -> Any:
        if self.autocast is not None:
            with torch.autocast(*self.autocast):
                return self.body(*args)
        with torch.set_grad_enabled(self.grad):
            return self.body(*args)

    def extra_repr(self) -> str:
        return (f"autocast={self.autocast}" if self.autocast is not None
                else f"grad={self.grad}")


def _has_regions(gm: nn.Module) -> bool:
    return any(isinstance(m, fx.GraphModule) and any(
        n.op == "call_function" and n.target in (wrap_with_autocast, wrap_with_set_grad_enabled)
        for n in m.graph.nodes) for m in gm.modules())


def regions_as_modules(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm`, or where it (or a region inside it) calls a context region, a copy calling
    `Region` modules instead; tensors and other submodules are shared, not copied."""
    if not _has_regions(gm):
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = fx.GraphModule(gm, graph, gm.__class__.__name__)
    copy.meta = gm.meta
    for node in list(copy.graph.nodes):
        if node.op != "call_function" or node.target not in (wrap_with_autocast,
                                                               wrap_with_set_grad_enabled):
            continue
        if node.target is wrap_with_autocast:      # (device, dtype, enabled, cache, body, *args)
            make, body, args = dict(autocast=tuple(node.args[:4])), node.args[4], node.args[5:]
        else:                                      # (enabled, body, *args)
            make, body, args = dict(grad=bool(node.args[0])), node.args[1], node.args[2:]
        name = _fresh(copy, f"region_{body.target}")
        copy.add_submodule(name, Region(regions_as_modules(copy.get_submodule(body.target)),
                                        **make))
        with copy.graph.inserting_before(node):
            call = copy.graph.call_module(name, tuple(args), dict(node.kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        copy.graph.erase_node(node)
        if not body.users:
            copy.graph.erase_node(body)
    copy.delete_all_unused_submodules()
    copy.recompile()
    return copy


def _fresh(gm: nn.Module, name: str) -> str:
    taken = dict(gm.named_children())
    if name not in taken:
        return name
    return next(f"{name}_{i}" for i in range(1, len(taken) + 2) if f"{name}_{i}" not in taken)
