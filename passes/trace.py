"""nn.Module -> fx.GraphModule, by the first front-end that captures the model faithfully.

Front-ends, in order (`capture="auto"`):
1. `fx`: plain `torch.fx` symbolic tracing, module-level nodes with the user's names.
2. `fx+leaves`: fx again, with every submodule whose forward broke tracing made a leaf (called
   whole, as one node), found one at a time from where tracing failed.
3. `export`: `torch.export.export(..., strict=False)`, which runs the Python and records ATen ops,
   so it follows what fx cannot (size-dependent loops, `**kwargs` forwards, Hugging Face models).
   Dimension 0 of every tensor input is left free, so every micro-batch size runs; other sizes are
   fixed to the example's. The graph is captured in the model's current mode (`.train()` or
   `.eval()`): export bakes dropout and BatchNorm behaviour into the ops.

A graph counts only if it reproduces the model's output on the example inputs. When no front-end
captures the model, one `TraceError` lists each failure with the user's source line and a fix.
The graph records how it was captured in `gm.meta["capture"]` (a `Capture`).

An export graph is made readable before anyone sees it (`_readable`): nodes are named after the
module they ran in (`model_layers_0_self_attn_q_proj`, `model_layers_0_mlp_mul`), each parameter
is read (`get_attr`) just before its first use, and export's own checks, which pin the example's
device, are dropped. It keeps export's calling convention: it takes and returns what the model
does (see `passes.signature`).
"""

from __future__ import annotations

import copy
import inspect
import linecache
import os
import re
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from .errors import TraceError
from .signature import plain_varargs

CaptureMode = Literal["auto", "fx", "export"]
CAPTURE_MODES: tuple[str, ...] = ("auto", "fx", "export")
_MAX_AUTO_LEAVES = 64


@dataclass(frozen=True)
class Capture:
    """How a graph was captured: the front-end that succeeded, leaf modules, and earlier failures.

    `training` is the mode an export graph was captured in (its dropout and BatchNorm stay so);
    None for fx graphs, whose modules follow `.train()` and `.eval()`.
    """

    method: str
    leaves: tuple[str, ...] = ()
    failures: tuple[str, ...] = field(default=(), compare=False)
    training: bool | None = None

    def __str__(self) -> str:
        text = self.method
        if self.training is not None:
            text += f" in {'train' if self.training else 'eval'} mode"
        if self.leaves:
            text += f" (kept whole: {', '.join(self.leaves)})"
        if self.failures:
            text += " because " + "; ".join(
                f.splitlines()[0].replace(": ", " failed: ", 1) for f in self.failures)
        return text


def trace(model: nn.Module, example_inputs: tuple = (), example_kwargs: Mapping[str, Any] | None = None,
          *, capture: CaptureMode = "auto", leaf_modules: Iterable[str | type] = (),
          concrete_args: Mapping[str, Any] | None = None) -> fx.GraphModule:
    """Capture `model` as a GraphModule whose forward takes the same inputs as `model`'s.

    `capture` picks the front-ends: "auto" tries fx, fx+leaves, then export; "fx" only fx; "export"
    only torch.export (which needs example inputs). `leaf_modules` (qualified names or module
    classes) stay whole, as one node each, and `concrete_args` fixes inputs to constants; both
    apply to fx (export fixes every non-tensor input to its example value). Inputs not given in
    the example default to theirs.
    """
    if capture not in CAPTURE_MODES:
        raise TraceError(f"unknown capture mode {capture!r}: use one of {', '.join(CAPTURE_MODES)}")
    example_kwargs = dict(example_kwargs or {})
    concrete = _default_concrete_args(model, example_inputs, example_kwargs)
    concrete.update(concrete_args or {})
    leaves = list(leaf_modules)
    failures: list[str] = []

    if capture in ("auto", "fx"):
        gm, failure = _fx_trace(model, leaves, concrete, example_inputs, example_kwargs)
        if gm is not None:
            gm.meta["capture"] = Capture("fx", tuple(l for l in leaves if isinstance(l, str)))
            return gm
        failures.append(f"torch.fx: {failure}\n    {_FIX['fx']}")
        if capture == "auto" and failure.culprit:   # a submodule to keep whole: try again
            gm, auto_leaves, error = _fx_trace_with_auto_leaves(
                model, leaves, concrete, example_inputs, example_kwargs)
            if gm is not None:
                gm.meta["capture"] = Capture("fx+leaves", tuple(auto_leaves), tuple(failures))
                return gm
            failures.append(f"torch.fx with automatic leaf modules: {error}\n    {_FIX['fx']}")
    if capture in ("auto", "export"):
        gm, failure = _export(model, example_inputs, example_kwargs)
        if gm is not None:
            gm.meta["capture"] = Capture("export", (), tuple(failures), training=model.training)
            return gm
        failures.append(f"torch.export: {failure}\n    {_FIX['export']}")
    raise TraceError(f"could not capture {type(model).__name__} as a graph:\n  - " +
                     "\n  - ".join(failures))


_FIX = {
    "fx": "Fix: pass the module that breaks tracing in leaf_modules=[...] to keep it whole, pass "
          "fixed values for Python-level options in concrete_args={...}, or rewrite the line "
          "without Python control flow on tensor values.",
    "export": "Fix: torch.export follows Python control flow on sizes, not on tensor values: "
              "write such a branch with torch.cond(pred, true_fn, false_fn, operands), or move it "
              "out of forward.",
}


class _Tracer(fx.Tracer):
    # Buffers read in forward become `get_attr` nodes, as parameters do: otherwise fx runs a
    # buffer write (`self.calls.add_(1)`) once on the real tensor while tracing and leaves it out
    # of the graph (state writes: see passes/state.py).
    proxy_buffer_attributes = True

    def __init__(self, leaves: Iterable[str | type]):
        super().__init__()
        self.leaf_names = {l for l in leaves if isinstance(l, str)}
        self.leaf_types = tuple(l for l in leaves if isinstance(l, type))

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return (qualified_name in self.leaf_names or isinstance(m, self.leaf_types)
                or super().is_leaf_module(m, qualified_name))


class _TraceFailure(Exception):
    def __init__(self, message: str, culprit: str | None):
        super().__init__(message)
        self.culprit = culprit


def _fx_trace(model, leaves, concrete, args, kwargs):
    try:
        return _fx_trace_or_raise(model, leaves, concrete, args, kwargs), None
    except _TraceFailure as failure:
        return None, failure


def _fx_trace_or_raise(model, leaves, concrete, args, kwargs) -> fx.GraphModule:
    tracer = _Tracer(leaves)
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as e:  # fx raises many kinds; each becomes a reported failure
        raise _TraceFailure(_describe(e, model), _culprit(e, model)) from e
    gm = plain_varargs(fx.GraphModule(tracer.root, graph, type(model).__name__))
    if args or kwargs:
        mismatch = _mismatch(model, gm, args, kwargs)
        if mismatch:
            raise _TraceFailure(f"the traced graph does not reproduce the model: {mismatch}", None)
    return gm


def _fx_trace_with_auto_leaves(model, leaves, concrete, args, kwargs):
    leaves = list(leaves)
    auto: list[str] = []
    error = ""
    for _ in range(_MAX_AUTO_LEAVES):
        try:
            return _fx_trace_or_raise(model, leaves, concrete, args, kwargs), auto, ""
        except _TraceFailure as failure:
            error = str(failure)
            if not failure.culprit or failure.culprit in leaves:
                break
            leaves.append(failure.culprit)
            auto.append(failure.culprit)
    return None, auto, error


def _export(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]):
    try:
        return _export_or_raise(model, args, kwargs), None
    except _TraceFailure as failure:
        return None, failure


def _export_or_raise(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> fx.GraphModule:
    if not args and not kwargs:
        raise _TraceFailure("torch.export needs example inputs: pass example_inputs or "
                            "example_kwargs", None)
    try:
        program = torch.export.export(model, tuple(args), dict(kwargs), strict=False,
                                      dynamic_shapes=_free_batch(model, args, kwargs))
    except Exception as e:  # export raises many kinds; each becomes a reported failure
        raise _TraceFailure(_describe(e, model), _culprit(e, model)) from e
    gm = _readable(program.module(), type(model).__name__)
    mismatch = _mismatch(model, gm, args, kwargs)
    if mismatch:
        raise _TraceFailure(f"the exported graph does not reproduce the model: {mismatch}", None)
    return gm


def _free_batch(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> dict | None:
    """`dynamic_shapes` leaving dimension 0 of every tensor input free, so micro-batches run.

    `Dim.AUTO` lets export keep a size fixed where the model's code needs it fixed (then inputs
    of another batch size are refused by name, see `passes.signature`), instead of failing.
    """
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None

    def free(value):
        return ({0: torch.export.Dim.AUTO}
                if isinstance(value, torch.Tensor) and value.dim() > 0 else None)
    return {name: pytree.tree_map(free, value) for name, value in bound.items()}


def _readable(exported: fx.GraphModule, class_name: str) -> fx.GraphModule:
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


def _default_concrete_args(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> dict:
    """Inputs the example does not give are traced at their defaults (e.g. `labels=None`)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return {}
    given = signature.bind_partial(*args, **kwargs).arguments
    return {name: p.default for name, p in signature.parameters.items()
            if name not in given and p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _user_frames(error: BaseException) -> list[traceback.FrameSummary]:
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)
    return [f for f in traceback.extract_tb(error.__traceback__)
            if not f.filename.startswith((torch_dir, here))]


def _describe(error: BaseException, model: nn.Module) -> str:
    message = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    frames = _user_frames(error)
    if frames:
        f = frames[-1]
        line = (f.line or linecache.getline(f.filename, f.lineno)).strip()
        message += f"\n      at {f.filename}:{f.lineno}: {line}"
    culprit = _culprit(error, model)
    if culprit:
        message += f"\n      in module {culprit!r} ({type(model.get_submodule(culprit)).__name__})"
    return message


def _culprit(error: BaseException, model: nn.Module) -> str | None:
    """The qualified name of the innermost submodule whose forward was running when tracing broke."""
    names = {id(m): name for name, m in model.named_modules()}
    culprit = None
    tb = error.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_locals.get("self")
        if isinstance(module, nn.Module) and names.get(id(module)):
            culprit = names[id(module)]
        tb = tb.tb_next
    return culprit


def _mismatch(model: nn.Module, gm: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any]) -> str:
    """Why `gm` does not reproduce `model` on the example, or "" when it does.

    Both run from the same random state, and buffers (e.g. BatchNorm statistics) are restored
    afterwards, so checking leaves the model as it was.
    """
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            expected = model(*args, **kwargs)
            _restore(model, saved)
            torch.manual_seed(0)
            actual = gm(*args, **kwargs)
    except Exception as e:
        return f"running the graph raised {type(e).__name__}: {e}"
    finally:
        _restore(model, saved)
    flat_expected, spec_expected = torch.utils._pytree.tree_flatten(expected)
    flat_actual, spec_actual = torch.utils._pytree.tree_flatten(actual)
    if spec_expected != spec_actual:
        return f"outputs differ in structure: {spec_actual} instead of {spec_expected}"
    for i, (e, a) in enumerate(zip(flat_expected, flat_actual)):
        try:
            torch.testing.assert_close(a, e, equal_nan=True)
        except AssertionError as error:
            return f"output {i} differs: {str(error).splitlines()[0]}"
    return ""


def _restore(model: nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
    for name, b in model.named_buffers():
        if name in saved:
            b.copy_(saved[name])
