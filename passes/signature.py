"""A captured model's calling convention: the model's inputs in, the model's output out.

A model is called as `model(*args, **kwargs)` and returns a pytree: a tensor, a tuple, a dict, a
Hugging Face `ModelOutput`... Its GraphModule has flat placeholders, and its output node lists
values. `Signature` maps between the two, for both front-ends:

- torch.fx graphs have one placeholder per forward parameter, named after it (defaults kept), and
  the output node holds the output's structure with nodes as leaves. `*args` and `**kwargs` are
  one placeholder each, bound to a tuple and a dict; `plain_varargs` (run by `passes.trace`)
  drops fx's `*` from their targets, so that `fx.Interpreter` too reads one value per placeholder,
  while the module's `forward` still takes `*args`, `**kwargs` as the model does. An input fx
  specialised through `concrete_args` (traced at its value, e.g. `mask=None`) is a placeholder
  that fx renames (`mask_1`) and checks (`mask has been specialized to have value None`): it is
  taken under its own name, and a value other than the traced one is refused by name, up front,
  since the graph computes with the traced one.
- torch.export graphs have one placeholder per leaf of the example's `(args, kwargs)`, in the
  order of the graph's `in_spec`, and return flat values that `out_spec` puts back together. They
  take positionally what the example gave positionally, the rest by keyword. Export fixed every
  size but the batch dimension to the example's, so `flatten_inputs` checks sizes up front: a
  wrong shape fails here, naming the input, not deep inside a stage. Export also fixed every
  input that is not a tensor (a flag, a step count, a temperature) to its example value, so any
  other value, or a tensor in its place, is refused by name too.

`signature_of(gm)` reads all of it from the graph, so any GraphModule works, however captured.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx._symbolic_trace import _assert_is_none
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .errors import InputError


@dataclass(frozen=True)
class Constant:
    """An output leaf that is a value, not a node (e.g. `None` returned next to the logits)."""

    value: Any


@dataclass(frozen=True, eq=False)
class Signature:
    """How `model(*args, **kwargs)` maps onto a graph's placeholders, and its outputs back.

    `names` are the model inputs the graph takes, the first `positional` of which may be given
    positionally; `defaults` holds values for those a caller may leave out. `in_spec` is the
    structure of the example's `(args, kwargs)` for an export graph (None for fx: one placeholder
    per name). `sizes[i]` are placeholder `i`'s fixed sizes (None: any size). `out_leaves` are the
    output's leaves, node names or `Constant`s, in `out_spec`'s order. `var_positional` and
    `var_keyword` name the fx placeholders of `*args` and `**kwargs` (also in `names`), and
    `specialised` maps the inputs fx traced at a fixed value to that value; `constants` maps the
    index of each export placeholder holding a non-tensor input to the value it was exported with.
    """

    placeholders: tuple[str, ...]
    names: tuple[str, ...]
    positional: int
    defaults: Mapping[str, Any]
    in_spec: pytree.TreeSpec | None
    sizes: tuple[tuple[int | None, ...] | None, ...]
    out_spec: pytree.TreeSpec
    out_leaves: tuple[str | Constant, ...]
    var_positional: str | None = None
    var_keyword: str | None = None
    specialised: Mapping[str, Any] = field(default_factory=dict)
    constants: Mapping[int, Any] = field(default_factory=dict)

    def flatten_inputs(self, args: tuple, kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """The value of every placeholder, in order, from inputs given as the model takes them."""
        given = self._bind(tuple(args), dict(kwargs or {}))
        if self.in_spec is None:
            return [given[name] for name in self.names]
        tree = (tuple(given[n] for n in self.names[:self.positional]),
                {n: given[n] for n in self.names[self.positional:]})
        leaves, spec = pytree.tree_flatten(tree)
        if spec != self.in_spec:
            raise InputError(
                f"the inputs' structure differs from the example the graph was exported from:\n"
                f"  given:    {spec}\n  exported: {self.in_spec}\n"
                f"pass inputs shaped like the example, or compile with an example like these")
        self._check_constants(tree)
        self._check_sizes(leaves)
        return leaves

    def rebuild_outputs(self, values: Mapping[str, Any]) -> Any:
        """The model's output, in the model's own type, from the values of the graph's nodes."""
        leaves = [leaf.value if isinstance(leaf, Constant) else values[leaf]
                  for leaf in self.out_leaves]
        return pytree.tree_unflatten(leaves, self.out_spec)

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > self.positional and self.var_positional is None:
            by_keyword = self.names[self.positional:]
            raise InputError(
                f"{len(args)} positional inputs given, but the graph takes {self.positional} "
                f"positionally ({', '.join(self.names[:self.positional]) or 'none'})" +
                (f": pass {', '.join(by_keyword)} by keyword, as the example did" if by_keyword
                 else ""))
        given = dict(zip(self.names, args[:self.positional]))
        if self.var_positional is not None:
            given[self.var_positional] = tuple(args[self.positional:])
        variadic = (self.var_positional, self.var_keyword)
        unknown = sorted(k for k in kwargs if k not in self.names or k in variadic)
        if self.var_keyword is not None:
            given[self.var_keyword] = {k: kwargs.pop(k) for k in unknown}
        elif unknown:
            hint = ("; the graph was exported from an example without them: compile with them in "
                    "example_kwargs" if self.in_spec is not None else "")
            raise InputError(f"inputs {unknown} are not inputs of the graph "
                             f"({', '.join(self.names)}){hint}")
        for name, value in kwargs.items():
            if name in given:
                raise InputError(f"input {name!r} given twice, positionally and by keyword")
            given[name] = value
        for name in self.names:
            if name not in given:
                if name not in self.defaults:
                    raise InputError(f"no value for input {name!r}: pass it positionally or by "
                                     f"keyword")
                given[name] = self.defaults[name]
        for name, traced in self.specialised.items():
            if not _same(given[name], traced):
                raise InputError(
                    f"input {name!r} is {_shown(given[name])}, but the graph was traced with {name}={traced!r}: "
                    f"torch.fx fixed it to that value (an input the example does not give is "
                    f"traced at its default). Pass {traced!r} or leave it out; to pass other "
                    f"values, compile again with {name} in example_inputs or example_kwargs, so "
                    f"that it becomes an input of the graph")
        return given

    def _check_constants(self, tree: tuple[tuple, dict]) -> None:
        """Refuse a non-tensor input whose value is not the one the graph was exported with."""
        if not self.constants:
            return
        leaves = pytree.tree_flatten_with_path(tree)[0]
        for i, exported in self.constants.items():
            path, value = leaves[i]
            if _same(value, exported):
                continue
            (kind, key), rest = path[:2], path[2:]
            name = (self.names[key.idx] if kind.idx == 0 else key.key) + pytree.keystr(rest)
            raise InputError(
                f"input {name!r} is {_shown(value)}, but the graph was exported with {name}="
                f"{exported!r}: torch.export fixes every input that is not a tensor to its example "
                f"value, and the graph computes with that one. Pass {exported!r}; for another "
                f"value, compile a pipeline with that value in the example (one pipeline per "
                f"value), or pass the input as a tensor if the model computes with it")

    def _check_sizes(self, leaves: list[Any]) -> None:
        for name, sizes, leaf in zip(self.placeholders, self.sizes, leaves):
            if sizes is None or not isinstance(leaf, torch.Tensor):
                continue
            if leaf.dim() != len(sizes) or any(s is not None and s != n
                                               for s, n in zip(sizes, leaf.shape)):
                wanted = ", ".join("*" if s is None else str(s) for s in sizes)
                raise InputError(
                    f"input {name!r} has shape {tuple(leaf.shape)}, but the graph was exported for "
                    f"shape ({wanted}), * marking a free size: torch.export fixes the others to "
                    f"the example's (the batch size too, where the model's code depends on it). "
                    f"Pass inputs of that shape, or compile with an example of this shape "
                    f"(and chunks=1 if the batch size is fixed)")


def signature_of(gm: fx.GraphModule) -> Signature:
    """The calling convention of `gm`: export's pytree specs when it has them, else fx's."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        return _exported(placeholders, output, info)
    return _traced(placeholders, output, getattr(gm.graph._codegen, "stars", {}),
                   gm.meta.get("out_spec"))


class VarArgsCodeGen(fx.graph.CodeGen):
    """fx's code, with a `*` or `**` put back before plain placeholders holding `*args` and
    `**kwargs`: `def forward(self, x, *xs)` reads `xs` as a tuple. `stars`: target -> "*" or "**".
    """

    def __init__(self, stars: Mapping[str, str]):
        super().__init__()
        self.stars = dict(stars)

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str) -> str:
        return super().gen_fn_def([self.stars.get(v, "") + v for v in free_vars],
                                  maybe_return_annotation)


def plain_varargs(gm: fx.GraphModule) -> fx.GraphModule:
    """Make fx's `*args`/`**kwargs` placeholders of `gm` plain ones (in place; returns `gm`).

    `fx.Interpreter` gives a placeholder whose target starts with `*` every remaining input, so
    `Interpreter.run(*signature_of(gm).flatten_inputs(...))`, one value per placeholder, would
    wrap the tuple in a list. A plain target takes the tuple as it is; `VarArgsCodeGen` keeps
    `gm(x, a, b)` working as `model(x, a, b)`. Graphs with another codegen (export's) are left.
    """
    starred = [p for p in gm.graph.find_nodes(op="placeholder") if p.target.startswith("*")]
    if not starred or type(gm.graph._codegen) is not fx.graph.CodeGen:
        return gm
    stars = {}
    for p in starred:
        name = p.target.lstrip("*")
        stars[name] = p.target[:-len(name)]
        p.target = name
    gm.graph.set_codegen(VarArgsCodeGen(stars))
    gm.recompile()
    return gm


def _traced(placeholders: list[fx.Node], output: fx.Node, stars: Mapping[str, str],
            model_out_spec: pytree.TreeSpec | None) -> Signature:
    names, defaults, specialised, star_of = [], {}, {}, {}
    for p in placeholders:
        fixed = _specialisation(p)
        if fixed is not None:    # the traced value is the one to pass when the caller does not
            name, value = fixed
            specialised[name] = defaults[name] = value
        else:
            name = p.target.lstrip("*")
            star_of[name] = stars.get(name) or p.target[:-len(name)]   # "", "*" or "**"
            if p.args:
                defaults[name] = p.args[0]
        names.append(name)
    var_positional = next((n for n, star in star_of.items() if star == "*"), None)
    var_keyword = next((n for n, star in star_of.items() if star == "**"), None)
    positional = sum(not star_of.get(name) for name in names)
    leaves, out_spec = pytree.tree_flatten(_plain(output.args[0]))
    out_spec = _model_containers(leaves, out_spec, model_out_spec)
    return Signature(tuple(p.name for p in placeholders), tuple(names), positional, defaults, None,
                     (None,) * len(placeholders), out_spec, _out_leaves(leaves),
                     var_positional, var_keyword, specialised)


def _model_containers(leaves: list[Any], graph_spec: pytree.TreeSpec,
                      model_spec: pytree.TreeSpec | None) -> pytree.TreeSpec:
    """The model's own output structure (`passes.trace` records it, e.g. an `OrderedDict` where
    fx's graph has a `dict`) when it holds the graph's outputs at the same places, else the graph's.
    """
    if model_spec is None or model_spec.num_leaves != len(leaves) or model_spec == graph_spec:
        return graph_spec
    paths = [path for path, _ in pytree.tree_flatten_with_path(
        pytree.tree_unflatten(leaves, model_spec))[0]]
    graph_paths = [path for path, _ in pytree.tree_flatten_with_path(
        pytree.tree_unflatten(leaves, graph_spec))[0]]
    return model_spec if paths == graph_paths else graph_spec


_SPECIALISED = re.compile(r"(\w+) has been specialized to have value")


def _specialisation(placeholder: fx.Node) -> tuple[str, Any] | None:
    """(input name, traced value) when fx specialised `placeholder` through `concrete_args`.

    Read off the check fx adds, which names the input, because fx renames its placeholder
    (`mask` becomes `mask_1`): `_assert_is_none(mask_1, "mask has been specialized ...")`, or
    `torch._assert(scale_1 == 1.0, "scale has been specialized ...")`.
    """
    for user in placeholder.users:
        if user.target is _assert_is_none:
            check, value = user, None
        elif (user.target is operator.eq and user.args[0] is placeholder and len(user.users) == 1
              and next(iter(user.users)).target is torch._assert):
            check, value = next(iter(user.users)), user.args[1]
        else:
            continue
        match = _SPECIALISED.match(str(check.args[1]))
        if match:
            return match[1], value
    return None


def _shown(value: Any) -> str:
    """A value as an error message shows it: a tensor by its shape."""
    return (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
            else repr(value))


def _same(given: Any, traced: Any) -> bool:
    """Whether `given` is the value an input was traced at: identical for None and bools (1 is not
    True), equal for numbers, strings, dtypes; never a tensor, which the graph did not take."""
    if any(v is None or isinstance(v, bool) for v in (given, traced)):
        return given is traced
    return not isinstance(given, torch.Tensor) and (given == traced) is True


def _exported(placeholders: list[fx.Node], output: fx.Node, info: Any) -> Signature:
    in_spec = info.in_spec
    if not (in_spec.type is tuple and in_spec.num_children == 2 and
            in_spec.child(0).type is tuple and in_spec.child(1).type is dict):
        raise InputError(f"the graph's in_spec {in_spec} is not the (args, kwargs) pair "
                         f"torch.export writes: capture the model with passes.trace.trace")
    positional = in_spec.child(0).num_children
    names = tuple(info.orig_args[:positional]) + tuple(in_spec.child(1).context)
    flat = output.args[0]
    flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    out_spec = info.out_spec if info.out_spec is not None else pytree.tree_structure(flat)
    constants = {i: p.meta["val"] for i, p in enumerate(placeholders)
                 if "val" in p.meta and not isinstance(p.meta["val"], torch.Tensor)}
    return Signature(tuple(p.name for p in placeholders), names, positional, {}, in_spec,
                     tuple(_fixed_sizes(p) for p in placeholders), out_spec, _out_leaves(flat),
                     constants=constants)


def _fixed_sizes(placeholder: fx.Node) -> tuple[int | None, ...] | None:
    """The sizes export fixed for this input (None for a free one; a size symbol that export
    specialised, because the model's code needed it, counts as fixed)."""
    value = placeholder.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(int(s) if is_concrete_int(s) else None for s in value.shape)


def _out_leaves(leaves: list[Any]) -> tuple[str | Constant, ...]:
    return tuple(leaf.name if isinstance(leaf, fx.Node) else Constant(leaf) for leaf in leaves)


def _plain(template: Any) -> Any:
    """fx's immutable lists and dicts in an output as plain ones, so the model's types come back."""
    if isinstance(template, fx.immutable_collections.immutable_dict):
        return {k: _plain(v) for k, v in template.items()}
    if isinstance(template, fx.immutable_collections.immutable_list):
        return [_plain(v) for v in template]
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)(*(_plain(v) for v in template))
    if isinstance(template, tuple):
        return tuple(_plain(v) for v in template)
    if isinstance(template, list):
        return [_plain(v) for v in template]
    if isinstance(template, dict):
        return {k: _plain(v) for k, v in template.items()}
    return template
