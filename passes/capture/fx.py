"""The `fx` front-end: plain `torch.fx` symbolic tracing, module-level nodes with the user's
names (`traced`, which fx+leaves calls too).

fx traces a forward wrapped by `*args, **kwargs` decorators (transformers 5's) through them, with
forward's own parameters (`_fx_forward`). Grad-mode regions in forward (`with torch.no_grad():`,
a frozen teacher) stay regions: a node records the mode it was traced in
(`node.meta["grad_enabled"]`, see `_Tracer`) and `fxpipe.passes.codegen` runs it so. fx refuses
an enabled autocast region by its line: it cannot record one.

Each node's stack is recorded with Python's `traceback`, not torch's recording, which imports
torch._dynamo.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import traceback
from typing import Iterable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from ..materialize import holds_meta
from ..signature import plain_varargs, traced_signature
from ..user_code import describe_frame, user_frame
from .frontend import Captured, CaptureFailed, Method, Request, mismatch
from .readable import keep_non_persistent
from .side_effects import attributes_restored

FIX = ("Fix: pass the module that breaks tracing in leaf_modules=[...] to keep it whole, pass "
       "fixed values for Python-level options in concrete_args={...}, or rewrite the line "
       "without Python control flow on tensor values.")


class Fx:
    """torch.fx symbolic tracing, keeping the modules given or hooked whole."""

    method = Method.FX
    label = "torch.fx"
    fix = FIX

    def capture(self, model: nn.Module, request: Request) -> Captured:
        return Captured(traced(model, request, request.leaves), request.named_leaves)


FX = Fx()


def traced(model: nn.Module, request: Request, leaves: Iterable[str | type]) -> fx.GraphModule:
    """`model` traced by fx with `leaves` kept whole, checked against the example (but on
    meta, which has no values to compare), its `Signature` recorded; raises `CaptureFailed`."""
    args, kwargs, concrete = request.args, request.fx_kwargs, request.concrete
    tracer = _Tracer(leaves)
    # What tracing left in the model's attributes (proxies in a cache) must not reach the check
    # run below; the graph module takes the constants fx stored on the model first.
    with attributes_restored(model) if args or kwargs else contextlib.nullcontext():
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
        except Exception as e:  # fx raises many kinds; each becomes a reported failure
            raise CaptureFailed.of(e, model) from e
        for node in graph.find_nodes(op="placeholder"):   # an input fixed to a value defaults to it
            name = node.target.removesuffix("_1")
            if (node.args and name != node.target and name in concrete
                    and not isinstance(concrete[name], (tuple, list, dict))):
                node.args = (concrete[name],)
            held = [leaf for leaf in pytree.tree_leaves(node.args)
                    if isinstance(leaf, (torch.Tensor, fx.Node))]
            if held:      # generated code cannot spell a tensor default: the signature has it
                node.args = ()
                for constant in held:
                    if isinstance(constant, fx.Node) and not constant.users:
                        graph.erase_node(constant)
        if tracer.grad_contexts.autocast is not None:
            raise CaptureFailed(
                f"forward runs ops under torch.autocast ({tracer.grad_contexts.autocast}), "
                f"which torch.fx does not record: the graph would compute them in their own "
                f"dtypes. torch.export keeps autocast regions (capture='export' or 'auto')")
        gm = plain_varargs(fx.GraphModule(tracer.root, graph, type(model).__name__))
        keep_non_persistent(model, gm)
    out_spec = None
    if (args or kwargs) and not holds_meta(model):   # a meta model has no values to compare
        differs, out_spec = mismatch(model, gm, args, kwargs)
        if differs:
            raise CaptureFailed(f"the traced graph does not reproduce the model: {differs}")
    forward = _fx_forward(type(model).forward).__get__(model)
    gm.meta["signature"] = traced_signature(gm, forward, concrete, out_spec)
    return gm


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _forward_stack() -> str | None:
    """The stack from the outermost `forward` on, torch's own frames left out, as a traceback
    prints it (what torch.fx records as a node's `stack_trace`; its own recording imports
    torch._dynamo to symbolize the stack, and to name the frames it leaves out)."""
    stack = traceback.StackSummary.extract(traceback.walk_stack(sys._getframe(2)),
                                           lookup_lines=False)
    stack.reverse()                     # oldest first
    first = next((i for i, frame in enumerate(stack) if frame.name == "forward"), None)
    if first is None:
        return None
    user = [frame for frame in stack[first:] if not frame.filename.startswith(_TORCH_DIR)]
    return "".join(traceback.StackSummary.from_list(user).format()).strip() or None


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
        # Errors about a node name the user's line: each node records its stack (`create_node`),
        # read by Python's traceback, as torch's own recording imports torch._dynamo.
        self.record_stack_traces = False
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
        if not node.stack_trace:
            node.stack_trace = _forward_stack()
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
