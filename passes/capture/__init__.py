"""nn.Module -> fx.GraphModule, by the first front-end that captures the model faithfully.

Front-ends, in order (`capture="auto"`), one module each, behind one protocol (`FrontEnd`, in
`frontend`: each returns a `Captured` or raises `CaptureFailed` with its reason):
1. `fx` (`Method.FX`): plain `torch.fx` symbolic tracing, module-level nodes with the user's
   names.
2. `fx_leaves` (`Method.FX_LEAVES`, "fx+leaves"): fx again, with every submodule whose forward
   broke tracing made a leaf (called whole, as one node), found one at a time from where
   tracing failed.
3. `export` (`Method.EXPORT`): `torch.export.export(..., strict=False)`, which runs the Python
   and records ATen ops, so it follows what fx cannot (size-dependent loops, `**kwargs`
   forwards, Hugging Face models); its sizes in `export_sizes`, its graph made readable in
   `readable`.

`choose.trace` tries them and chooses: a graph counts only if it reproduces the model's output
on the example inputs, and an fx graph too coarse for the stages asked gives way to export.
When no front-end captures the model, one `TraceError` lists each failure with the user's source
line and a fix. The graph records how it was captured in `gm.meta["capture"]` (a `Capture`), and
each front-end its calling convention in `gm.meta["signature"]` (a
`fxpipe.passes.signature.Signature`: the inputs fx fixed, export's specs), so nothing needs to
be recovered from the graph afterwards.

Python a pipeline would not run (attribute changes in forward, hooks) is in `side_effects`.

Each front-end records its `Signature` on the graph and keeps the model's non-persistent buffers
out of its state_dict. Imports, bottom up: `frontend` (on `compare`, `device`, `state`,
`user_code`) <- `readable`, `export_sizes`, `side_effects` <- the front-ends (`fx` <- `fx_leaves`;
`export`) <- `choose` <- this package; code outside imports the package (`fxpipe.passes.capture`),
never one of its modules.

Graphs reach the passes from these two kinds of front-end: `torch.fx` symbolic tracing
(`call_module` nodes, user names) and, where that cannot follow the Python, `torch.export` (ATen
`call_function` nodes, parameters as `get_attr`). Both are fx GraphModules: every pass is written
for any GraphModule.

Example (the graph reproduces the model's output):

>>> import torch
>>> from fxpipe.passes.capture import trace
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
>>> x = torch.randn(2, 4)
>>> gm = trace(model, (x,))
>>> gm.meta["capture"].method.value
'fx'
>>> torch.equal(gm(x), model(x))
True
"""

from .choose import CAPTURE_MODES, CaptureMode, trace, with_tensor_defaults, without_cache
from .frontend import Capture, Captured, CaptureFailed, FrontEnd, Method, Request
from .fx import FX
from .fx_leaves import FX_LEAVES
from .readable import module_path
from .side_effects import attributes_restored, hook_kind


def __getattr__(name: str):
    """`EXPORT`, imported when asked: torch.export's front-end loads sympy, which a model fx
    captures never needs."""
    if name == "EXPORT":
        from .export import EXPORT
        return EXPORT
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CAPTURE_MODES", "Capture", "CaptureFailed", "CaptureMode", "Captured", "EXPORT", "FX",
           "FX_LEAVES", "FrontEnd", "Method", "Request", "attributes_restored", "hook_kind",
           "module_path", "trace", "with_tensor_defaults", "without_cache"]
