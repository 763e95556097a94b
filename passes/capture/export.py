"""The `export` front-end: `torch.export.export(..., strict=False)`, which runs the Python and
records ATen ops, so it follows what fx cannot (size-dependent loops, `**kwargs` forwards,
Hugging Face models).

Every size of every tensor input is left free where the model's code allows it (the batch, so
every micro-batch size runs; a sequence length; see `export_sizes.free_sizes`). The graph is
captured in the model's current mode (`.train()` or `.eval()`): export bakes dropout and
BatchNorm behaviour into the ops. Export runs hooks once, at capture, so it refuses hooked
modules. The graph is made readable before anyone sees it (`readable.readable`).

A model on meta is exported on inputs on meta; where that fails, or the graph keeps an enabled
autocast region of the planned device type (meta tensors never autocast, so a dtype read there
would be baked wrong), it is exported again on fake tensors of that type (`_on_fake_tensors`;
`Capture.fake`).

Export also refuses `inference_mode` regions.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
from dataclasses import replace
from typing import Any, Iterator, Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode

from ..codegen import place
from ..materialize import holds_meta
from ..signature import exported_signature
from ..user_code import describe_frame, user_frame
from .export_sizes import SizeFixes, free_sizes, input_sources, size_rules
from .frontend import Captured, CaptureFailed, Method, Request, mismatch
from .readable import readable
from .side_effects import attributes_restored

_log = logging.getLogger("fxpipe.passes.capture")


class Export:
    """torch.export, with every size the model's code lets vary left free."""

    method = Method.EXPORT
    label = "torch.export"
    fix = ("Fix: torch.export follows Python control flow on sizes, not on tensor values: "
           "write such a branch with torch.cond(pred, true_fn, false_fn, operands), or move it "
           "out of forward.")

    def capture(self, model: nn.Module, request: Request) -> Captured:
        if request.hooked:
            raise CaptureFailed(
                "it runs hooks once, at capture, and keeps only their tensor operations: " +
                "; ".join(f"module {name!r} has a {kind}" for name, kind in request.hooked.items()),
                fix="Fix: capture with fx (capture='fx' or 'auto'), which keeps hooked modules "
                    "whole so their hooks run on every micro-batch; or remove the hooks before "
                    "compiling")
        gm = _export_or_raise(model, request.args, request.kwargs, request.batch_dims,
                              request.device_type)
        if request.uncached:   # the pipeline's callers leave it out, as the model's do
            signature = gm.meta["signature"]
            gm.meta["signature"] = replace(signature,
                                           defaults={**signature.defaults, "use_cache": False})
        return Captured(gm, training=model.training, fake=gm.meta.pop("fake", None))


EXPORT = Export()


def _export_or_raise(model: nn.Module, args: tuple, kwargs: Mapping[str, Any],
                     batch_dims: Any = 0, device_type: str | None = None) -> fx.GraphModule:
    """`model` exported (see the module docstring). A model on meta is exported on inputs on
    meta (no op may meet two devices), its ops then naming the inputs' device again; where that
    fails, or the graph keeps an enabled autocast region of `device_type` (meta tensors do not
    autocast: a dtype forward reads there, baked into the graph, would not be the run's), it is
    exported again on fake tensors of `device_type` (`_on_fake_tensors`)."""
    if not args and not kwargs:
        raise CaptureFailed("torch.export needs example inputs: pass example_inputs or "
                            "example_kwargs")
    inputs_device = next((t.device for t in pytree.tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor)), torch.device("cpu"))
    device_type = device_type or inputs_device.type
    on_meta = holds_meta(model)
    try:
        program, inference, fixes = _exported(model, args, kwargs, batch_dims,
                                              "meta" if on_meta else None)
        on_fake = on_meta and device_type in _autocast_regions(program.graph_module)
    except CaptureFailed as failure:
        if not on_meta:
            raise
        try:
            program, inference, fixes = _exported(model, args, kwargs, batch_dims, device_type)
        except CaptureFailed:
            raise failure from None     # the model's own failure, as meta showed it
        on_fake = True
    else:
        if on_fake:     # where fake tensors fail, the graph exported on meta stays (checked)
            try:
                program, inference, fixes = _exported(model, args, kwargs, batch_dims,
                                                      device_type)
            except CaptureFailed:
                on_fake = False
    if inference.site is not None:
        raise CaptureFailed(
            f"forward runs ops in torch.inference_mode() ({inference.site}), which torch.export "
            f"leaves out of the graph: those ops would get gradients. Use torch.no_grad() there, "
            f"which the graph keeps")
    gm = readable(program.module(), type(model).__name__)
    if on_fake:
        _model_tensors(gm, model)
        gm.meta["fake"] = device_type
    if on_meta:
        place(gm, inputs_device)
        differs = ""       # no values to compare: compile's check runs it streamed
    else:
        differs, _ = mismatch(model, gm, args, kwargs)
    if differs:
        raise CaptureFailed(f"the exported graph does not reproduce the model: {differs}")
    signature = exported_signature(gm, program.module_call_graph[0].signature)
    sources = input_sources(model, args, kwargs, batch_dims)
    gm.meta["signature"] = replace(signature, size_rules=size_rules(program, sources),
                                   fixed_at=fixes.placeholder_dims(program, sources))
    return gm


def _exported(model: nn.Module, args: tuple, kwargs: Mapping[str, Any], batch_dims: Any,
              device: str | None) -> tuple[torch.export.ExportedProgram, "_InferenceModeWatch",
                                           "SizeFixes"]:
    """torch.export on the model as it is (`device` None), on inputs on meta ("meta"), or on
    fake tensors of the device type `device` (the model's meta tensors and the inputs); the
    watches it ran under."""
    inference, fixes = _InferenceModeWatch(), SizeFixes()
    given = (tuple(args), dict(kwargs))
    fake = contextlib.nullcontext(given) if device is None else \
        _on_meta_inputs(given) if device == "meta" else _on_fake_tensors(model, given, device)
    try:
        with _quiet(), attributes_restored(model), fake as given:   # nothing export left there
            with inference, fixes:
                program = torch.export.export(model, *given, strict=False,
                                              dynamic_shapes=free_sizes(model, *given,
                                                                        batch_dims))
    except Exception as e:  # export raises many kinds; each becomes a reported failure
        raise CaptureFailed.of(e, model) from e
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
    logger at DEBUG level instead (`logging.getLogger("fxpipe.passes.capture")`)."""
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
