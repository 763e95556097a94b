"""Measure every node: `node.meta["cost"] = NodeCost(fwd_s, bwd_s, out_bytes, param_bytes)`.

`CostInterpreter` runs the graph on example inputs like `torch.fx.passes.shape_prop.ShapeProp`
does, timing each node's call. The graph runs `warmup + repeats` times, from fresh copies of the
inputs each time, and each node keeps the median of its repeats, so one noisy run does not decide
a stage boundary. On CUDA each node is timed by CUDA events around it (`start_timer`): the GPU's
time, not the host's.

The graph's parameters and buffers are left as they were (`fxpipe.passes.state.unchanged_state`):
buffers the model updates while running (BatchNorm statistics, counters) are restored afterwards,
and so are the random generators dropout and the like draw from; every run gets its own copy of
the inputs.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from .codegen import placed_copy
from .cost_model import NodeCost
from .device import is_gpu, start_timer
from .errors import CostError
from .graph_values import attr_value, plain, tensors
from .materialize import Materialize, MaterializingInterpreter
from .signature import signature_of
from .state import StateWatch, storage_of, unchanged_state


class CostInterpreter(MaterializingInterpreter):
    """An Interpreter that records the wall time and output size of every node it runs (with
    `materialize`, a node's weights are drawn before its timer starts: see
    `fxpipe.passes.materialize`)."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, *, backward: bool = False,
                 progress: Callable[[int, int], None] | None = None,
                 materialize: Materialize | None = None):
        super().__init__(gm, materialize=materialize, device=device)
        self.device = device
        self.backward = backward
        self.progress = progress
        self.total = sum(1 for n in gm.graph.nodes if n.op != "output")
        self.times_s: dict[fx.Node, list[float]] = {}
        self.backward_s: dict[fx.Node, list[float]] = {}
        self.out_bytes: dict[fx.Node, int] = {}
        self.shapes: dict[fx.Node, tuple[tuple[int, ...], ...]] = {}   # of the output's tensors
        # Kept for the backward (with `backward`): bytes of tensors the node made inside, and
        # which nodes' values it keeps (its inputs', its own).
        self.saved_bytes: dict[fx.Node, int] = {}
        self.saved_values: dict[fx.Node, set[fx.Node]] = {}
        self.watch: StateWatch | None = None     # set for a run that finds the state written

    def run_node(self, n: fx.Node) -> Any:
        return self.with_weights(n, self._timed)

    def _timed(self, n: fx.Node) -> Any:
        elapsed_s = start_timer(self.device)
        try:
            if self.watch is not None:
                with self.watch.watching(n, tensors([self.env[p] for p in n.all_input_nodes])):
                    result = self.run_plain(n)
            else:
                result = self.run_plain(n)
            self.times_s.setdefault(n, []).append(elapsed_s())
            if self.backward and n.op.startswith("call"):
                self.backward_s.setdefault(n, []).append(self._time_backward(n))
        except Exception as e:
            raise CostError(f"node {n.name!r} failed while its cost was measured: "
                            f"{type(e).__name__}: {e}\n  node: {n.format_node()}") from e
        self.out_bytes[n] = tensor_bytes(result)
        self.shapes[n] = tuple(tuple(t.shape) for t in tensors(result))
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)
        return result

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.done = 0       # nodes measured in this run
        return super().run(*args, **kwargs)

    def _time_backward(self, n: fx.Node) -> float:
        """The time of the node's backward alone: its inputs as fresh leaves, ones as gradient.

        `torch.autograd.grad` leaves every `.grad` as it was."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        state = {id(self.env[p]) for p in n.all_input_nodes if p.op == "get_attr"}
        real = list(self.real.values())        # the node's weights, given for this run
        buffers = {storage_of(b) for b in [*self.module.buffers(), *real]
                   if not isinstance(b, nn.Parameter)} - {None}
        origin = {id(t): p for p in n.all_input_nodes for t in tensors(self.env[p])}
        given: dict[Any, fx.Node] = {}     # storage of what the node is given -> whose value

        def give(v: Any) -> Any:          # activations become leaves; parameters stay;
            new = (v.detach().clone() if storage_of(v) in buffers else   # buffers are copied,
                   v if id(v) in state else _leaf_if_float(v))            # so a write stays off
            if isinstance(v, torch.Tensor) and id(v) in origin:
                given.setdefault(storage_of(new), origin[id(v)])
            return new
        args, kwargs = plain(fx.node.map_aggregate((args, kwargs), give))
        params = {storage_of(p) for p in [*self.module.parameters(), *real]
                  if isinstance(p, nn.Parameter)}
        saved: dict[Any, int] = {}     # storage -> bytes, of what autograd keeps for backward

        def pack(t: torch.Tensor) -> torch.Tensor:
            where = storage_of(t)
            if where not in params:
                saved[where if where is not None else id(t)] = t.untyped_storage().nbytes()
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = getattr(self, n.op)(n.target, args, kwargs)
        # A kept input or output is a value of the graph, counted once however many nodes keep
        # it (see `_write_costs`); the rest the node made inside, and is its own.
        for t in tensors(out):
            given.setdefault(storage_of(t), n)
        self.saved_values[n] = {given[where] for where in saved if where in given}
        self.saved_bytes[n] = sum(b for where, b in saved.items() if where not in given)
        outputs = [t for t in tensors(out) if t.requires_grad]
        wanted = [t for t in tensors((args, kwargs)) if t.requires_grad]
        modules = [self.env[p] for p in n.all_input_nodes if isinstance(self.env[p], nn.Module)]
        if n.op == "call_module":
            modules.append(self.fetch_attr(n.target))
        wanted += [p for m in modules for p in m.parameters() if p.requires_grad]
        if not outputs or not wanted:
            return 0.0
        grads = [torch.ones_like(t) for t in outputs]
        elapsed_s = start_timer(self.device)
        torch.autograd.grad(outputs, wanted, grads, allow_unused=True)
        return elapsed_s()


UNSTEADY = 0.25     # a measurement whose time-weighted spread is above this is taken again


def annotate_costs(gm: fx.GraphModule, args: tuple = (), kwargs: Mapping[str, Any] | None = None,
                   *, device: str | torch.device | None = None, repeats: int = 5,
                   warmup: int = 1, backward: bool = False,
                   max_repeats: int | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   materialize: Materialize | None = None) -> fx.GraphModule:
    """Run `gm` on the example inputs and write `node.meta["cost"]` on every node; returns `gm`.

    The first run also marks the nodes that touch a buffer some node writes (`node.meta["state"]`,
    see `fxpipe.passes.state`), so that the partitioner keeps them in one stage.

    `device` is where to measure (default: where `gm`'s parameters are): elsewhere, the graph
    runs on a copy placed there (`fxpipe.passes.codegen.placed_copy`, dropped after), so `gm`'s
    tensors never move; the inputs are copied there. Inputs are given as the model takes them, positionally and by keyword. With
    `backward`, each node's backward is timed too (`bwd_s`), from its own inputs.

    Noise: the repeats are whole runs of the graph, so a node's repeats are spread over the
    measurement rather than taken back to back, and a burst of another process's work disturbs
    one repeat of many nodes, not every repeat of one node; each node keeps the median, which one
    disturbed repeat cannot move, and its spread, (p90 - p10) / median (`NodeCost.spread`). While
    the graph's time-weighted spread (`measurement_spread`) is above `UNSTEADY`, the graph runs
    again, up to `max_repeats` runs in all (default: three times `repeats`).

    `progress(done, total)` is called as each node of a run is measured.

    A graph holding meta tensors (a model built under `torch.device("meta")`) needs
    `materialize`, which gives each node's weights on `device` just before it runs and is not
    timed (`fxpipe.passes.materialize`).
    """
    device = torch.device(device) if device is not None else _device_of(gm)
    measured = placed_copy(gm, device)
    inputs = bind_inputs(gm, args, kwargs)
    interpreter = CostInterpreter(measured, device, backward=backward, progress=progress,
                                  materialize=materialize)
    generators = [device] if is_gpu(device) else []
    limit = max(repeats, 3 * repeats if max_repeats is None else max_repeats)
    with unchanged_state(measured), torch.no_grad(), torch.random.fork_rng(devices=generators):
        for run in range(warmup + limit):
            interpreter.watch = StateWatch(measured) if run == 0 else None
            fresh = [_to_device(_clone(v), device) for v in inputs]
            interpreter.run(*fresh)
            if run == 0:
                interpreter.watch.mark()
            if run + 1 >= warmup + repeats:
                _write_costs(measured, interpreter, warmup)
                if measurement_spread(measured) <= UNSTEADY:
                    break
    if measured is not gm:     # the copy's nodes are `gm`'s, in order
        for n, copied in zip(gm.graph.nodes, measured.graph.nodes):
            n.meta.update({key: copied.meta[key] for key in _WRITTEN if key in copied.meta})
    return gm


_WRITTEN = ("cost", "shapes", "output_kept", "state")    # what measuring writes on a node


def _write_costs(gm: fx.GraphModule, interpreter: CostInterpreter, warmup: int) -> None:
    owned = _param_bytes_by_node(gm)
    kept = {v for values in interpreter.saved_values.values() for v in values}
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        times = interpreter.times_s[n][warmup:] or interpreter.times_s[n]
        backward_times = interpreter.backward_s.get(n, [0.0])
        backward_times = backward_times[warmup:] or backward_times
        n.meta["cost"] = NodeCost(fwd_s=statistics.median(times),
                                  bwd_s=statistics.median(backward_times),
                                  out_bytes=0 if n.op == "get_attr" else interpreter.out_bytes[n],
                                  param_bytes=owned.get(n, 0), spread=spread(times),
                                  saved_bytes=interpreter.saved_bytes.get(n, 0) +
                                  (interpreter.out_bytes[n] if n in kept else 0))
        n.meta["shapes"] = interpreter.shapes.get(n, ())
        n.meta["output_kept"] = n in kept      # in its saved_bytes: some node keeps it


def spread(times: Sequence[float]) -> float:
    """How unsteady repeated timings are: (p90 - p10) / median (0 for fewer than 3)."""
    if len(times) < 3:
        return 0.0
    ordered = sorted(times)
    p10, p90 = (ordered[round(q * (len(ordered) - 1))] for q in (0.1, 0.9))
    median = statistics.median(ordered)
    return (p90 - p10) / median if median > 0 else 0.0


def measurement_spread(gm: fx.GraphModule) -> float:
    """The spread of a graph's measured costs: each node's, weighted by its time."""
    costs = [n.meta["cost"] for n in gm.graph.nodes if n.meta.get("cost") is not None]
    total = sum(c.fwd_s for c in costs)
    return sum(c.fwd_s * c.spread for c in costs) / total if total > 0 else 0.0


def tensor_bytes(value: Any) -> int:
    """Bytes of all tensors in a (nested) value."""
    total = 0
    def visit(v):
        nonlocal total
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        return v
    fx.node.map_aggregate(value, visit)
    return total


def _param_bytes_by_node(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Parameter and buffer bytes, each tensor counted at the first node that references it.

    A `get_attr` is never sent between stages: `fxpipe.passes.codegen` copies it into each stage that
    reads it. So its tensor, or a module's parameters and buffers when it reads a submodule
    (`fxpipe.passes.randomness` calls a routed module that way), is counted at its first reader, and
    its `out_bytes` is 0.
    """
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    seen: set[int] = set()
    owned: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        holder = n
        if n.op == "call_module":
            module = gm.get_submodule(n.target)
            tensors = list(module.parameters()) + list(module.buffers())
        elif n.op == "get_attr":
            value = attr_value(gm, n.target)
            tensors = ([value] if isinstance(value, torch.Tensor) else
                       list(value.parameters()) + list(value.buffers())
                       if isinstance(value, nn.Module) else [])
            readers = [u for u in n.users if u.op != "output"]
            holder = min(readers, key=position.__getitem__) if readers else n
        else:
            continue
        fresh = [t for t in tensors if id(t) not in seen]
        seen.update(id(t) for t in fresh)
        owned[holder] = owned.get(holder, 0) + sum(t.numel() * t.element_size() for t in fresh)
    return owned


def bind_inputs(gm: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any] | None) -> list[Any]:
    """The value of every placeholder, in order, from inputs given as the model takes them."""
    return signature_of(gm).flatten_inputs(args, kwargs)


def _device_of(gm: fx.GraphModule) -> torch.device:
    for t in list(gm.parameters()) + list(gm.buffers()):
        return t.device
    return torch.device("cpu")


def _leaf_if_float(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value


def _clone(value: Any) -> Any:
    return fx.node.map_aggregate(value, lambda v: v.clone() if isinstance(v, torch.Tensor) else v)


def _to_device(value: Any, device: torch.device) -> Any:
    return fx.node.map_aggregate(
        value, lambda v: v.to(device) if isinstance(v, torch.Tensor) else v)
