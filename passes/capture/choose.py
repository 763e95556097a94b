"""The front-ends tried in order, and the choice among them (`trace`).

`capture="auto"` tries fx, then fx+leaves (where fx failed inside a submodule), then export. A
graph counts only if it reproduces the model's output on the example inputs. A graph must also
be fine enough for the stages asked: an fx graph that keeps a big module whole (torch.nn's own
`TransformerEncoder`, whose fast path fx cannot follow) gives way to export (`_too_coarse`).
When no front-end captures the model, one `TraceError` lists each failure with the user's
source line and a fix.

A model whose forward takes `use_cache` is captured with `use_cache=False` (`without_cache`): no
front-end returns a key/value cache.

Each front-end runs under `without_side_effects`, and any exception inside a front-end is its
failure. An fx graph is too coarse when it has fewer nodes than stages, or keeps a module whole
that holds most parameters; it stays where export fails, and the capture says why. When every
front-end fails and the model itself fails on the example, an `InputError` quotes torch first; else
one `TraceError` lists each front-end's reason (the user's line) and fix. A tensor default argument
is an input given its default (`with_tensor_defaults`: a graph cannot spell a tensor). `export` is
imported only when tried (it loads sympy; `EXPORT` is a lazy attribute of the package): an fx
compile imports no compiler stack (`tests/test_lazy_imports.py`).
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any, Iterable, Literal, Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from ..device import forked_generators
from ..errors import FxpipeError, InputError, TraceError
from ..materialize import holds_meta
from ..state import unchanged_state
from .frontend import Capture, Captured, CaptureFailed, FrontEnd, Request, copied, describe
from .fx import FX
from .fx_leaves import FX_LEAVES
from .side_effects import hooked_modules, without_side_effects

CaptureMode = Literal["auto", "fx", "export"]
CAPTURE_MODES: tuple[str, ...] = ("auto", "fx", "export")


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
    run's), is exported again on fake tensors of that kind (`fxpipe.passes.capture.export`).
    """
    if capture not in CAPTURE_MODES:
        raise TraceError(f"unknown capture mode {capture!r}\n"
                         f"use one of {', '.join(CAPTURE_MODES)}")
    request = _request(model, example_inputs, example_kwargs, leaf_modules, concrete_args,
                       batch_dims, device_type)
    tried: list[tuple[FrontEnd, CaptureFailed]] = []
    coarse: fx.GraphModule | None = None     # an fx graph too coarse for `stages`: the fallback
    why_coarse = ""

    if capture in ("auto", "fx"):
        captured = _attempt(FX, model, request, tried)
        if captured is None and capture == "auto" and tried[-1][1].culprit:   # one to keep whole
            captured = _attempt(FX_LEAVES, model, request, tried)
        if captured is not None:
            why_coarse = _too_coarse(model, captured.gm, request.leaves, stages) \
                if capture == "auto" else ""
            if not why_coarse:
                return captured.gm
            coarse = captured.gm
    if capture in ("auto", "export"):
        from .export import EXPORT     # here: export's imports (sympy) wait until it is tried
        captured = _attempt(EXPORT, model, request, tried, why_coarse)
        if captured is not None:
            return captured.gm
    failures = _failures(tried)
    if coarse is not None:   # still a faithful graph: the partitioner says what it can do with it
        kept = coarse.meta["capture"]
        why = f"{why_coarse}, and {_because(failures[-1:])}"
        coarse.meta["capture"] = replace(kept, failures=(*kept.failures, failures[-1]),
                                         reason=f"{kept.reason}; {why}" if kept.reason else why)
        return coarse
    _raise_if_the_model_fails(model, request)
    raise TraceError(f"could not capture {type(model).__name__} as a graph:\n  - " +
                     "\n  - ".join(failures))


def _request(model: nn.Module, args: tuple, kwargs: Mapping[str, Any] | None,
             leaf_modules: Iterable[str | type], concrete_args: Mapping[str, Any] | None,
             batch_dims: Any, device_type: str | None) -> Request:
    """What every front-end is asked (see `Request`): the example without the key/value cache,
    the inputs fx fixes, the modules it keeps whole (those given, then those with hooks)."""
    kwargs = with_tensor_defaults(model, args, without_cache(model, args, kwargs))
    concrete = _default_concrete_args(model, args, kwargs)
    concrete.update(concrete_args or {})
    if kwargs.get("use_cache") is False:    # fx fixes use_cache, which forward branches on
        concrete["use_cache"] = False
    hooked = hooked_modules(model)
    given = list(leaf_modules)
    leaves = given + [name for name in hooked if name not in given]
    return Request(tuple(args), kwargs, tuple(leaves), concrete, hooked, batch_dims, device_type)


def _attempt(front_end: FrontEnd, model: nn.Module, request: Request,
             tried: list[tuple[FrontEnd, CaptureFailed]], reason: str = "") -> Captured | None:
    """`front_end`'s graph of `model`, which records how it was captured (`Capture`: why not
    the front-ends `tried` before, or `reason`), leaving the model's attributes as they were;
    None where it failed, its failure added to `tried`."""
    try:
        captured = without_side_effects(model, request.example, front_end.capture, model, request)
    except CaptureFailed as failure:
        tried.append((front_end, failure))
        return None
    except FxpipeError:
        raise
    except Exception as e:     # whatever breaks inside a front-end is that front-end's failure
        tried.append((front_end, CaptureFailed.of(e, model)))
        return None
    failures = _failures(tried)
    captured.gm.meta["capture"] = Capture(
        front_end.method, captured.leaves, failures, training=captured.training,
        reason=reason or _because(failures), uncached=request.uncached, fake=captured.fake)
    return captured


def _raise_if_the_model_fails(model: nn.Module, request: Request) -> None:
    """An `InputError` quoting torch where `model` itself fails on the example (a shape, a
    dtype, a device): no front-end could capture it then, and none is the cause."""
    if holds_meta(model) or not (request.args or request.kwargs):
        return
    given = copied((request.args, request.kwargs))
    try:
        with torch.no_grad(), forked_generators(), \
                unchanged_state(model):
            without_side_effects(model, request.example, lambda: model(*given[0], **given[1]))
    except Exception as e:
        raise InputError(
            f"{type(model).__name__} fails on its example inputs: {describe(e, model)}\n"
            f"    Fix: give example inputs the model runs on, as "
            f"model(*example_inputs, **example_kwargs) takes them (their shapes, dtypes and "
            f"devices those of the model's parameters)") from e


def _failures(tried: Iterable[tuple[FrontEnd, CaptureFailed]]) -> tuple[str, ...]:
    """Each failure as the capture lists it: the front-end, the reason, then the fix."""
    return tuple(f"{front_end.label}: {failure.reason}\n    {failure.fix or front_end.fix}"
                 for front_end, failure in tried)


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
            f"use_cache={given['use_cache']!r}: a pipeline returns no key/value cache\n"
            f"a pipeline runs {type(model).__name__} on whole sequences and does not return the "
            f"key/value cache that generation carries from one call to the next\n"
            f"    Fix: leave use_cache out of the example (it is then False), and "
            f"generate with the model itself")
    return kwargs


def _because(failures: Iterable[str]) -> str:
    """`torch.fx failed: TraceError: ...`: the first line of each failure, as a reason (up to
    a bracket it leaves open: a structure dumped over several lines, a TreeSpec, is left out)."""
    return "; ".join(_closed(f.splitlines()[0]).replace(": ", " failed: ", 1) for f in failures)


def _closed(line: str) -> str:
    """`line` up to the first bracket it does not close, marked `(...)`; as is if none."""
    pairs, opened = {")": "(", "]": "[", "}": "{"}, []
    for i, c in enumerate(line):
        if c in "([{":
            opened.append(i)
        elif c in pairs and opened and line[opened[-1]] == pairs[c]:
            opened.pop()
    return line if not opened else line[:opened[0]].rstrip(" :,=") + " (...)"


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


def with_tensor_defaults(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> dict:
    """`kwargs` (a copy) with the defaults that hold tensors (`y=torch.zeros(B, D)`) of the
    inputs the example does not give: those are captured as inputs, given their defaults, so
    that a call may pass another value and each micro-batch takes its rows of the default (a
    graph cannot hold a tensor as a default, and fixing it would fix the batch size)."""
    return {**kwargs, **{
        name: default for name, default in _default_concrete_args(model, args, kwargs).items()
        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(default))}}


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
