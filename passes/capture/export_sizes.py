"""An export graph's sizes: those export leaves free (`free_sizes`), the user's line where one
became fixed (`SizeFixes`), and the conditions the graph assumes of the free ones
(`size_rules`), which `fxpipe.passes.signature` checks on every call.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._sympy.numbers import int_oo

from ..signature import SizeRule
from ..user_code import describe_frame, user_frame


def free_sizes(model: nn.Module, args: tuple, kwargs: Mapping[str, Any],
               batch_dims: Any = 0) -> dict | None:
    """`dynamic_shapes` leaving sizes of the tensor inputs free (`Dim.AUTO`): the batch, so
    micro-batches run, and every other size of an input of up to 3 dimensions (a sequence
    length: token ids, masks, features over time), so one compile serves every length the model
    takes. An input of 4 dimensions or more (an image, a video) has only its batch dimension
    (`batch_dims`) freed: freeing the others makes export reason about every window and stride
    symbolically (the zoo's Swin: 98 s instead of 4.7 s to export), for sizes a vision pipeline
    rarely changes.

    `Dim.AUTO` lets export keep a size fixed where the model's code needs it fixed (a literal
    in a view, a weight's width) instead of failing; inputs of another size are then refused by
    name (see `fxpipe.passes.signature`), as are sizes breaking a condition the graph assumes of
    the free ones (`size_rules`).
    """
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    batch = pytree._broadcast_to_and_flatten(batch_dims, spec) or [0] * len(leaves)

    def sizes(v: Any, b: int | None) -> dict | None:
        if not isinstance(v, torch.Tensor):
            return None
        freed = range(v.dim()) if v.dim() <= 3 else [] if b is None else [b % v.dim()]
        return {d: torch.export.Dim.AUTO for d in freed}
    free = pytree.tree_unflatten([sizes(v, b) for v, b in zip(leaves, batch)], spec)
    try:
        return inspect.signature(model.forward).bind(*free[0], **free[1]).arguments
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class _InputSources:
    """The export placeholders' sources, as torch names them in its size conditions
    (`L['input_ids']`, `L['x'][0]`), with each one's name and batch dimension (None: none)."""

    names: tuple[str, ...]
    shown: tuple[str, ...]
    batch: tuple[int | None, ...]

    def code(self, condition: str) -> str | None:
        """`condition` over `args[i]`, or None where it names another source or a batch size
        (the batch is split into micro-batches of other sizes; it stays free)."""
        for i, source in sorted(enumerate(self.names), key=lambda s: -len(s[1])):
            if self.batch[i] is not None and f"{source}.size()[{self.batch[i]}]" in condition:
                return None
            condition = condition.replace(source, f"args[{i}]")
        return None if "L[" in condition else condition

    def show(self, condition: str) -> str:
        for source, name in sorted(zip(self.names, self.shown), key=lambda s: -len(s[0])):
            condition = condition.replace(source, name)
        return re.sub(r"\.size\(\)\[(\d+)\]", r".shape[\1]", condition)


def input_sources(model: nn.Module, args: tuple, kwargs: Mapping[str, Any],
                  batch_dims: Any) -> _InputSources | None:
    """The sources of the example's leaves in export's placeholder order, that of `(args,
    kwargs)` as given, named by forward's parameters; None where they do not bind."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY,
                                                             p.POSITIONAL_OR_KEYWORD)]
    star = {p.kind: n for n, p in params.items() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    leaves, spec = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    names = []
    for (side, key, *rest), _ in leaves:
        if side.idx == 1:
            name = (f"['{key.key}']" if key.key in params else
                    f"['{star.get(inspect.Parameter.VAR_KEYWORD)}']['{key.key}']")
        elif key.idx < len(positional):
            name = f"['{positional[key.idx]}']"
        else:
            name = f"['{star.get(inspect.Parameter.VAR_POSITIONAL)}'][{key.idx - len(positional)}]"
        names.append(name + pytree.keystr(tuple(rest)))
    dims = pytree._broadcast_to_and_flatten(batch_dims, spec)
    if dims is None:
        return None
    batch = tuple(d % v.dim() if isinstance(v, torch.Tensor) and d is not None
                  and -v.dim() <= d < v.dim() else None for (_, v), d in zip(leaves, dims))
    return _InputSources(tuple("L" + name for name in names),
                         tuple(re.sub(r"^\['([^']*)'\]", r"\1", name) for name in names), batch)


def size_rules(program: torch.export.ExportedProgram,
               sources: _InputSources | None) -> tuple[SizeRule, ...]:
    """What the exported graph assumes of its inputs' free sizes, but of their batch sizes:
    sizes that share a symbol are equal, a symbol's range (its lower bound only above 2: export
    assumes no free size is 0 or 1, which the eager ops the graph runs do not need), and the
    conditions the model's code added (`ExportedProgram._guards_code`, which torch turns into
    the checks of `program.module()`)."""
    if sources is None:
        return ()
    conditions, first = [], {}
    inputs = program.graph_signature.user_inputs
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in inputs]
    for i, node in enumerate(placeholders):
        value = node.meta.get("val")
        for d, size in enumerate(value.shape if isinstance(value, torch.Tensor) else ()):
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if expr is None or expr not in program.range_constraints:
                continue
            here = f"{sources.names[i]}.size()[{d}]"
            if expr in first:
                conditions.append(f"{here} == {first[expr]}")
                continue
            first[expr] = here
            bounds = program.range_constraints[expr]
            if bounds.lower != -int_oo and bounds.lower > 2:
                conditions.append(f"{here} >= {int(bounds.lower)}")
            if bounds.upper != int_oo:
                conditions.append(f"{here} <= {int(bounds.upper)}")
    conditions += [c for c in getattr(program, "_guards_code", [])   # a size fixed is a size
                   if not re.fullmatch(r".*\.size\(\)\[\d+\] == \d+", c)]   # the signature checks
    rules = [(sources.code(c), sources.show(c)) for c in dict.fromkeys(conditions)]
    return tuple(SizeRule(code, shown) for code, shown in rules if code is not None)


class SizeFixes(TorchFunctionMode):
    """Notes, while torch.export runs, the user's line where a free size became fixed: the
    torch call during which the size's symbol was replaced by a number (`x.view(b, 32, -1)`
    fixes the length to 32). A size fixed by Python comparing it outside a torch call is not
    seen."""

    def __init__(self):
        super().__init__()
        self.lines: dict[Any, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        fake = torch._guards.detect_fake_mode(pytree.tree_leaves((args, kwargs)))
        env = fake.shape_env if fake is not None else None
        before = set(env.replacements) if env is not None else set()
        result = func(*args, **(kwargs or {}))
        if env is not None and len(env.replacements) > len(before):
            frame = user_frame()
            for symbol in env.replacements.keys() - before:
                if env.replacements[symbol].is_number and frame is not None:
                    self.lines.setdefault(symbol, describe_frame(frame, "", one_line=True))
        return result

    def placeholder_dims(self, program: torch.export.ExportedProgram,
                         sources: _InputSources | None) -> dict[tuple[int, int], str]:
        """The lines noted, by (placeholder index, dimension) of the size each one fixed."""
        env = next((n.meta["val"].fake_mode.shape_env for n in program.graph.nodes
                    if isinstance(n.meta.get("val"), torch._subclasses.FakeTensor)), None)
        if env is None or sources is None or not self.lines:
            return {}
        where = {}
        for symbol, line in self.lines.items():
            for source in env.var_to_sources.get(symbol, ()):
                match = re.fullmatch(r"(.*)\.size\(\)\[(\d+)\]", source.name)
                if match and match.group(1) in sources.names:
                    where[sources.names.index(match.group(1)), int(match.group(2))] = line
        return where

