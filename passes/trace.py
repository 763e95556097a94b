"""nn.Module -> fx.GraphModule, by the first front-end that captures the model faithfully.

Front-ends, in order (`capture="auto"`):
1. `fx`: plain `torch.fx` symbolic tracing, module-level nodes with the user's names.
2. `fx+leaves`: fx again, with every submodule whose forward broke tracing made a leaf (called
   whole, as one node), found one at a time from where tracing failed.
3. `export`: `torch.export.export(..., strict=False)`, which runs the Python and records ATen ops,
   so it follows what fx cannot (size-dependent loops, `**kwargs` forwards, Hugging Face models).
   Every size of every tensor input is left free where the model's code allows it (the batch, so
   every micro-batch size runs; a sequence length; see `_free_sizes`). The graph is captured
   in the model's current mode (`.train()` or `.eval()`): export bakes dropout and BatchNorm
   behaviour into the ops.

A submodule with a hook (forward, forward pre-, backward, backward pre-) stays whole under fx, so
its hook runs each time a stage calls it; export runs hooks once, at capture, so it refuses them.
Hugging Face's output-recording hooks do not count (`_records_outputs`): what they record is the
model's output, and the capture records it so. Python side effects in forward
(`self.seen.append(x)`, `self.calls += 1`) would not happen in a pipeline, which runs tensor
operations only: each front-end runs on a snapshot of every module's plain attributes, restored
afterwards, and a forward that filled a list, dict or set, or stored a number or a tensor, is
refused by name where a second run on the example does it again (`_unsettled`); what forward
fills on first use and then keeps (a cache, a setting) is only undone.

fx traces a forward wrapped by `*args, **kwargs` decorators (transformers 5's) through them, with
forward's own parameters (`_fx_forward`). A model whose forward takes `use_cache` is
captured with `use_cache=False` (`without_cache`): no front-end returns a key/value cache.

A graph must also be fine enough for the stages asked: an fx graph that keeps a big module
whole (torch.nn's own `TransformerEncoder`, whose fast path fx cannot follow) gives way to export.
A graph counts only if it reproduces the model's output on the example inputs. When no front-end
captures the model, one `TraceError` lists each failure with the user's source line and a fix.
The graph records how it was captured in `gm.meta["capture"]` (a `Capture`), and each front-end
its calling convention in `gm.meta["signature"]` (a `fxpipe.passes.signature.Signature`: the inputs fx
fixed, export's specs), so nothing needs to be recovered from the graph afterwards.

Grad-mode regions in forward (`with torch.no_grad():`, a frozen teacher) stay regions: an fx node
records the mode it was traced in (`node.meta["grad_enabled"]`, see `_Tracer`) and
`fxpipe.passes.codegen` runs it so; an export graph keeps them as `wrap_with_set_grad_enabled` calls.

An export graph is made readable before anyone sees it (`_readable`): nodes are named after the
module they ran in (`model_layers_0_self_attn_q_proj`, `model_layers_0_mlp_mul`), each parameter
is read (`get_attr`) just before its first use, and export's own checks, which pin the example's
device, are dropped. It keeps export's calling convention: it takes and returns what the model
does (see `fxpipe.passes.signature`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import re
import sys
import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Literal, Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._sympy.numbers import int_oo

from .codegen import place
from .compare import difference, equal
from .device import initialized_gpus
from .errors import TraceError
from .materialize import holds_meta
from .signature import SizeRule, exported_signature, plain_varargs, traced_signature
from .state import unchanged_state
from .user_code import describe_frame, user_frame

CaptureMode = Literal["auto", "fx", "export"]
CAPTURE_MODES: tuple[str, ...] = ("auto", "fx", "export")
_MAX_AUTO_LEAVES = 64
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capture:
    """How a graph was captured: the front-end that succeeded, leaf modules, and earlier failures.

    `leaves` names the submodules kept whole: those given, those with hooks, and (fx+leaves)
    those whose forward broke tracing.

    `training` is the mode an export graph was captured in (its dropout and BatchNorm stay so);
    None for fx graphs, whose modules follow `.train()` and `.eval()`.

    `reason` says why this front-end and not an earlier one: their failures, or an fx graph too
    coarse to balance the stages asked (see `trace`); the plan prints it.

    `uncached` is True when the model was captured with `use_cache=False` (see `without_cache`).

    `fake` is the device type of the fake tensors a model on meta was exported on, where meta
    alone failed or hid an autocast region (see `_export_or_raise`); None otherwise.
    """

    method: str
    leaves: tuple[str, ...] = ()
    failures: tuple[str, ...] = field(default=(), compare=False)
    training: bool | None = None
    reason: str = field(default="", compare=False)
    uncached: bool = False
    fake: str | None = field(default=None, compare=False)

    def __str__(self) -> str:
        text = self.method
        if self.training is not None:
            text += f" in {'train' if self.training else 'eval'} mode"
        if self.uncached:
            text += " without the key/value cache (use_cache=False)"
        if self.fake:
            text += f" on fake {self.fake} tensors"
        if self.leaves:
            text += f" (kept whole: {', '.join(self.leaves)})"
        if self.reason:
            text += " because " + self.reason
        return text


def trace(model: nn.Module, example_inputs: tuple = (), example_kwargs: Mapping[str, Any] | None = None,
          *, capture: CaptureMode = "auto", leaf_modules: Iterable[str | type] = (),
          concrete_args: Mapping[str, Any] | None = None, batch_dims: Any = 0,
          stages: int = 1, device_type: str | None = None) -> fx.GraphModule:
    """Capture `model` as a GraphModule whose forward takes the same inputs as `model`'s.

    `capture` picks the front-ends: "auto" tries fx, fx+leaves, then export; "fx" only fx; "export"
    only torch.export (which needs example inputs). `leaf_modules` (qualified names or module
    classes) stay whole, as one node each, and `concrete_args` fixes inputs to constants; both
    apply to fx (export fixes every non-tensor input to its example value). Inputs not given in
    the example default to theirs. `batch_dims`, an int or a pytree prefix of `(example_inputs,
    example_kwargs)` (None: no batch dimension), names the dimension export leaves free.

    `stages` is the number of stages the graph will be split into. With "auto", an fx graph too
    coarse to balance them (see `_too_coarse`: fewer nodes than stages, or a module kept whole
    holding most of the parameters) gives way to export, which records that module op by op;
    when export fails, the fx graph stays. `Capture.reason` says which and why. The default,
    1, never finds a graph too coarse.

    `device_type` is the kind of device the graph will run on ("cpu", "cuda"; by default the
    example inputs'): a model on meta whose export on meta fails, or keeps an enabled autocast
    region of that kind (meta tensors do not autocast, so dtypes read in forward are not the
    run's), is exported again on fake tensors of that kind (`_on_fake_tensors`).
    """
    if capture not in CAPTURE_MODES:
        raise TraceError(f"unknown capture mode {capture!r}: use one of {', '.join(CAPTURE_MODES)}")
    example_kwargs = without_cache(model, example_inputs, example_kwargs)
    uncached = example_kwargs.get("use_cache") is False
    concrete = _default_concrete_args(model, example_inputs, example_kwargs)
    concrete.update(concrete_args or {})
    example = (tuple(example_inputs), example_kwargs)
    fx_kwargs = dict(example_kwargs)       # fx fixes use_cache, which forward branches on
    if uncached:
        concrete["use_cache"] = fx_kwargs.pop("use_cache")
    hooked = _hooked_modules(model)
    leaves = list(leaf_modules) + [name for name in hooked if name not in leaf_modules]
    named_leaves = tuple(l for l in leaves if isinstance(l, str))
    failures: list[str] = []
    coarse: fx.GraphModule | None = None     # an fx graph too coarse for `stages`: the fallback
    why_coarse = ""

    if capture in ("auto", "fx"):
        gm, failure = _without_side_effects(
            model, example, _fx_trace, model, leaves, concrete, example_inputs, fx_kwargs)
        if gm is not None:
            gm.meta["capture"] = Capture("fx", named_leaves, uncached=uncached)
        else:
            failures.append(f"torch.fx: {failure}\n    {_FIX['fx']}")
        if gm is None and capture == "auto" and failure.culprit:   # a submodule to keep whole
            gm, auto_leaves, error = _without_side_effects(
                model, example, _fx_trace_with_auto_leaves, model, leaves, concrete, example_inputs,
                fx_kwargs)
            if gm is not None:
                gm.meta["capture"] = Capture("fx+leaves", (*named_leaves, *auto_leaves),
                                             tuple(failures), reason=_because(failures),
                                             uncached=uncached)
            else:
                failures.append(f"torch.fx with automatic leaf modules: {error}\n    {_FIX['fx']}")
        if gm is not None:
            why_coarse = _too_coarse(model, gm, leaves, stages) if capture == "auto" else ""
            if not why_coarse:
                return gm
            coarse = gm
    if capture in ("auto", "export") and hooked:
        failures.append(
            "torch.export: it runs hooks once, at capture, and keeps only their tensor operations: "
            + "; ".join(f"module {name!r} has a {kind}" for name, kind in hooked.items()) +
            "\n    Fix: capture with fx (capture='fx' or 'auto'), which keeps hooked modules "
            "whole so their hooks run on every micro-batch; or remove the hooks before compiling")
    elif capture in ("auto", "export"):
        gm, failure = _without_side_effects(
            model, example, _export, model, example_inputs, example_kwargs, batch_dims,
            device_type)
        if gm is not None:
            gm.meta["capture"] = Capture("export", (), tuple(failures), training=model.training,
                                         reason=why_coarse or _because(failures),
                                         uncached=uncached, fake=gm.meta.pop("fake", None))
            if uncached:   # the pipeline's callers leave it out, as the model's do
                signature = gm.meta["signature"]
                gm.meta["signature"] = replace(signature,
                                               defaults={**signature.defaults, "use_cache": False})
            return gm
        failures.append(f"torch.export: {failure}\n    {_FIX['export']}")
    if coarse is not None:   # still a faithful graph: the partitioner says what it can do with it
        kept = coarse.meta["capture"]
        why = f"{why_coarse}, and {_because(failures[-1:])}"
        coarse.meta["capture"] = replace(kept, failures=(*kept.failures, failures[-1]),
                                         reason=f"{kept.reason}; {why}" if kept.reason else why)
        return coarse
    raise TraceError(f"could not capture {type(model).__name__} as a graph:\n  - " +
                     "\n  - ".join(failures))


def without_cache(model: nn.Module, args: tuple, kwargs: Mapping[str, Any] | None) -> dict:
    """`kwargs` (a copy), with `use_cache=False` where `model`'s forward takes `use_cache` and
    the example leaves it out: Hugging Face's default.

    A pipeline computes the model's outputs on whole sequences. The key/value cache that a
    generation loop carries from one call to the next (`use_cache=True`, a `DynamicCache` in
    the output) is not a tensor any front-end can return nor one micro-batches can merge, so
    the pipeline is captured without it (`past_key_values` is then None) and an example that
    asks for it is refused.
    """
    kwargs = dict(kwargs or {})
    try:
        signature = inspect.signature(model.forward)
        given = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return kwargs
    if "use_cache" not in signature.parameters:
        return kwargs
    if "use_cache" not in given:
        kwargs["use_cache"] = False
    elif given["use_cache"] is not False:
        raise TraceError(
            f"use_cache={given['use_cache']!r}: a pipeline runs {type(model).__name__} on whole "
            f"sequences and does not return the key/value cache that generation carries from one "
            f"call to the next. Fix: leave use_cache out of the example (it is then False), and "
            f"generate with the model itself")
    return kwargs


def _because(failures: Iterable[str]) -> str:
    """`torch.fx failed: TraceError: ...`: the first line of each failure, as a reason."""
    return "; ".join(f.splitlines()[0].replace(": ", " failed: ", 1) for f in failures)


def _too_coarse(model: nn.Module, gm: fx.GraphModule, given_leaves: Iterable[str | type],
                stages: int) -> str:
    """Why `gm` is too coarse to balance `stages` stages, or "" when it is not.

    The rule, from what is known without measuring: a module fxpipe kept whole (fx keeps torch.nn's
    own modules whole, as `nn.TransformerEncoder`; fx+leaves those whose forward broke tracing),
    which has submodules, is too big when the graph has fewer computing nodes than stages (the
    partitioner would refuse it), or when it alone holds most of the model's parameters, more
    than any stage's share: a split around it cannot balance. Parameters stand for work here
    only where one module dwarfs the rest; a smaller leaf (a loop kept whole, one of many
    attention blocks) is left to the partitioner. A module without submodules is one op in any
    front-end, and those the user or a hook asked to keep whole (`given_leaves`) stay whole.
    """
    if stages <= 1:
        return ""
    computing = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    total = sum(p.numel() for p in model.parameters())
    given = tuple(l for l in given_leaves if isinstance(l, type))
    names = {l for l in given_leaves if isinstance(l, str)}
    found = []
    for name in dict.fromkeys(n.target for n in computing if n.op == "call_module"):
        module = model.get_submodule(name)
        if name in names or isinstance(module, given) or not next(module.children(), None):
            continue
        params = sum(p.numel() for p in module.parameters())
        if len(computing) < stages or params * 2 > total > 0:
            found.append((params, name, module))
    if not found:
        return ""
    params, name, module = max(found, key=lambda item: item[0])
    share = f", {params / total:.0%} of the parameters" if total else ""
    why = (f"too coarse to balance {stages} stages" if params * 2 > total > 0 else
           f"and its graph has {len(computing)} computing nodes, too few for {stages} stages")
    return f"torch.fx kept {name!r} ({type(module).__name__}{share}) whole, {why}"


_FIX = {
    "fx": "Fix: pass the module that breaks tracing in leaf_modules=[...] to keep it whole, pass "
          "fixed values for Python-level options in concrete_args={...}, or rewrite the line "
          "without Python control flow on tensor values.",
    "export": "Fix: torch.export follows Python control flow on sizes, not on tensor values: "
              "write such a branch with torch.cond(pred, true_fn, false_fn, operands), or move it "
              "out of forward.",
}


class _Tracer(fx.Tracer):
    """fx's tracer, keeping `leaves` whole and recording each node's explicit grad mode.

    `node.meta["grad_enabled"]` is False for a node traced under `torch.no_grad()`,
    `torch.inference_mode()` or `torch.set_grad_enabled(False)` in forward, True under
    `torch.enable_grad()` or `torch.set_grad_enabled(True)`, and absent where the caller's mode
    applies; `fxpipe.passes.codegen` runs those nodes in that mode. Tracing runs with grad enabled, so a
    disabled mode is the model's own, and counts the grad-mode context managers forward is in,
    so an enabled mode inside one is too.
    """

    # Buffers read in forward become `get_attr` nodes, as parameters do: otherwise fx runs a
    # buffer write (`self.calls.add_(1)`) once on the real tensor while tracing and leaves it out
    # of the graph (state writes: see passes/state.py).
    proxy_buffer_attributes = True

    def __init__(self, leaves: Iterable[str | type]):
        super().__init__()
        self.record_stack_traces = True    # errors about a node name the user's line
        self.leaf_names = {l for l in leaves if isinstance(l, str)}
        self.leaf_types = tuple(l for l in leaves if isinstance(l, type))
        self.grad_contexts = _GradContexts()

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return (qualified_name in self.leaf_names or isinstance(m, self.leaf_types)
                or super().is_leaf_module(m, qualified_name))

    def trace(self, root, concrete_args=None) -> fx.Graph:
        with torch.enable_grad(), self.grad_contexts:
            return super().trace(root, concrete_args)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """fx's placeholders for `root_fn`'s parameters, and a function taking them.

        A forward wrapped by a `*args, **kwargs` decorator (Hugging Face's `can_return_tuple`,
        output capture) whose own parameters end in `**kwargs` is one fx cannot take apart
        (it rewrites the code object of the wrapper, which has too few names): it is traced
        through `_fx_forward(root_fn)`, which calls the decorated forward itself.
        """
        if is_module:
            root_fn = _fx_forward(root_fn)
        return super().create_args_for_root(root_fn, is_module, concrete_args)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind not in ("placeholder", "output", "get_attr"):
            if not torch.is_grad_enabled():
                node.meta["grad_enabled"] = False
            elif self.grad_contexts.depth:
                node.meta["grad_enabled"] = True
        return node


_GRAD_MODES = (torch.no_grad, torch.enable_grad, torch.set_grad_enabled, torch.inference_mode)
_GRAD_ENTERS = frozenset(vars(cls)["__enter__"].__code__ for cls in _GRAD_MODES)
_GRAD_EXITS = frozenset(vars(cls)["__exit__"].__code__ for cls in _GRAD_MODES)


_AUTOCAST_ENTER = torch.amp.autocast_mode.autocast.__enter__.__code__


class _GradContexts:
    """While active, `depth` counts the grad-mode context managers (`with torch.no_grad():`, and
    the decorator forms) this thread is inside: it watches their `__enter__` and `__exit__` with a
    profile hook, which sees only this thread's calls. `autocast` is where forward first entered
    an enabled `torch.autocast` (the user's line), which fx cannot record; None if it never did
    (a disabled one, `enabled=False` or of a device this machine lacks, changes nothing)."""

    def __init__(self):
        self.depth = 0
        self.autocast: str | None = None

    def __enter__(self) -> "_GradContexts":
        self.depth, self.autocast, self.previous = 0, None, sys.getprofile()
        sys.setprofile(self._watch)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self.previous)

    def _watch(self, frame, event: str, arg) -> None:
        if event == "call" and frame.f_code in _GRAD_ENTERS:
            self.depth += 1
        elif event == "return" and frame.f_code in _GRAD_EXITS:
            self.depth = max(0, self.depth - 1)
        elif event == "call" and frame.f_code is _AUTOCAST_ENTER and self.autocast is None \
                and getattr(frame.f_locals.get("self"), "_enabled", False):
            where = user_frame()
            self.autocast = describe_frame(where, "", one_line=True) if where else \
                "in a torch module"


def _fx_forward(forward):
    """The function fx traces for a module class's `forward`: `forward` itself, or, where a
    `*args, **kwargs` decorator wraps a function whose own parameters end in `**kwargs`, a
    function with that function's parameters but no `**kwargs`, calling `forward` (its
    decorators included) by keyword.

    fx reads a traced function's parameters off its code object, so that one is compiled from
    a `def`; the graph then takes the named parameters only, and an input forward would take
    through `**kwargs` (`output_attentions=True`) is refused by name, not dropped.
    """
    inner = inspect.unwrap(forward)
    flags = inner.__code__.co_flags
    if inner is forward or not flags & inspect.CO_VARKEYWORDS or flags & inspect.CO_VARARGS:
        return forward
    params = [p for p in inspect.signature(inner).parameters.values()
              if p.kind is not p.VAR_KEYWORD]
    positional = [p.name for p in params if p.kind is not p.KEYWORD_ONLY]
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    declared = ", ".join(positional + (["*", *keyword_only] if keyword_only else []))
    passed = ", ".join([positional[0]] + [f"{name}={name}" for name in
                                          positional[1:] + keyword_only])
    namespace = {"_decorated": forward}
    exec(f"def {inner.__name__}({declared}):\n    return _decorated({passed})\n", namespace)
    function = namespace[inner.__name__]
    function.__defaults__, function.__kwdefaults__ = inner.__defaults__, inner.__kwdefaults__
    function.__qualname__ = inner.__qualname__
    return function


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
    # What tracing left in the model's attributes (proxies in a cache) must not reach the check
    # run below; the graph module takes the constants fx stored on the model first.
    with attributes_restored(model) if args or kwargs else contextlib.nullcontext():
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
        except Exception as e:  # fx raises many kinds; each becomes a reported failure
            raise _TraceFailure(_describe(e, model), _culprit(e, model)) from e
        for node in graph.find_nodes(op="placeholder"):   # an input fixed to a value defaults to it
            name = node.target.removesuffix("_1")
            if (node.args and name != node.target and name in concrete
                    and not isinstance(concrete[name], (tuple, list, dict))):
                node.args = (concrete[name],)
        if tracer.grad_contexts.autocast is not None:
            raise _TraceFailure(
                f"forward runs ops under torch.autocast ({tracer.grad_contexts.autocast}), "
                f"which torch.fx does not record: the graph would compute them in their own "
                f"dtypes. torch.export keeps autocast regions (capture='export' or 'auto')",
                None)
        gm = plain_varargs(fx.GraphModule(tracer.root, graph, type(model).__name__))
        _keep_non_persistent(model, gm)
    out_spec = None
    if (args or kwargs) and not holds_meta(model):   # a meta model has no values to compare
        mismatch, out_spec = _mismatch(model, gm, args, kwargs)
        if mismatch:
            raise _TraceFailure(f"the traced graph does not reproduce the model: {mismatch}", None)
    forward = _fx_forward(type(model).forward).__get__(model)
    gm.meta["signature"] = traced_signature(gm, forward, concrete, out_spec)
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


def _export(model: nn.Module, args: tuple, kwargs: Mapping[str, Any], batch_dims: Any = 0,
            device_type: str | None = None):
    try:
        return _export_or_raise(model, args, kwargs, batch_dims, device_type), None
    except _TraceFailure as failure:
        return None, failure


def _export_or_raise(model: nn.Module, args: tuple, kwargs: Mapping[str, Any],
                     batch_dims: Any = 0, device_type: str | None = None) -> fx.GraphModule:
    """`model` exported (see the module docstring). A model on meta is exported on inputs on
    meta (no op may meet two devices), its ops then naming the inputs' device again; where that
    fails, or the graph keeps an enabled autocast region of `device_type` (meta tensors do not
    autocast: a dtype forward reads there, baked into the graph, would not be the run's), it is
    exported again on fake tensors of `device_type` (`_on_fake_tensors`)."""
    if not args and not kwargs:
        raise _TraceFailure("torch.export needs example inputs: pass example_inputs or "
                            "example_kwargs", None)
    inputs_device = next((t.device for t in pytree.tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor)), torch.device("cpu"))
    device_type = device_type or inputs_device.type
    on_meta = holds_meta(model)
    try:
        program, inference, fixes = _exported(model, args, kwargs, batch_dims,
                                              "meta" if on_meta else None)
        on_fake = on_meta and device_type in _autocast_regions(program.graph_module)
    except _TraceFailure as failure:
        if not on_meta:
            raise
        try:
            program, inference, fixes = _exported(model, args, kwargs, batch_dims, device_type)
        except _TraceFailure:
            raise failure from None     # the model's own failure, as meta showed it
        on_fake = True
    else:
        if on_fake:     # where fake tensors fail, the graph exported on meta stays (checked)
            try:
                program, inference, fixes = _exported(model, args, kwargs, batch_dims,
                                                      device_type)
            except _TraceFailure:
                on_fake = False
    if inference.site is not None:
        raise _TraceFailure(
            f"forward runs ops in torch.inference_mode() ({inference.site}), which torch.export "
            f"leaves out of the graph: those ops would get gradients. Use torch.no_grad() there, "
            f"which the graph keeps", None)
    gm = _readable(program.module(), type(model).__name__)
    if on_fake:
        _model_tensors(gm, model)
        gm.meta["fake"] = device_type
    if on_meta:
        place(gm, inputs_device)
        mismatch = ""       # no values to compare: compile's check runs it streamed
    else:
        mismatch, _ = _mismatch(model, gm, args, kwargs)
    if mismatch:
        raise _TraceFailure(f"the exported graph does not reproduce the model: {mismatch}", None)
    signature = exported_signature(gm, program.module_call_graph[0].signature)
    sources = _input_sources(model, args, kwargs, batch_dims)
    gm.meta["signature"] = replace(signature, size_rules=_size_rules(program, sources),
                                   fixed_at=fixes.placeholder_dims(program, sources))
    return gm


def _exported(model: nn.Module, args: tuple, kwargs: Mapping[str, Any], batch_dims: Any,
              device: str | None) -> tuple[torch.export.ExportedProgram, "_InferenceModeWatch",
                                           "_SizeFixes"]:
    """torch.export on the model as it is (`device` None), on inputs on meta ("meta"), or on
    fake tensors of the device type `device` (the model's meta tensors and the inputs); the
    watches it ran under."""
    inference, fixes = _InferenceModeWatch(), _SizeFixes()
    given = (tuple(args), dict(kwargs))
    fake = contextlib.nullcontext(given) if device is None else \
        _on_meta_inputs(given) if device == "meta" else _on_fake_tensors(model, given, device)
    try:
        with _quiet(), attributes_restored(model), fake as given:   # nothing export left there
            with inference, fixes:
                program = torch.export.export(model, *given, strict=False,
                                              dynamic_shapes=_free_sizes(model, *given,
                                                                         batch_dims))
    except Exception as e:  # export raises many kinds; each becomes a reported failure
        raise _TraceFailure(_describe(e, model), _culprit(e, model)) from e
    return program, inference, fixes


@contextlib.contextmanager
def _on_meta_inputs(given: tuple[tuple, dict]) -> Iterator[tuple[tuple, dict]]:
    yield pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, given)


@contextlib.contextmanager
def _on_fake_tensors(model: nn.Module, given: tuple[tuple, dict], device_type: str
                     ) -> Iterator[tuple[tuple, dict]]:
    """While open, the model's meta tensors (parameters, buffers, plain tensor attributes) are
    fake tensors of `device_type` (one per tensor: tied ones stay tied), restored on exit;
    yields the inputs on that device type (copies of the example's where it is elsewhere:
    export makes its own fake tensors of them, in the fake mode it leaves sizes free in). No
    weight is allocated: a fake tensor has a device, a shape and a dtype, and ops on it run
    their meta kernels, but autocast and code asking for the device see `device_type`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = torch.device(device_type)
    fakes: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            with mode:
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            fakes[id(t)] = nn.Parameter(fake, t.requires_grad) \
                if isinstance(t, nn.Parameter) else fake
        return fakes[id(t)]
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers, vars(module)):
                for name, t in list(table.items()):
                    if isinstance(t, torch.Tensor) and t.is_meta:
                        swapped.append((table, name, t))
                        table[name] = fake_of(t)
        yield pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) and
                              v.device.type != device.type else v, given)
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


def _model_tensors(gm: fx.GraphModule, model: nn.Module) -> None:
    """Put in `gm` (exported on fake tensors) the model's own tensors under the same names,
    as an export on meta holds them (the model's objects: tied ones stay one); a tensor the
    model does not hold there becomes a meta tensor of its shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensor

    for path, owner in gm.named_modules():
        try:
            source = model.get_submodule(path)
        except AttributeError:
            source = None
        for table in (owner._parameters, owner._buffers, vars(owner)):
            for name, t in list(table.items()):
                if not isinstance(t, FakeTensor) and not (
                        isinstance(t, nn.Parameter) and isinstance(t.data, FakeTensor)):
                    continue
                theirs = None if source is None else (
                    source._parameters.get(name) if name in source._parameters else
                    source._buffers.get(name) if name in source._buffers else
                    vars(source).get(name))
                if not isinstance(theirs, torch.Tensor) or theirs.shape != t.shape:
                    theirs = torch.empty(t.shape, dtype=t.dtype, device="meta")
                    if table is owner._parameters:
                        theirs = nn.Parameter(theirs, t.requires_grad)
                table[name] = theirs


def _autocast_regions(gm: fx.GraphModule) -> set[str]:
    """The device types of the enabled autocast regions an export graph keeps (nested ones
    too, in the bodies of higher-order ops)."""
    from torch._higher_order_ops.wrap import wrap_with_autocast

    return {n.args[0] for module in gm.modules() if isinstance(module, fx.GraphModule)
            for n in module.graph.nodes if n.target is wrap_with_autocast and n.args[2]}


class _InferenceModeWatch(TorchFunctionMode):
    """Notes where forward first runs a torch op in inference mode (`site`, the user's line):
    torch.export records `no_grad` regions in its graph but drops `inference_mode` ones."""

    site: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.site is None and torch.is_inference_mode_enabled():
            frame = user_frame()
            self.site = describe_frame(frame, "", one_line=True) if frame else "in a torch module"
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep torch's own output off the terminal while it runs: when torch.export fails, it prints
    its partial graph (hundreds of lines) and logs warnings before fxpipe's one message. What it
    prints to stderr, and the records torch's loggers emit on this thread, go to this module's
    logger at DEBUG level instead (`logging.getLogger("fxpipe.passes.trace")`)."""
    captured = io.StringIO()
    thread = threading.get_ident()

    def keep(record: logging.LogRecord) -> bool:
        if record.thread != thread:
            return True
        captured.write(f"{record.levelname} {record.name}: {record.getMessage()}\n")
        return False
    handlers = {h for name, logger in logging.Logger.manager.loggerDict.items()
                if name.split(".")[0] == "torch" and isinstance(logger, logging.Logger)
                for h in logger.handlers}
    for handler in handlers:
        handler.addFilter(keep)
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        for handler in handlers:
            handler.removeFilter(keep)
        if captured.getvalue():
            _log.debug("torch's output while exporting:\n%s", captured.getvalue())


def _free_sizes(model: nn.Module, args: tuple, kwargs: Mapping[str, Any],
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
    the free ones (`_size_rules`).
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


def _input_sources(model: nn.Module, args: tuple, kwargs: Mapping[str, Any],
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


def _size_rules(program: torch.export.ExportedProgram,
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


class _SizeFixes(TorchFunctionMode):
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


def _keep_non_persistent(source: nn.Module, target: fx.GraphModule) -> None:
    """Mark non-persistent in `target` the buffers `source` holds as non-persistent:
    `fx.GraphModule` registers every tensor it copies as a persistent buffer, and the
    pipeline's `state_dict()` must be the model's (a rotary `inv_freq` is in no checkpoint)."""
    for path, module in source.named_modules(remove_duplicate=False):
        for name in module._non_persistent_buffers_set:
            try:
                owner = target.get_submodule(path)
            except AttributeError:
                continue
            if owner is not module and name in owner._buffers:
                owner._non_persistent_buffers_set.add(name)


_HOOKS = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
          "_backward_pre_hooks": "backward pre-hook", "_backward_hooks": "backward hook"}


def _hooked_modules(model: nn.Module) -> dict[str, str]:
    """The submodules with hooks, by qualified name, each with the kind of its first hook.

    A hook on the model itself would never run (the pipeline runs the graph in stages, never
    the model), so it is refused: the pipeline, an nn.Module, takes forward hooks itself.
    Output-recording hooks (`_records_outputs`) do not count.
    """
    hooked = {}
    for name, module in model.named_modules():
        kind = hook_kind(module)
        if kind and not name:
            raise TraceError(
                f"the model ({type(model).__name__}) has a {kind}, which a pipeline never runs: "
                f"it runs the model's graph in stages and never calls the model. Fix: register "
                f"the hook on the pipeline (pipe.register_forward_hook(...), as on the model), "
                f"or on a submodule, which fxpipe keeps whole so that its hooks run")
        if kind:
            hooked[name] = kind
    return hooked


def hook_kind(module: nn.Module) -> str | None:
    """The kind of `module`'s first hook ("forward hook", ...), or None where it has none but
    output-recording ones (`_records_outputs`)."""
    return next((kind for attr, kind in _HOOKS.items()
                 if not all(map(_records_outputs, getattr(module, attr, {}).values()))), None)


def _records_outputs(hook: Any) -> bool:
    """Whether `hook` is Hugging Face's output-recording forward hook. transformers installs one
    on each module at the first call asking for hidden states or attentions; it only appends
    the module's output to the collector of the model call under way (inactive otherwise),
    which the model's forward returns. A capture runs it with the model: what it recorded
    becomes the graph's outputs, as the model returns them."""
    return (getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
            and getattr(hook, "__name__", None) == "output_capturing_hook")


_STATE = ("_parameters", "_buffers", "_modules")


def _snapshot(model: nn.Module) -> list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]:
    """Every module's plain attributes (not parameters, buffers, submodules), and the contents
    of the lists, dicts and sets among them, as objects: what a forward's Python could change."""
    return [(m, {k: v for k, v in vars(m).items() if k not in _STATE},
             {k: copy.copy(v) for k, v in vars(m).items()
              if k not in _STATE and isinstance(v, (list, dict, set))})
            for m in model.modules()]


def _restore_attributes(snapshot) -> list[tuple[nn.Module, str, Any]]:
    """Put every attribute of `snapshot` back as it was; the (module, name, value it had, or
    the changed container) of each that changed."""
    changed = []
    for module, values, contents in snapshot:
        attrs = vars(module)
        for name in [k for k in attrs if k not in _STATE and k not in values]:
            changed.append((module, name, attrs.pop(name)))
        for name, value in values.items():
            if attrs.get(name) is not value:
                changed.append((module, name, attrs.get(name)))
                attrs[name] = value
            if name in contents and not _same_contents(value, contents[name]):
                changed.append((module, name, list(value)))
                if isinstance(value, list):
                    value[:] = contents[name]
                else:
                    value.clear()
                    value.update(contents[name])
    return changed


def _same_contents(now: Any, before: Any) -> bool:
    if isinstance(now, dict):
        return now.keys() == before.keys() and all(now[k] is before[k] for k in now)
    if isinstance(now, set):
        return now == before
    return len(now) == len(before) and all(a is b for a, b in zip(now, before))


@contextlib.contextmanager
def attributes_restored(model: nn.Module):
    """Undo, on exit, every change to the plain attributes of `model`'s modules (see `_snapshot`):
    for any run of the model on an example, so that compiling leaves the model as it was."""
    snapshot = _snapshot(model)
    try:
        yield
    finally:
        _restore_attributes(snapshot)


def _without_side_effects(model: nn.Module, example: tuple[tuple, Mapping[str, Any]],
                          front_end, *args):
    """`front_end(*args)`, leaving `model`'s attributes as they were.

    A TraceError names the first public attribute that forward filled (a list, dict or set), or
    set to a tensor (or a tracer's stand-in for one) or a number, and that a second run on the
    `example` (args, kwargs) changes again (see `_unsettled`): what a pipeline would not do per
    call (`self.seen.append(x)`, `self.calls += 1`). Other changes are only undone: private
    attributes, and what forward fills on first use and then keeps, a cache or a setting (a
    dict of tensors filled once per device, a size computed from the input's).
    """
    snapshot = _snapshot(model)
    try:
        return front_end(*args)
    finally:
        changed = [(m, name) for m, name, value in _restore_attributes(snapshot)
                   if not name.startswith("_") and _per_call(value)]
        changed = _unsettled(model, example, changed)
        if changed:
            raise _side_effect_error(model, *changed[0])


def _unsettled(model: nn.Module, example: tuple[tuple, Mapping[str, Any]],
               changed: list[tuple[nn.Module, str]]) -> list[tuple[nn.Module, str]]:
    """Those of the `changed` (module, attribute name) that forward changes on every call: run
    eagerly on the example twice, the second run leaves them other than the first left them
    (a list grown, a number counted on, a new tensor stored), or the model cannot run so.
    Without an example, all of them. Everything is restored afterwards."""
    args, kwargs = example
    if not changed or not (args or kwargs):
        return changed
    snapshot = _snapshot(model)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), unchanged_state(model):
            model(*_copied(args), **_copied(kwargs))
            first = [_held(module, name) for module, name in changed]
            model(*_copied(args), **_copied(kwargs))
            return [c for c, before in zip(changed, first) if not _settled(before, _held(*c))]
    except Exception:  # the model's own failure is reported by the front-ends
        return changed
    finally:
        _restore_attributes(snapshot)


def _held(module: nn.Module, name: str) -> tuple[Any, Any]:
    """An attribute's value (None when absent), and a copy of its contents if a container."""
    value = vars(module).get(name)
    return value, copy.copy(value) if isinstance(value, (list, dict, set)) else None


def _settled(before: tuple[Any, Any], now: tuple[Any, Any]) -> bool:
    """Whether an attribute holds what it held (`_held`): the same object with the same contents,
    or a new value equal to the old that holds no tensor (a size or setting computed again)."""
    (value, contents), (new, _) = before, now
    if new is value:
        return contents is None or _same_contents(new, contents)
    return not any(isinstance(v, (torch.Tensor, fx.Proxy)) for v in pytree.tree_leaves(new)) \
        and equal(new, value)


def _per_call(value: Any) -> bool:
    """Whether a changed attribute's value looks computed per call: a container forward filled
    (given as a list), a number, or anything holding a tensor or an fx Proxy."""
    if isinstance(value, list) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return True
    return any(isinstance(v, (torch.Tensor, fx.Proxy)) for v in pytree.tree_leaves(value))


def _side_effect_error(model: nn.Module, module: nn.Module, name: str) -> TraceError:
    path = next((p for p, m in model.named_modules() if m is module), "")
    where = f"module {path!r} ({type(module).__name__})" if path else type(module).__name__
    message = (f"forward changes {where}'s attribute {name!r}: a Python side effect, which a "
               f"pipeline would not reproduce, since it runs the model's tensor operations only")
    try:
        lines, start = inspect.getsourcelines(type(module).forward)
        file = inspect.getsourcefile(type(module).forward)
        found = next((i for i, line in enumerate(lines) if re.search(rf"\bself\.{name}\b", line)),
                     None)
        if found is not None:
            frame = traceback.FrameSummary(file, start + found, "forward", line=lines[found])
            message += "\n" + describe_frame(frame, "      ", one_line=True)
    except (OSError, TypeError):
        pass
    return TraceError(message + "\n    Fix: move it out of forward (do it with the pipeline's "
                      "inputs or outputs), or into a forward hook on a submodule, which fxpipe "
                      "keeps whole so that its hook runs on every micro-batch")


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


def _describe(error: BaseException, model: nn.Module) -> str:
    message = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    frame = user_frame(error)
    if frame is not None:
        message += "\n" + describe_frame(frame, "      ", one_line=True)
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


def _mismatch(model: nn.Module, gm: fx.GraphModule, args: tuple,
              kwargs: Mapping[str, Any]) -> tuple[str, pytree.TreeSpec | None]:
    """Why `gm` does not reproduce `model` on the example ("" when it does), and the structure
    of the model's output, which the signature keeps so that the pipeline returns the model's
    own containers (an `OrderedDict`, where fx's graph returns a `dict`).

    Each runs on its own copy of the example (a forward may write its inputs in place), from the
    same random state, and buffers (e.g. BatchNorm statistics) are restored afterwards, so
    checking leaves the model and the caller's tensors as they were. Outputs compare as in
    `fxpipe.passes.compare`.
    """
    given = _copied((args, kwargs))
    # `manual_seed` seeds every GPU's generator too: each one there is is forked.
    cuda = initialized_gpus()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            with unchanged_state(model):
                torch.manual_seed(0)
                expected = model(*given[0], **given[1])
            with unchanged_state(model):
                torch.manual_seed(0)
                actual = gm(*_copied(args), **_copied(kwargs))
    except Exception as e:
        return f"running the graph raised {type(e).__name__}: {e}", None
    gm.meta["input_writes"] = _written_inputs(model, (args, kwargs), given)
    return difference(actual, expected, tolerance=None), pytree.tree_structure(expected)


def _copied(value: Any) -> Any:
    """`value` with every tensor in it cloned."""
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num())


def _written_inputs(model: nn.Module, inputs: tuple, ran_on: tuple) -> tuple[str, ...]:
    """The inputs whose copies the model's forward changed (`x += 1`, `x.mul_(2)`), by name:
    `fxpipe.passes.functionalize` refuses them (a graph may not show the write: fx records `x += 1`
    on a tensor as an add)."""
    try:
        names = inspect.signature(model.forward).bind(*inputs[0], **inputs[1]).arguments
        ran = inspect.signature(model.forward).bind(*ran_on[0], **ran_on[1]).arguments
    except (TypeError, ValueError):
        names, ran = dict(enumerate([*inputs[0], *inputs[1].values()])), dict(
            enumerate([*ran_on[0], *ran_on[1].values()]))
    return tuple(str(name) for name, value in names.items()
                 if any(isinstance(before, torch.Tensor) and not _same(before, after)
                        for before, after in zip(pytree.tree_leaves(value),
                                                 pytree.tree_leaves(ran[name]))))
