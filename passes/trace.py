"""nn.Module -> fx.GraphModule, by the first front-end that captures the model faithfully.

Front-ends, in order (`capture="auto"`):
1. `fx`: plain `torch.fx` symbolic tracing, module-level nodes with the user's names.
2. `fx+leaves`: fx again, with every submodule whose forward broke tracing made a leaf (called
   whole, as one node), found one at a time from where tracing failed.

A graph counts only if it reproduces the model's output on the example inputs. When no front-end
captures the model, one `TraceError` lists each failure with the user's source line and a fix.
The graph records how it was captured in `gm.meta["capture"]` (a `Capture`).
"""

from __future__ import annotations

import inspect
import linecache
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping

import torch
import torch.fx as fx
from torch import nn

from .errors import TraceError

CaptureMode = Literal["auto", "fx"]
CAPTURE_MODES: tuple[str, ...] = ("auto", "fx")
_MAX_AUTO_LEAVES = 64


@dataclass(frozen=True)
class Capture:
    """How a graph was captured: the front-end that succeeded, leaf modules, and earlier failures."""

    method: str
    leaves: tuple[str, ...] = ()
    failures: tuple[str, ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        text = self.method
        if self.leaves:
            text += f" (kept whole: {', '.join(self.leaves)})"
        return text


def trace(model: nn.Module, example_inputs: tuple = (), example_kwargs: Mapping[str, Any] | None = None,
          *, capture: CaptureMode = "auto", leaf_modules: Iterable[str | type] = (),
          concrete_args: Mapping[str, Any] | None = None) -> fx.GraphModule:
    """Capture `model` as a GraphModule whose forward takes the same inputs as `model`'s.

    `leaf_modules` (qualified names or module classes) stay whole, as one node each.
    `concrete_args` fixes inputs to constants; inputs not given in the example default to theirs.
    """
    if capture not in CAPTURE_MODES:
        raise TraceError(f"unknown capture mode {capture!r}: use one of {', '.join(CAPTURE_MODES)}")
    example_kwargs = dict(example_kwargs or {})
    concrete = _default_concrete_args(model, example_inputs, example_kwargs)
    concrete.update(concrete_args or {})
    leaves = list(leaf_modules)
    failures: list[str] = []

    gm, error = _fx_trace(model, leaves, concrete, example_inputs, example_kwargs)
    if gm is not None:
        gm.meta["capture"] = Capture("fx", tuple(l for l in leaves if isinstance(l, str)))
        return gm
    failures.append(f"torch.fx: {error}")
    if capture == "auto":
        gm, auto_leaves, error = _fx_trace_with_auto_leaves(
            model, leaves, concrete, example_inputs, example_kwargs)
        if gm is not None:
            gm.meta["capture"] = Capture("fx+leaves", tuple(auto_leaves), tuple(failures))
            return gm
        failures.append(f"torch.fx with automatic leaf modules: {error}")
    raise TraceError(
        f"could not capture {type(model).__name__} as a graph:\n  - " + "\n  - ".join(failures) +
        "\nFix: pass the module that breaks tracing in leaf_modules=[...] to keep it whole, pass "
        "fixed values for Python-level options in concrete_args={...}, or rewrite the line above "
        "without Python control flow on tensor values.")


class _Tracer(fx.Tracer):
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


def _fx_trace(model, leaves, concrete, args, kwargs) -> tuple[fx.GraphModule | None, str]:
    try:
        return _fx_trace_or_raise(model, leaves, concrete, args, kwargs), ""
    except _TraceFailure as failure:
        return None, str(failure)


def _fx_trace_or_raise(model, leaves, concrete, args, kwargs) -> fx.GraphModule:
    tracer = _Tracer(leaves)
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as e:  # fx raises many kinds; each becomes a reported failure
        raise _TraceFailure(_describe(e, model), _culprit(e, model)) from e
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
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
