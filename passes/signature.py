"""A captured model's calling convention: the model's inputs in, the model's output out.

A model is called as `model(*args, **kwargs)` and returns a pytree: a tensor, a tuple, a dict, a
Hugging Face `ModelOutput`... Its GraphModule has flat placeholders, and its output node lists
values. `Signature` maps between the two, for both front-ends:

- torch.fx graphs have one placeholder per forward parameter (defaults kept), and the output
  node holds the output's structure with nodes as leaves. `*args` and `**kwargs` are one
  placeholder each, bound to a tuple and a dict; `plain_varargs` (run by `fxpipe.passes.capture`) drops
  fx's `*` from their targets, so that `fx.Interpreter` too reads one value per placeholder,
  while the module's `forward` still takes `*args`, `**kwargs` as the model does. An input fx
  specialised through `concrete_args` (traced at its value, e.g. `mask=None`) is a placeholder
  that fx renames (`mask_1`): it is taken under its own name, and a value other than the traced
  one is refused by name, up front, since the graph computes with the traced one.
- torch.export graphs have one placeholder per leaf of the example's `(args, kwargs)`, in the
  order of the graph's `in_spec`, and return flat values that `out_spec` puts back together. They
  take positionally what the example gave positionally, the rest by keyword. Export fixed the
  sizes the model's code needs fixed, so `flatten_inputs` checks sizes up front: a wrong shape
  fails here, naming the input, not deep inside a stage. Export also fixed every
  input that is not a tensor (a flag, a step count, a temperature) to its example value, so any
  other value, or a tensor in its place, is refused by name too.
  Export leaves every size free that the model's code lets vary (`fxpipe.passes.capture` asks it
  to, for every dimension of every tensor input): a sequence length, an image's height. What the
  graph assumes of the free sizes (two inputs of one length, a length below the model's position
  table, a multiple of the heads) is kept as `SizeRule`s, checked up front too, and a size the
  code fixed is refused naming the model's line that fixed it.

Each front-end knows its convention (`fxpipe.passes.capture` builds it with `traced_signature` or
`exported_signature` and keeps it in `gm.meta["signature"]`); `signature_of(gm)` returns it with
the graph's current placeholders and output values, which later passes may rewire. A graph
captured elsewhere is read from the graph itself (fx: inputs fx specialised are then plain
inputs under fx's names; export: its pytree codegen).

Example (an fx graph's inputs from a call as the model takes it, its output rebuilt as a dict):

>>> import torch
>>> from torch import fx, nn
>>> from fxpipe.passes.signature import signature_of
>>> class Scaled(nn.Module):
...     def forward(self, x, scale=2.0):
...         return {"scaled": x * scale, "total": x.sum()}
>>> signature = signature_of(fx.symbolic_trace(Scaled()))
>>> signature.names, signature.defaults, signature.out_leaves
(('x', 'scale'), {'scale': 2.0}, ('mul', 'sum_1'))
>>> signature.flatten_inputs((torch.ones(2),), {"scale": 3.0})
[tensor([1., 1.]), 3.0]
>>> signature.rebuild_outputs({"mul": "the product", "sum_1": "the sum"})
{'scaled': 'the product', 'total': 'the sum'}
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .errors import InputError


@dataclass(frozen=True)
class Constant:
    """An output leaf that is a value, not a node (e.g. `None` returned next to the logits)."""

    value: Any


@functools.cache
def rule_names() -> dict[str, Any]:
    """What export's size rules are evaluated with (imported here: sympy loads with them, and
    only an export graph has such rules)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
    return {**SYMPY_INTERP, "__builtins__": {"max": max, "min": min, "abs": abs}}


@dataclass(frozen=True)
class SizeRule:
    """A condition export's graph assumes of the free input sizes: two sizes equal, a bound, a
    divisibility. `code` evaluates it over the placeholders' values (`args[i]`, in placeholder
    order); `shown` says it with the model's input names, for the error."""

    code: str
    shown: str

    def holds(self, values: Sequence[Any]) -> bool:
        return bool(eval(self.code, dict(rule_names()), {"args": values}))


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
    `size_rules` are what the export graph assumes of its free sizes, and `fixed_at[(i, d)]` the
    model's line that fixed size `d` of placeholder `i`, where it is known.
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
    size_rules: tuple[SizeRule, ...] = ()
    fixed_at: Mapping[tuple[int, int], str] = field(default_factory=dict)

    def sizes_served(self) -> str:
        """The input sizes one compile serves, as the plan prints them: each tensor input's
        shape with `*` for a free size (fx graphs: every size their code takes)."""
        if self.in_spec is None:
            return "any input sizes the model's code takes (torch.fx traced it shape-free)"
        shapes = [f"{name} ({', '.join('*' if n is None else str(n) for n in sizes)})"
                  for name, sizes in zip(self.placeholders, self.sizes) if sizes is not None]
        served = f"inputs {', '.join(shapes)}, * marking a size free to vary"
        if not self.size_rules:
            return served
        more = len(self.size_rules) - 3
        return (f"{served}, under {'; '.join(rule.shown for rule in self.size_rules[:3])}"
                + (f" and {more} more conditions" if more > 0 else ""))

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
        self._check_size_rules(leaves)
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
                f"{len(args)} positional inputs given; the graph takes {self.positional} "
                f"positionally\nits positional inputs: "
                f"{', '.join(self.names[:self.positional]) or 'none'}" +
                (f"\npass {', '.join(by_keyword)} by keyword, as the example did" if by_keyword
                 else ""))
        given = dict(zip(self.names, args[:self.positional]))
        if self.var_positional is not None:
            given[self.var_positional] = tuple(args[self.positional:])
        variadic = (self.var_positional, self.var_keyword)
        unknown = sorted(k for k in kwargs if k not in self.names or k in variadic)
        if self.var_keyword is not None:
            given[self.var_keyword] = {k: kwargs.pop(k) for k in unknown}
        elif unknown:
            hint = ("\nthe graph was exported from an example without them: compile with them in "
                    "example_kwargs" if self.in_spec is not None else "")
            raise InputError(f"inputs {unknown} are not inputs of the graph\n"
                             f"its inputs: {', '.join(self.names)}{hint}")
        for name, value in kwargs.items():
            if name in given:
                raise InputError(f"input {name!r} given twice, positionally and by keyword")
            given[name] = value
        for name in self.names:
            if name not in given:
                if name not in self.defaults:
                    raise InputError(f"no value for input {name!r}\npass it positionally or by "
                                     f"keyword")
                given[name] = self.defaults[name]
        for name, traced in self.specialised.items():
            if not _same(given[name], traced):
                raise InputError(
                    f"input {name!r} is {_shown(given[name])}; the graph was traced with {traced!r}"
                    f"\ntorch.fx fixed {name}={traced!r} (an input the example does not give is "
                    f"traced at its default)\npass {traced!r} or leave it out; to pass other "
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
                f"input {name!r} is {_shown(value)}; the graph was exported with {exported!r}\n"
                f"torch.export fixes every input that is not a tensor to its example value "
                f"({name}={exported!r}), and the graph computes with that one\n"
                f"pass {exported!r}; for another "
                f"value, compile a pipeline with that value in the example (one pipeline per "
                f"value), or pass the input as a tensor if the model computes with it")

    def _check_sizes(self, leaves: list[Any]) -> None:
        for i, (name, sizes, leaf) in enumerate(zip(self.placeholders, self.sizes, leaves)):
            if sizes is None or not isinstance(leaf, torch.Tensor):
                continue
            wanted = ", ".join("*" if s is None else str(s) for s in sizes)
            if leaf.dim() != len(sizes):
                raise InputError(
                    f"input {name!r} has shape {tuple(leaf.shape)}; the graph's is ({wanted})\n"
                    f"the graph was exported for that shape, * marking a free size; pass inputs "
                    f"with {len(sizes)} dimensions, as the example had")
            dim = next((d for d, (s, n) in enumerate(zip(sizes, leaf.shape))
                        if s is not None and s != n), None)
            if dim is None:
                continue
            line = self.fixed_at.get((i, dim))
            where = f"\n    {line}\n" if line else " "
            raise InputError(
                f"input {name!r} has shape {tuple(leaf.shape)}; the graph's is ({wanted})\n"
                f"the graph was exported for that shape, * marking a free size: dimension {dim} "
                f"is fixed to {sizes[dim]} by the model's code{where}(torch.export keeps free "
                f"every size the code lets vary; the batch size too, unless the code depends on "
                f"it)\nFix: compute that size from the input in the model (x.shape[{dim}], or "
                f"-1 in a view or reshape) and compile again; or pass inputs of that shape, or "
                f"compile one pipeline per shape with an example of it (and chunks=1 if the "
                f"batch size is fixed)")

    def _check_size_rules(self, leaves: list[Any]) -> None:
        """Refuse inputs whose free sizes break a condition the exported graph assumes."""
        for rule in self.size_rules:
            if not rule.holds(leaves):
                shapes = ", ".join(f"{name} {tuple(leaf.shape)}"
                                   for name, leaf in zip(self.placeholders, leaves)
                                   if isinstance(leaf, torch.Tensor))
                raise InputError(
                    f"the inputs' sizes break a condition the graph was exported under\n"
                    f"condition: {rule.shown}; sizes: {shapes}\ntorch.export assumes it of "
                    f"every size it leaves free, since the model's code (a branch on a size, a "
                    f"view, a table of positions) needs it; pass inputs meeting it, or compile "
                    f"a pipeline with an example of these sizes")


def signature_of(gm: fx.GraphModule) -> Signature:
    """The calling convention of `gm`: the one its front-end recorded, else read off the graph."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    known = gm.meta.get("signature")
    if isinstance(known, Signature) and len(known.placeholders) == len(placeholders):
        leaves = (_flat(output) if known.in_spec is not None
                  else pytree.tree_leaves(_plain(output.args[0])))
        return replace(known, placeholders=tuple(p.name for p in placeholders),
                       out_leaves=_out_leaves(leaves))
    # A graph exported elsewhere: no public attribute of a GraphModule holds export's specs.
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        return _exported(placeholders, output, info.orig_args, info.in_spec, info.out_spec)
    return _traced(placeholders, output, None)


def traced_signature(gm: fx.GraphModule, forward: Any, concrete_args: Mapping[str, Any],
                     model_out_spec: pytree.TreeSpec | None) -> Signature:
    """The convention of `gm`, traced by fx from a module whose forward is `forward` with
    `concrete_args` fixed: inputs named after forward's parameters, those fixed specialised to
    their value. `model_out_spec` is the model's own output structure (see `_model_containers`).

    fx makes one placeholder per parameter, in the order of forward's code: positional, then
    keyword-only, then `*args`, then `**kwargs`; a fixed input whose value holds several leaves
    (or fx's `PH`) gets other placeholders, and then the graph's own names are used.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    try:
        params = sorted(inspect.signature(forward).parameters.values(),
                        key=lambda p: _FX_ORDER[p.kind])
    except (TypeError, ValueError):
        return _traced(placeholders, output, model_out_spec)
    stars = {p.name: _STARS[p.kind] for p in params if p.kind in _STARS}
    fixed = {p.name: concrete_args[p.name] for p in params if p.name in concrete_args}
    if (len(params) != len(placeholders)
            or any(isinstance(leaf, type(fx.PH)) for leaf in pytree.tree_leaves(fixed))
            or any(p.name not in fixed and p.name != ph.target.lstrip("*")
                   for p, ph in zip(params, placeholders))):
        return _traced(placeholders, output, model_out_spec, stars)
    names = tuple(p.name for p in params)
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    defaults.update(fixed)
    var_positional = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
    var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    leaves, out_spec = pytree.tree_flatten(_plain(output.args[0]))
    return Signature(tuple(p.name for p in placeholders), names,
                     sum(name not in (var_positional, var_keyword) for name in names), defaults,
                     None, (None,) * len(placeholders),
                     _model_containers(leaves, out_spec, model_out_spec), _out_leaves(leaves),
                     var_positional, var_keyword, fixed)


def exported_signature(gm: fx.GraphModule, call: Any) -> Signature:
    """The convention of `gm`, torch.export's graph, from the `ModuleCallSignature` of its
    program's top module (`ExportedProgram.module_call_graph[0].signature`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    return _exported(placeholders, output, call.forward_arg_names, call.in_spec, call.out_spec)


_FX_ORDER = {inspect.Parameter.POSITIONAL_ONLY: 0, inspect.Parameter.POSITIONAL_OR_KEYWORD: 0,
             inspect.Parameter.KEYWORD_ONLY: 1, inspect.Parameter.VAR_POSITIONAL: 2,
             inspect.Parameter.VAR_KEYWORD: 3}
_STARS = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}


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
    `gm(x, a, b)` working as `model(x, a, b)`. For a graph fresh from fx's tracer, whose code
    fx's own codegen writes (export's graphs have no starred placeholders).
    """
    starred = [p for p in gm.graph.find_nodes(op="placeholder") if p.target.startswith("*")]
    if not starred:
        return gm
    stars = {}
    for p in starred:
        name = p.target.lstrip("*")
        stars[name] = p.target[:-len(name)]
        p.target = name
    gm.graph.set_codegen(VarArgsCodeGen(stars))
    gm.recompile()
    return gm


def _traced(placeholders: list[fx.Node], output: fx.Node,
            model_out_spec: pytree.TreeSpec | None, stars: Mapping[str, str] = {}) -> Signature:
    """An fx graph's convention read off the graph: one input per placeholder, named by its
    target; `*args` and `**kwargs` by the star of their target, or `stars` (name -> "*", "**")."""
    names, defaults, star_of = [], {}, {}
    for p in placeholders:
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
                     var_positional, var_keyword)


def _model_containers(leaves: list[Any], graph_spec: pytree.TreeSpec,
                      model_spec: pytree.TreeSpec | None) -> pytree.TreeSpec:
    """The model's own output structure (`fxpipe.passes.capture` records it, e.g. an `OrderedDict` where
    fx's graph has a `dict`) when it holds the graph's outputs at the same places, else the graph's.
    """
    if model_spec is None or model_spec.num_leaves != len(leaves) or model_spec == graph_spec:
        return graph_spec
    paths = [path for path, _ in pytree.tree_flatten_with_path(
        pytree.tree_unflatten(leaves, model_spec))[0]]
    graph_paths = [path for path, _ in pytree.tree_flatten_with_path(
        pytree.tree_unflatten(leaves, graph_spec))[0]]
    return model_spec if paths == graph_paths else graph_spec


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


def _exported(placeholders: list[fx.Node], output: fx.Node, arg_names: Sequence[str] | None,
              in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec | None) -> Signature:
    """An export graph's convention: `in_spec` and `out_spec` of its program, forward's
    positional parameter names (None: `arg_0`, ...), the sizes and constants export fixed."""
    if not (in_spec.type is tuple and in_spec.num_children == 2 and
            in_spec.child(0).type is tuple and in_spec.child(1).type is dict):
        raise InputError(f"the graph's in_spec is not the (args, kwargs) pair torch.export "
                         f"writes\nin_spec: {in_spec}\n"
                         f"capture the model with fxpipe.passes.capture.trace")
    positional = in_spec.child(0).num_children
    arg_names = list(arg_names or [f"arg_{i}" for i in range(positional)])
    names = tuple(arg_names[:positional]) + tuple(in_spec.child(1).context)
    flat = _flat(output)
    out_spec = out_spec if out_spec is not None else pytree.tree_structure(flat)
    constants = {i: p.meta["val"] for i, p in enumerate(placeholders)
                 if "val" in p.meta and not isinstance(p.meta["val"], torch.Tensor)}
    return Signature(tuple(p.name for p in placeholders), names, positional, {}, in_spec,
                     tuple(_fixed_sizes(p) for p in placeholders), out_spec, _out_leaves(flat),
                     constants=constants)


def _flat(output: fx.Node) -> list[Any]:
    """The values an export graph's output node returns, flat, as its out_spec reads them."""
    values = output.args[0]
    return list(values) if isinstance(values, (tuple, list)) else [values]


def _fixed_sizes(placeholder: fx.Node) -> tuple[int | None, ...] | None:
    """The sizes export fixed for this input (None for a free one; a size symbol that export
    specialised, because the model's code needed it, counts as fixed)."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int    # as `rule_names`
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
