"""A captured model's calling convention: the model's inputs in, the model's output out.

A model is called as `model(*args, **kwargs)` and returns a pytree: a tensor, a tuple, a dict, a
Hugging Face `ModelOutput`... Its GraphModule has flat placeholders, and its output node lists
values. `Signature` maps between the two, for both front-ends:

- torch.fx graphs have one placeholder per forward parameter, named after it (defaults kept), and
  the output node holds the output's structure with nodes as leaves.
- torch.export graphs have one placeholder per leaf of the example's `(args, kwargs)`, in the
  order of the graph's `in_spec`, and return flat values that `out_spec` puts back together. They
  take positionally what the example gave positionally, the rest by keyword. Export fixed every
  size but the batch dimension to the example's, so `flatten_inputs` checks sizes up front: a
  wrong shape fails here, naming the input, not deep inside a stage.

`signature_of(gm)` reads all of it from the graph, so any GraphModule works, however captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
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
    output's leaves, node names or `Constant`s, in `out_spec`'s order.
    """

    placeholders: tuple[str, ...]
    names: tuple[str, ...]
    positional: int
    defaults: Mapping[str, Any]
    in_spec: pytree.TreeSpec | None
    sizes: tuple[tuple[int | None, ...] | None, ...]
    out_spec: pytree.TreeSpec
    out_leaves: tuple[str | Constant, ...]

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
        self._check_sizes(leaves)
        return leaves

    def rebuild_outputs(self, values: Mapping[str, Any]) -> Any:
        """The model's output, in the model's own type, from the values of the graph's nodes."""
        leaves = [leaf.value if isinstance(leaf, Constant) else values[leaf]
                  for leaf in self.out_leaves]
        return pytree.tree_unflatten(leaves, self.out_spec)

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > self.positional:
            by_keyword = self.names[self.positional:]
            raise InputError(
                f"{len(args)} positional inputs given, but the graph takes {self.positional} "
                f"positionally ({', '.join(self.names[:self.positional]) or 'none'})" +
                (f": pass {', '.join(by_keyword)} by keyword, as the example did" if by_keyword
                 else ""))
        given = dict(zip(self.names, args))
        unknown = sorted(k for k in kwargs if k not in self.names)
        if unknown:
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
        return given

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
    return _traced(placeholders, output)


def _traced(placeholders: list[fx.Node], output: fx.Node) -> Signature:
    names = tuple(p.target.lstrip("*") for p in placeholders)
    defaults = {p.target.lstrip("*"): p.args[0] for p in placeholders if p.args}
    leaves, out_spec = pytree.tree_flatten(_plain(output.args[0]))
    return Signature(tuple(p.name for p in placeholders), names, len(names), defaults, None,
                     (None,) * len(placeholders), out_spec, _out_leaves(leaves))


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
    return Signature(tuple(p.name for p in placeholders), names, positional, {}, in_spec,
                     tuple(_fixed_sizes(p) for p in placeholders), out_spec, _out_leaves(flat))


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
