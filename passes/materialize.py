"""Run a graph whose parameters and buffers are on the meta device, one node's weights at a time.

A model built under `torch.device("meta")` has shapes but no values. To measure it, probe it
or check it without ever holding it whole, `MaterializingInterpreter` runs its graph with real
activations and, just before each node runs, asks a `Materialize` callback for real values of
the meta tensors that node reads (a `call_module`'s module tensors, a `get_attr`'s target); the
node runs on a shallow copy of its module holding them, and they are dropped once the node is
done (a `get_attr`'s value once its last reader is). The graph's own modules, which an fx graph
shares with the user's model, never hold a real tensor, not even for a moment.

The callback is `read(like, device) -> {name: tensor}`: real tensors on `device` for every name
of `like` (the meta tensors, by the model's names, that a stage holds under the same names),
each with its shape and dtype; tied names (one tensor object in `like`) get one tensor. A
`fxpipe.weights.Weights`'s `read` is one.

`annotate_costs`, `calibrate`, functionalize's probe and `run_graph` (output dims, batch checks)
all run through it; the node runs on a shallow copy of its module (`codegen.with_tensors`). `Tiled`
(values that need only be plausible: each parameter's role, its name without block numbers,
`blockless`, drawn once and repeated) and `unfilled` (values never looked at) are callbacks over a
callback. `release_freed_memory` hands freed memory back to the system after each node (see
`fxpipe.planning.prepare`: planning a meta model).

Example (a model on meta run on another's weights, read per node; the graph keeps meta):

>>> import torch
>>> from torch import fx, nn
>>> from fxpipe.passes.materialize import MaterializingInterpreter
>>> with torch.device("meta"):
...     planned = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
>>> real = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
>>> weights = {"0." + name: t for name, t in real[0].state_dict().items()}
>>> def read(like, device):
...     return {name: weights[name].to(device) for name in like}
>>> gm = fx.symbolic_trace(planned)
>>> x = torch.randn(2, 4)
>>> torch.equal(MaterializingInterpreter(gm, materialize=read).run(x), real(x))
True
>>> gm.get_submodule("0").weight.device
device(type='meta')
"""

from __future__ import annotations

import ctypes
import re
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch import nn

from .codegen import with_tensors
from .device import is_cpu
from .graph_values import PlainInterpreter, attr_value
from .signature import signature_of

Materialize = Callable[[Mapping[str, torch.Tensor], torch.device], dict[str, torch.Tensor]]


def release_freed_memory() -> None:
    """Give the memory of freed tensors back to the system now (glibc's `malloc_trim`; nothing
    elsewhere). Weights are allocated and freed node after node, on several threads: glibc keeps
    what a thread's arena freed for that arena's next allocations, so without this the planning
    process's resident memory would grow towards the whole model's, one layer at a time."""
    if _TRIM is not None:
        _TRIM(0)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):      # not glibc
        return None


_TRIM = _malloc_trim()


class Tiled:
    """A `Materialize` for runs whose values need only be plausible, not the model's: timing
    nodes, finding which values share memory. Each floating-point parameter is filled with the
    first values `read` gave for its role (its name with block numbers dropped,
    `model.layers.*.mlp.up_proj.weight`, and its shape, dtype and device), repeated: a role's
    first read draws in full, every later one (the same layer again, or the next layer) copies
    at memory speed. Drawing a model's initialisation costs about 7 ns an element on a CPU core
    (minutes for 16 GB of bf16 weights, drawn again in every run), a copy a hundredth of that.
    Buffers and other tensors are read from `read` every time (an index's values matter).
    Keeps `SAMPLE` elements of each role."""

    SAMPLE = 1 << 20

    def __init__(self, read: Materialize):
        self.read = read
        self.samples: dict[tuple, torch.Tensor] = {}

    def __call__(self, like: Mapping[str, torch.Tensor], device: torch.device
                 ) -> dict[str, torch.Tensor]:
        keys = {name: self._role(name, t, device) for name, t in like.items()}
        unsampled = {id(t) for name, t in like.items()      # tied names: all read, or none
                     if keys[name] is None or keys[name] not in self.samples}
        fresh = {name: t for name, t in like.items() if id(t) in unsampled}
        values = self.read(fresh, device) if fresh else {}
        for name, value in values.items():
            if keys[name] is not None and keys[name] not in self.samples:
                self.samples[keys[name]] = value.detach().flatten()[:self.SAMPLE].clone()
        tiled: dict[int, torch.Tensor] = {}       # tied names share one tensor
        for name, t in like.items():
            if name not in values:
                values[name] = tiled.setdefault(id(t), _tiled(self.samples[keys[name]], t.shape))
        return values

    @staticmethod
    def _role(name: str, t: torch.Tensor, device: torch.device) -> tuple | None:
        if not (isinstance(t, nn.Parameter) and t.is_floating_point()):
            return None
        return blockless(name), tuple(t.shape), t.dtype, torch.device(device)


def blockless(name: str) -> str:
    """A tensor's name with its block numbers starred, its role in a repeated block:
    `model.layers.3.mlp.up_proj.weight` -> `model.layers.*.mlp.up_proj.weight`."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def unfilled(read: Materialize) -> Materialize:
    """`read`, but floating-point parameters left unfilled (`torch.empty`): for a run that
    looks at which values share memory, never at their values. Nothing is drawn, and a large
    weight that is only read is never made resident (its fresh pages read as the kernel's
    zero page, huge pages where the kernel allows: `_huge_pages`). Buffers and other tensors
    are read (an index's values matter)."""
    def given(like: Mapping[str, torch.Tensor], device: torch.device
              ) -> dict[str, torch.Tensor]:
        values = read({name: t for name, t in like.items() if Tiled._role(name, t, device) is None},
                      device)
        empty: dict[int, torch.Tensor] = {}       # tied names share one tensor
        for name, t in like.items():
            if name not in values:
                if id(t) not in empty:
                    empty[id(t)] = _huge_pages(torch.empty(t.shape, dtype=t.dtype,
                                                           device=device))
                values[name] = empty[id(t)]
        return values
    return given


HUGE_PAGE = 1 << 21      # a transparent huge page on x86-64 and most arm64 kernels
MADV_HUGEPAGE = 14


def _huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t` (fresh, never written), its memory advised to the kernel as huge pages
    (`madvise(MADV_HUGEPAGE)`, on Linux where transparent huge pages are "madvise"): a read of
    an unwritten huge page maps the huge zero page, one fault per 2 MB instead of per 4 KB
    (a 6.4 GB layer of unfilled weights read by its matmuls: 1.6 million faults, about a
    second per 2 GB on a 2-core machine, against 3,000). Only on the CPU, for tensors over 32
    huge pages, the advice covering the huge pages wholly inside the tensor; nothing
    where the call is refused. Not for memory that is written: there each huge page must be
    found whole, which the kernel may compact memory for (slower than small pages)."""
    nbytes = t.untyped_storage().nbytes()
    if _MADVISE is None or not is_cpu(t.device) or nbytes < 32 * HUGE_PAGE:
        return t
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        _MADVISE(start, end - start, MADV_HUGEPAGE)
    return t


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        call = ctypes.CDLL("libc.so.6").madvise
    except (OSError, AttributeError):      # not glibc
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


_MADVISE = _madvise()


def _tiled(sample: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A tensor of `shape` holding `sample`'s values repeated, built by doubling copies."""
    out = torch.empty(shape, dtype=sample.dtype, device=sample.device)
    flat = out.view(-1)
    filled = min(sample.numel(), flat.numel())
    flat[:filled].copy_(sample[:filled])
    while filled < flat.numel():
        more = min(filled, flat.numel() - filled)
        flat[filled:filled + more].copy_(flat[:more])
        filled += more
    return out


def holds_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is on the meta device (has no values)."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def meta_tensors_read(gm: fx.GraphModule, node: fx.Node) -> dict[str, torch.Tensor]:
    """The meta tensors `node` reads from `gm`, by their names in `gm` (the model's)."""
    if node.op == "call_module":
        prefix, value = node.target, gm.get_submodule(node.target)
    elif node.op == "get_attr":
        prefix, value = node.target, attr_value(gm, node.target)
    else:
        return {}
    if isinstance(value, torch.Tensor):
        return {prefix: value} if value.is_meta else {}
    if not isinstance(value, nn.Module):
        return {}
    return {name: t for name, t in [
        *value.named_parameters(prefix=prefix, remove_duplicate=False),
        *value.named_buffers(prefix=prefix, remove_duplicate=False)] if t.is_meta}


class MaterializingInterpreter(PlainInterpreter):
    """A `PlainInterpreter` that, given `materialize`, runs each node of a graph holding meta
    tensors on real values of those it reads (see the module docstring). Without it, or for a
    node reading none, it runs as its parent does."""

    def __init__(self, gm: fx.GraphModule, *, materialize: Materialize | None = None,
                 device: torch.device | str = "cpu", **kwargs: Any):
        super().__init__(gm, **kwargs)
        self.materialize = materialize
        self.weights_device = torch.device(device)
        self.real: dict[int, torch.Tensor] = {}      # id of a meta tensor -> its value, for now

    def run_node(self, n: fx.Node) -> Any:
        return self.with_weights(n, self.run_plain)

    def run_plain(self, n: fx.Node) -> Any:
        """`n` run as a `PlainInterpreter` runs it (a subclass's `run_node` calls this inside
        `with_weights`, around what it adds)."""
        return super().run_node(n)

    def with_weights(self, n: fx.Node, run: Callable[[fx.Node], Any]) -> Any:
        """`run(n)` with real values of the meta tensors `n` reads, dropped after."""
        like = meta_tensors_read(self.module, n) if self.materialize is not None else {}
        if not like:
            return run(n)
        values = self.materialize(like, self.weights_device)
        wrapped: dict[int, torch.Tensor] = {}       # tied names share one value, and one wrap
        self.real = {id(t): wrapped.setdefault(id(values[name]), _like(t, values[name]))
                     for name, t in like.items()}
        del values, wrapped
        try:
            return run(n)
        finally:
            self.real = {}
            release_freed_memory()

    def fetch_attr(self, target: str) -> Any:
        """The attribute with real values in place of the meta tensors of the node running."""
        value = super().fetch_attr(target)
        if not self.real:
            return value
        if isinstance(value, torch.Tensor):
            return self.real.get(id(value), value)
        if isinstance(value, nn.Module):
            return with_tensors(value, lambda t: self.real.get(id(t), t))
        return value


def _like(meta: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` as the meta tensor it stands for is: a Parameter stays a Parameter, with its
    `requires_grad`."""
    if isinstance(meta, nn.Parameter):
        return nn.Parameter(value.detach(), requires_grad=meta.requires_grad)
    return value.detach().requires_grad_(meta.requires_grad)


def run_graph(gm: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any],
              materialize: Materialize, device: torch.device | str) -> Any:
    """`gm(*args, **kwargs)`, the model's output in the model's own structure, run node by node
    with each node's weights given by `materialize` on `device` (`MaterializingInterpreter`)."""
    signature = signature_of(gm)
    interpreter = _OutputsKept(gm, materialize=materialize, device=device)
    interpreter.run(*signature.flatten_inputs(args, kwargs), enable_io_processing=False)
    return signature.rebuild_outputs(interpreter.outputs)


class _OutputsKept(MaterializingInterpreter):
    """Keeps the values the output node returns, by node name (`Signature.rebuild_outputs`)."""

    outputs: dict[str, Any]      # set when the output node runs

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "output":
            self.outputs = {p.name: self.env[p] for p in n.all_input_nodes}
        return super().run_node(n)
