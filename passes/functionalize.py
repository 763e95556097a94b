"""Replace in-place tensor ops by out-of-place ones, so every value is written once.

Stages hand tensors to each other by reference. An in-place op (`out += identity`,
`nn.ReLU(inplace=True)`, `F.relu(h, inplace=True)`, `x[:, 0] = y`, `h.zero_()`) would then change
a value another stage is still reading, and it hides a dependency the partitioner must see (later
readers of `x` need the mutation). This pass rewrites each in-place op `y = f_(x)` as `y = f(x)`
and points every later reader of `x` at `y`, turning the hidden dependency into an edge.

When `x` is a view (`m[..., a:b] = c` after `m = h.new_zeros(...)`, export's `aten.slice` then
`fill_`), the write also changes what `x` views: as torch's own functionalization does, the
updated view is written back into each value it views (`slice_scatter`, `select_scatter`,
`setitem`, a reshape...) and later readers of those read the result. A write that other values
still see (a view taken before the write and read after it) raises a `TraceError` naming the line
and the fix, and so does a write on a model input: the pipeline runs on micro-batches cut from
the inputs and would not write the caller's tensor. Aliases are found from real storage when
example inputs are given (the graph runs once on copies of them, random generators restored),
else, conservatively, by name (view ops, `getitem`, `nn.Identity`...).

Export graphs spell in-place ops in ATen (`aten.relu_.default`, `aten.add_.Tensor`): those whose
schema writes their first argument become their out-of-place overload. Writes to parameters and
buffers (`get_attr` nodes and their views, e.g. BatchNorm's `num_batches_tracked.add_(1)` in train
mode) are state updates the model keeps, and stay; later reads of that state read it through
the write (`fxpipe.passes.state.order_state_reads`).

Example (an in-place `add_` becomes `add`, read by what read its input after it):

>>> import torch
>>> from torch import fx, nn
>>> from fxpipe.passes.functionalize import functionalize
>>> class Shifted(nn.Module):
...     def forward(self, x):
...         y = x * 2
...         y.add_(1)
...         return y.relu()
>>> gm = fx.symbolic_trace(Shifted())
>>> [n.target for n in gm.graph.nodes if n.op == "call_method"]
['add_', 'relu']
>>> gm = functionalize(gm, (torch.randn(3),))
>>> [n.target for n in gm.graph.nodes if n.op == "call_method"]
['add', 'relu']
>>> x = torch.randn(3)
>>> torch.equal(gm(x), Shifted()(x))
True
"""

from __future__ import annotations

import copy
import inspect
import operator
import weakref
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from .device import forked_generators, generators_of
from .errors import FxpipeError, TraceError
from .graph_values import attr_value, tensors
from .materialize import Materialize, MaterializingInterpreter
from .signature import signature_of
from .state import order_state_reads, unchanged_state
from .user_code import describe_frame, user_frame

_INPLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod, operator.ipow: operator.pow, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor, operator.imatmul: operator.matmul,
    operator.ilshift: operator.lshift, operator.irshift: operator.rshift,
}
# In-place random draws: no out-of-place method does the same (`x.bernoulli()` draws from x).
_RANDOM_WRITES = {"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_",
                  "cauchy_", "log_normal_"}
_WRITES_WITHOUT_OUT_OF_PLACE = {"zero_", "fill_", "copy_"} | _RANDOM_WRITES

# Ops whose result may share memory with their first input, for the check by name.
_VIEW_NAMES = {"view", "view_as", "reshape", "reshape_as", "transpose", "swapaxes", "swapdims",
               "permute", "t", "narrow", "select", "expand", "expand_as", "squeeze", "unsqueeze",
               "unflatten", "flatten", "split", "split_with_sizes", "tensor_split", "chunk",
               "unbind", "as_strided", "diagonal", "movedim", "moveaxis", "unfold", "detach",
               "contiguous", "to", "type_as", "view_as_real", "view_as_complex", "real", "imag",
               "dropout", "alpha_dropout", "feature_alpha_dropout"}
_VIEW_ATTRIBUTES = {"T", "mT", "H", "mH", "real", "imag", "data"}
_VIEW_FUNCTIONS = ({getattr(torch, n) for n in _VIEW_NAMES if hasattr(torch, n)} |
                   {operator.getitem, F.dropout, F.dropout1d, F.dropout2d, F.dropout3d,
                    F.alpha_dropout, F.feature_alpha_dropout})
_VIEW_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd)


def setitem(x: torch.Tensor, index, value) -> torch.Tensor:
    """`x[index] = value` without writing on `x`: returns the updated copy."""
    out = x.clone()
    out[index] = value
    return out


def copy_into(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`x.copy_(src)` without writing on `x`: `src` broadcast to `x`'s shape, dtype and device."""
    return src.to(x.device, x.dtype).expand_as(x).clone()


def on_copy(x: torch.Tensor, method: str, *args, **kwargs) -> torch.Tensor:
    """`x.<method>(*args)` applied to a copy of `x` (e.g. `uniform_`): the same random draws."""
    return getattr(x.clone(), method)(*args, **kwargs)


def functionalize(gm: fx.GraphModule, args: tuple | None = None,
                  kwargs: Mapping[str, Any] | None = None, *,
                  materialize: Materialize | None = None) -> fx.GraphModule:
    """Rewrite `gm`'s in-place ops out of place, in place on `gm`; returns `gm`.

    `args`/`kwargs`, the model's example inputs, let the pass see which values share memory: the
    graph runs once on copies of them (buffers restored). Without them, aliases are judged by op
    name. An in-place op on memory that another, still read, value shares raises `TraceError`.
    In-place submodules without parameters (`nn.ReLU(inplace=True)`) are replaced in `gm` by copies
    with `inplace=False`; the user's model is not touched. A graph holding meta tensors runs
    with `materialize` giving each node's weights (`fxpipe.passes.materialize`).
    """
    storages: dict[fx.Node, set] | None = None
    if args is None and kwargs is None:
        aliases_of = _aliases_by_name(gm)
        holds_tensor = _holds_tensor_by_meta
        is_tensor = lambda node: isinstance(_meta_value(node), torch.Tensor)  # noqa: E731
        same_value = lambda a, b: a is b  # noqa: E731
    else:
        values, storages, freed_at = _run_example(gm, tuple(args or ()), kwargs, materialize)
        # Whether a freed weight's memory could only be `b`'s by reuse (the graph as it ran;
        # a node the rewrite below adds may alias anything).
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        apart = lambda a, b: a in order and b in order and (  # noqa: E731
            freed_at.get(a, len(order)) < order[b] or freed_at.get(b, len(order)) < order[a])
        aliases_of = lambda node: [n for n, s in storages.items()  # noqa: E731
                                   if s & storages.get(node, set()) and not apart(n, node)]
        is_tensor = holds_tensor = lambda node: isinstance(  # noqa: E731
            values.get(node), torch.Tensor)
        same_value = lambda a, b: values.get(a) is values.get(b)  # noqa: E731
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    state_writes = []
    for node in list(gm.graph.nodes):
        mutated = _mutated_input(gm, node)
        if mutated is None or not holds_tensor(mutated):
            continue
        aliases = aliases_of(mutated)
        if any(a.op == "get_attr" for a in [mutated, *aliases]):
            # a parameter or buffer update: the model's state, kept as written (passes/state.py)
            state_writes.append((node, mutated, list(dict.fromkeys([mutated, *aliases]))))
            continue
        written_inputs = [a for a in [mutated, *aliases] if a.op == "placeholder"]
        if written_inputs:
            raise _input_write_error(node, mutated, written_inputs[0])
        chain = _view_chain(mutated, is_tensor, storages)
        for alias in aliases:
            if (alias not in chain and position[alias] < position[node] and
                    any(position[user] > position[node] for user in alias.users)):
                raise _aliased_write_error(node, mutated, alias)
        _write_out_of_place(gm, node)
        for old, new in _write_back(gm, node, chain, position):
            if storages is not None:            # the updated base is the base's memory, in eager
                storages[new] = storages[old]
                values[new] = values[old]
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
    order_state_reads(gm, state_writes, same_value)
    if gm.meta.get("input_writes"):      # found by trace's run of the model, shown by no node
        name = gm.meta["input_writes"][0]
        raise TraceError(
            f"forward writes in place on its input {name!r} (e.g. `{name} += 1`)\na pipeline runs "
            f"the model on micro-batches cut from the inputs, so it would not write the caller's "
            f"tensor as the model does\nwrite it out of place (`{name} = {name} + 1`), or copy "
            f"the input first: `{name} = {name}.clone()`")
    gm.graph.lint()
    gm.recompile()
    return gm


def _mutated_input(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The node whose value `node` writes in place, if `node` is a known in-place op."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        first = target._schema.arguments[0].alias_info if target._schema.arguments else None
        name = _aten_base_name(target)
        inplace = (first is not None and first.is_write and name is not None and
                   (_out_of_place_aten(target) is not None or hasattr(torch.Tensor, name)))
    elif node.op in ("call_function", "call_method") and _inplace_flag(node) is not None:
        inplace = True
    elif node.op == "call_function":
        inplace = (target in _INPLACE_OPERATORS or target is operator.setitem or
                   (getattr(target, "__module__", None) in ("torch", "torch._C._VariableFunctions")
                    and _writes_data(getattr(target, "__name__", ""), torch)))
    elif node.op == "call_method":
        inplace = _writes_data(target, torch.Tensor)
    elif node.op == "call_module":
        module = gm.get_submodule(target)
        inplace = getattr(module, "inplace", False) is True and not any(
            True for _ in module.parameters())
    else:
        inplace = False
    return node.args[0] if inplace else None


def _writes_data(name: str, namespace: Any) -> bool:
    """Whether `name` is an in-place op on tensor data: `add_` next to a callable `add`, or one of
    the writes with no same-name out-of-place op (`zero_`, `copy_`, `uniform_`...). Not
    `requires_grad_` (`requires_grad` is a property) nor other bookkeeping."""
    return (name.endswith("_") and not name.startswith("_") and
            (name in _WRITES_WITHOUT_OUT_OF_PLACE or callable(getattr(namespace, name[:-1], None))))


def _inplace_flag(node: fx.Node) -> str | int | None:
    """Where `node` passes `inplace=True` (`F.relu(h, inplace=True)`): the keyword or the
    position; None if it does not."""
    if node.kwargs.get("inplace") is True:
        return "inplace"
    if node.op != "call_function":
        return None
    try:
        names = list(inspect.signature(node.target).parameters)
    except (TypeError, ValueError):       # a builtin without a Python signature
        return None
    i = names.index("inplace") if "inplace" in names else len(node.args)
    return i if i < len(node.args) and node.args[i] is True else None


def _write_out_of_place(gm: fx.GraphModule, node: fx.Node) -> None:
    """Turn the in-place op `node` into the out-of-place op that returns the written value."""
    target, (x, *rest) = node.target, node.args
    flag = None if node.op == "call_module" or isinstance(target, torch._ops.OpOverload) else (
        _inplace_flag(node))
    if isinstance(target, torch._ops.OpOverload):
        functional = _out_of_place_aten(target)
        if _aten_base_name(target) == "copy_":      # aten.copy has no derivative
            _become(node, copy_into, (x, rest[0] if rest else node.kwargs["src"]), {})
        elif functional is not None:
            node.target = functional
        else:                                      # e.g. aten.normal_: no functional overload
            _become(node, on_copy, (x, _aten_base_name(target), *rest))
    elif flag == "inplace":
        node.kwargs = {**node.kwargs, "inplace": False}
    elif flag is not None:
        node.args = (*node.args[:flag], False, *node.args[flag + 1:])
    elif node.op == "call_module":
        module = copy.deepcopy(gm.get_submodule(target))
        module.inplace = False
        _set_submodule(gm, target, module)
    elif target in _INPLACE_OPERATORS:
        node.target = _INPLACE_OPERATORS[target]
    elif target is operator.setitem:
        node.target = setitem
    else:                                          # `x.add_(y)` or `torch.relu_(x)`
        name = target if node.op == "call_method" else target.__name__
        if name == "zero_":
            _become(node, torch.zeros_like, (x,), {})
        elif name == "fill_":
            _become(node, torch.fill, (x, *rest))
        elif name == "copy_":
            _become(node, copy_into, (x, rest[0] if rest else node.kwargs["src"]), {})
        elif name in _RANDOM_WRITES:
            _become(node, on_copy, (x, name, *rest))
        elif node.op == "call_method":
            node.target = name[:-1]
        else:
            node.target = getattr(torch, name[:-1])


def _become(node: fx.Node, fn: Callable, args: tuple, kwargs: dict | None = None) -> None:
    node.op, node.target, node.args = "call_function", fn, args
    if kwargs is not None:
        node.kwargs = kwargs


class GraphRunFailed(TraceError):
    """The graph failed to run on the example's values (not a fault of its shape): a graph
    run on unfilled values may still run on plausible ones."""


RUN_FAILED = "functionalize could not run the graph on the example inputs"


def _run_example(gm: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any] | None,
                 materialize: Materialize | None
                 ) -> tuple[dict[fx.Node, Any], dict[fx.Node, set], dict[fx.Node, int]]:
    """Every node's value on copies of the example inputs, all kept alive (so no two values'
    storages can be the same memory reused), and the storages of each. Buffers the run updates,
    and the random generators it draws from, are restored.

    Meta weights are given by `materialize` on the inputs' device, node by node; there a value
    is dropped after its last reader (`_WeightsFreed`; its value a meta tensor after), and the
    third dict gives the position in the graph after which its memory may be another value's."""
    inputs = pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                             signature_of(gm).flatten_inputs(args, kwargs))
    device = next((t.device for t in tensors(inputs)), torch.device("cpu"))
    interpreter = _WeightsFreed(gm, materialize=materialize, device=device)
    generators = generators_of(t.device for t in [*gm.parameters(), *gm.buffers(),
                                                  *tensors(inputs)])
    try:
        with unchanged_state(gm), torch.no_grad(), forked_generators(generators):
            interpreter.run(*inputs)
    except FxpipeError:         # the weights' own (a tensor missing from a checkpoint), as it is
        raise
    except Exception as e:
        raise GraphRunFailed(f"{RUN_FAILED}\n{type(e).__name__}: {e}") from e
    storages = {node: _storages(value) for node, value in interpreter.env.items()}
    storages.update({node: found for node, (found, _) in interpreter.dropped.items()})
    return interpreter.env, storages, {node: at for node, (_, at) in interpreter.freed.items()}


class _WeightsFreed(MaterializingInterpreter):
    """Runs a graph keeping every value, but for a graph holding meta tensors (planned without
    being held), a value is kept only until its last reader has run (one without readers, once
    it ran), so neither the model's weights nor its activations are held whole: a decoder's
    activations grow with its layers, and each layer's attention reads its whole key/value
    cache. The value's storages are noted then, and the node's value becomes a meta tensor of
    its type (a `get_attr`'s, the model's meta tensor itself; one object stays one object).
    Its memory may be another value's only once nothing holds it (a view made from it may
    outlive it): `freed` gives each such value's storages and the position of the node after
    which they were gone."""

    def __init__(self, gm: fx.GraphModule, **kwargs: Any):
        super().__init__(gm, garbage_collect_values=False, **kwargs)
        self.freed: dict[fx.Node, tuple[set, int]] = {}
        self.position = {node: i for i, node in enumerate(gm.graph.nodes)}
        self.dropped: dict[fx.Node, tuple[set, list]] = {}   # storages, and weak references
        self.waiting: dict[tuple[str, int], set[fx.Node]] = {}    # by storage: dropped, held
        self.on_meta: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if self.materialize is None or n.op == "output":
            return result
        done = [p for p in n.all_input_nodes
                if p in self.env and max(p.users, key=self.position.__getitem__) is n]
        if not n.users:
            self.env[n] = result
            done.append(n)
        for p in done:
            self._drop(p)
        for key in {key for p in done for key in self.dropped[p][0]}:
            for p in list(self.waiting.get(key, ())):
                if all(ref() is None for ref in self.dropped[p][1]):
                    self.freed[p] = (self.dropped[p][0], self.position[n])
                    for other in self.dropped[p][0]:
                        self.waiting[other].discard(p)
        return self.env[n] if not n.users else result     # (the run stores it)

    def _drop(self, p: fx.Node) -> None:
        """`p`'s value no longer kept: noted, and a meta tensor of its type in its place."""
        value, found = self.env[p], _storages(self.env[p])
        self.dropped[p] = (found, [weakref.ref(t.untyped_storage()) for t in tensors(value)
                                   if t.layout == torch.strided and not t.is_meta])
        for key in found:
            self.waiting.setdefault(key, set()).add(p)
        weight = attr_value(self.module, p.target) if p.op == "get_attr" else None
        meta = isinstance(weight, torch.Tensor) and weight.is_meta
        self.env[p] = weight if meta else pytree.tree_map(self._meta_of, value)

    def _meta_of(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.is_meta:
            return value
        ref, meta = self.on_meta.get(id(value), (None, None))
        if ref is None or ref() is not value:
            meta = torch.empty_like(value, device="meta")
            self.on_meta[id(value)] = (weakref.ref(value), meta)
        return meta


def _storages(value: Any) -> set[tuple[str, int]]:
    found = set()
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
            pointer = leaf.untyped_storage().data_ptr()
            if pointer:                        # empty tensors share the null pointer
                found.add((str(leaf.device), pointer))
    return found


def _aliases_by_name(gm: fx.GraphModule) -> Callable[[fx.Node], set[fx.Node]]:
    """`node` -> the nodes linked to it by ops that may return a view (itself included):
    conservative, for graphs that were not run."""
    def aliases(node: fx.Node) -> set[fx.Node]:
        seen, todo = {node}, [node]
        while todo:
            n = todo.pop()
            linked = [u for u in n.users if _is_view(gm, u) and u.args and u.args[0] is n]
            if _is_view(gm, n) and n.args and isinstance(n.args[0], fx.Node):
                linked.append(n.args[0])
            todo += [m for m in linked if m not in seen]
            seen.update(linked)
        return seen
    return aliases


def _is_view(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node`'s result may share memory with its first input, judged by the op."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):   # ATen: its result aliases an input
        return any(r.alias_info is not None for r in target._schema.returns)
    if node.op == "call_method":    # an in-place op left as it is returns its input
        return target in _VIEW_NAMES or target.endswith("_")
    if node.op == "call_function" and target is getattr:
        return len(node.args) > 1 and node.args[1] in _VIEW_ATTRIBUTES
    if node.op == "call_function":
        return target in _VIEW_FUNCTIONS
    return node.op == "call_module" and isinstance(gm.get_submodule(target), _VIEW_MODULES)


def _holds_tensor_by_meta(node: fx.Node) -> bool:
    """False only when the tracer recorded a non-tensor (`n += 1` on an int from `x.size(0)`)."""
    value = _meta_value(node)
    return value is None or isinstance(value, torch.Tensor)


def _meta_value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _aliased_write_error(node: fx.Node, mutated: fx.Node, alias: fx.Node) -> TraceError:
    where = _source_line(node)
    return TraceError(
        f"node {node.name!r} writes in place on {mutated.name!r}, then read as {alias.name!r}\n"
        f"node {node.name!r}: {node.format_node()}; {alias.name!r} shares the memory of "
        f"{mutated.name!r} (a view, or the base of one) and is read afterwards"
        f"{':' if where else '.'}\n{where}"
        f"fxpipe rewrites in-place ops out of place so pipeline stages can share tensors, which "
        f"would lose this write\nwrite it out of place and use the result where the updated "
        f"value is wanted: e.g. `h = h + 1` instead of `h.add_(1)` on a view, or "
        f"`x = torch.relu(x)` instead of `inplace=True`")


def _input_write_error(node: fx.Node, mutated: fx.Node, placeholder: fx.Node) -> TraceError:
    name = str(placeholder.target).lstrip("*")
    where = _source_line(node)
    hint = _out_of_place_hint(node, name) if mutated is placeholder else ""
    return TraceError(
        f"forward writes in place on its input {name!r} (node {node.name!r})\n"
        f"node {node.name!r}: {node.format_node()}{':' if where else '.'}\n{where}"
        f"a pipeline runs the model on micro-batches cut from the inputs, so it would not write "
        f"the caller's tensor as the model does\nwrite it out of place and use the result"
        f"{hint}, or copy the input first: `{name} = {name}.clone()`")


def _out_of_place_hint(node: fx.Node, name: str) -> str:
    """`, e.g. `x = x.mul(...)` instead of `x.mul_(...)``: the rewrite of `node`'s op, where
    it has a plain spelling."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        op = _aten_base_name(target)
    elif node.op == "call_method":
        op = target
    else:
        op = getattr(target, "__name__", None) if node.op == "call_function" else None
    if node.op == "call_module" or _inplace_flag(node) is not None:
        return " (pass inplace=False)"
    if target in _INPLACE_OPERATORS:
        return f", e.g. `{name} = {name} + 1` instead of `{name} += 1`"
    if op and op.endswith("_") and op not in _WRITES_WITHOUT_OUT_OF_PLACE:
        return f", e.g. `{name} = {name}.{op[:-1]}(...)` instead of `{name}.{op}(...)`"
    return ""


def _source_line(node: fx.Node) -> str:
    """`File "model.py", line 12, in forward` and its code, indented, from the stack trace
    `node` recorded (see `fxpipe.passes.user_code`), or '' when none was recorded."""
    frame = user_frame(node)
    return describe_frame(frame) + "\n" if frame is not None else ""


def _aten_base_name(op: torch._ops.OpOverload) -> str | None:
    """`relu_` for `aten.relu_.default`: the op's name, if it looks like an in-place op."""
    name = op._schema.name.split("::")[-1]
    return name if name.endswith("_") and not name.startswith("_") else None


def _out_of_place_aten(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """`aten.relu.default` for `aten.relu_.default`: the same overload without the write, if any."""
    name = _aten_base_name(op)
    packet = getattr(getattr(torch.ops, op.namespace), name[:-1], None) if name else None
    return getattr(packet, op._overloadname, None) if packet is not None else None


def _write_back(gm: fx.GraphModule, node: fx.Node, chain: list[fx.Node],
                position: dict[fx.Node, int]) -> list[tuple[fx.Node, fx.Node]]:
    """Point the readers after `node` of each value in `chain` (the written value, the value it
    is a view of, ... its base) at that value updated by `node`'s write: the written view itself
    is `node`'s result; each value it views becomes a `*_scatter` (or reshape, permute...) of
    the updated view into the value as it was, as torch's own functionalization writes a view's
    update back to its base. Only as far up the chain as something is read afterwards. Returns
    the (value, updated value) pairs added."""
    readers = [[u for u in v.users if position[u] > position[node]] for v in chain]
    read = [i for i, r in enumerate(readers) if r]
    updated, added = [node], []
    for child, parent in zip(chain, chain[1:read[-1] + 1] if read else []):
        fn, args, kwargs = _scatter(child, parent, updated[-1])
        with gm.graph.inserting_after(updated[-1]):
            new = gm.graph.call_function(fn, args, kwargs)
        new.meta = {**{k: child.meta[k] for k in ("stack_trace", "nn_module_stack")
                       if k in child.meta},
                    **{k: parent.meta[k] for k in ("val", "example_value") if k in parent.meta}}
        updated.append(new)
        added.append((parent, new))
    for value, users, new in zip(chain, readers, updated):
        for user in users:
            user.replace_input_with(value, new)
    return added


def _view_chain(node: fx.Node, is_tensor: Callable[[fx.Node], bool],
                storages: Mapping[fx.Node, set] | None) -> list[fx.Node]:
    """`[node, the tensor node is a view of, ...]`, up to the first value that is not a view
    whose write `_scatter` can carry back. A link counts when the two share memory (on the
    example), or, without one, when the op always returns a view."""
    chain = [node]
    while True:
        child = chain[-1]
        parent = child.args[0] if child.args else None
        if not (isinstance(parent, fx.Node) and is_tensor(parent) and
                _scatter_kind(child) is not None):
            return chain
        if storages is not None:
            if not storages.get(child, set()) & storages.get(parent, set()):
                return chain
        elif _scatter_kind(child) == "reshape" and child.target not in _ALWAYS_VIEWS:
            return chain                    # reshape, flatten: a copy when not contiguous
        elif _scatter_kind(child) == "setitem" and not _basic_index(child.args[1]):
            return chain                    # x[tensor]: a copy
        chain.append(parent)


_aten = torch.ops.aten
_SCATTERS = {_aten.slice.Tensor: _aten.slice_scatter.default,
             _aten.select.int: _aten.select_scatter.default,
             _aten.diagonal.default: _aten.diagonal_scatter.default,
             _aten.as_strided.default: _aten.as_strided_scatter.default}
_ALWAYS_VIEWS = {_aten.view.default, _aten.unsqueeze.default, _aten.squeeze.default,
                 _aten.squeeze.dim, _aten.squeeze.dims, _aten.alias.default,
                 _aten.unflatten.int, "view", "view_as", "unsqueeze", "squeeze", "unflatten",
                 torch.unsqueeze, torch.squeeze}
_RESHAPES = _ALWAYS_VIEWS | {_aten.reshape.default, _aten.flatten.using_ints, "reshape",
                            "reshape_as", "flatten", "contiguous", torch.reshape, torch.flatten}
_TRANSPOSES = {_aten.transpose.int, _aten.t.default, "transpose", "swapaxes", "swapdims", "t",
               torch.transpose, torch.t}
_PERMUTES = {_aten.permute.default, "permute", torch.permute}


def _scatter_kind(view: fx.Node) -> str | None:
    """How a write on `view`'s value is carried back to its first argument, if fxpipe knows."""
    target = view.target if view.op in ("call_function", "call_method") else None
    if target in _SCATTERS:
        return "scatter"
    if target is operator.getitem:
        return "setitem"
    for kind, targets in (("reshape", _RESHAPES), ("transpose", _TRANSPOSES),
                          ("permute", _PERMUTES)):
        if target in targets and (kind == "reshape" or not view.kwargs):
            return kind
    return None


def _scatter(view: fx.Node, base: fx.Node, updated: fx.Node,
             ) -> tuple[Callable, tuple, dict[str, Any]]:
    """The call that returns `base` with its part `view` replaced by `updated`."""
    kind, rest = _scatter_kind(view), tuple(view.args[1:])
    if kind == "scatter":
        return _SCATTERS[view.target], (base, updated, *rest), dict(view.kwargs)
    if kind == "setitem":
        return setitem, (base, rest[0], updated), {}
    if kind == "transpose":
        return (torch.transpose, (updated, *rest), {}) if rest else (torch.t, (updated,), {})
    if kind == "permute":
        return unpermute, (updated, rest[0] if len(rest) == 1 else rest), {}
    return reshape_as, (updated, base), {}


def _basic_index(index: Any) -> bool:
    """Whether `x[index]` is a view: ints, slices, `None` and `...` only."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(isinstance(p, (int, slice, type(None), type(Ellipsis))) for p in parts)


def reshape_as(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`x` in `like`'s shape: a view's update written back through `view`, `unsqueeze`..."""
    return x.reshape(like.shape)


def unpermute(x: torch.Tensor, dims) -> torch.Tensor:
    """The inverse of `x.permute(dims)`: a permuted view's update written back."""
    order = [d % x.dim() for d in dims]
    return x.permute([order.index(i) for i in range(x.dim())])


def _set_submodule(gm: fx.GraphModule, target: str, module: torch.nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, module)
