"""The pass: `annotate_costs` runs the `CostInterpreter` until its measurement is steady and
writes each node's `NodeCost`; what a cost counts (parameters at their first reader, a kept value
once at the node that made it) and how steady it was (`spread`, `measurement_spread`)."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from ..codegen import placed_copy
from ..cost_model import NodeCost
from ..device import forked_generators, generators_of
from ..graph_values import attr_value
from ..materialize import Materialize
from ..signature import signature_of
from ..state import StateWatch, unchanged_state
from .interpreter import CostInterpreter
from .reuse import _clone


UNSTEADY = 0.25     # a measurement whose time-weighted spread is above this is taken again


def annotate_costs(gm: fx.GraphModule, args: tuple = (), kwargs: Mapping[str, Any] | None = None,
                   *, device: str | torch.device | None = None, repeats: int = 5,
                   warmup: int = 1, backward: bool = False,
                   max_repeats: int | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   materialize: Materialize | None = None, reuse_blocks: bool = True,
                   max_node_bytes: int | None = None) -> fx.GraphModule:
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

    Repeated blocks (`fxpipe.passes.blocks`: the layers of a decoder, equal op for op, in the
    types the first run met) are measured once: with `reuse_blocks`, a repeat's nodes run in the
    first run only, which measures their own output and saved bytes, and take the times of the
    node they repeat (`NodeCost.source` "reused"); what a measured node reads from them is kept
    from that run. A graph on meta (given `materialize`) whose capture recorded every block
    node's type finds its repeats from those before running and never runs them: their bytes
    are those of the node they repeat (see `Reuse`), their weights never drawn. A node that
    cannot run here, having no kernel for the device or needing more
    than `max_node_bytes` for its parameters and output (None: no limit), is estimated (see
    `Estimates`).

    `progress(done, total)` is called as each node of a run is measured.

    A graph holding meta tensors (a model built under `torch.device("meta")`) needs
    `materialize`, which gives each node's weights on `device` just before it runs and is not
    timed (`fxpipe.passes.materialize`).
    """
    device = torch.device(device) if device is not None else _device_of(gm)
    measured = placed_copy(gm, device)
    inputs = bind_inputs(gm, args, kwargs)
    interpreter = CostInterpreter(measured, device, backward=backward, progress=progress,
                                  materialize=materialize, reuse_blocks=reuse_blocks,
                                  max_node_bytes=max_node_bytes)
    generators = generators_of([device])
    limit = max(repeats, 3 * repeats if max_repeats is None else max_repeats)
    with unchanged_state(measured), torch.no_grad(), forked_generators(generators):
        for run in range(warmup + limit):
            interpreter.watch = StateWatch(measured) if run == 0 else None
            fresh = [_to_device(_clone(v), device) for v in inputs]
            interpreter.run(*fresh)
            if run == 0:
                if interpreter.reuse.early:
                    interpreter.copy_repeats()
                interpreter.watch.mark()
                interpreter.reuse.found(measured)
            if run + 1 >= warmup + repeats and interpreter.estimates.ready:
                _write_costs(measured, interpreter, warmup)
                if measurement_spread(measured) <= UNSTEADY:
                    break
    if measured is not gm:     # the copy's nodes are `gm`'s, in order
        for n, copied in zip(gm.graph.nodes, measured.graph.nodes):
            n.meta.update({key: copied.meta[key] for key in WRITTEN if key in copied.meta})
    return gm


WRITTEN = ("cost", "shapes", "output_kept", "state")     # what measuring writes on a node


def _write_costs(gm: fx.GraphModule, interpreter: CostInterpreter, warmup: int) -> None:
    owned = _param_bytes_by_node(gm)
    kept = _bases({v for values in interpreter.saved_values.values() for v in values},
                  gm, interpreter)
    repeats, estimated = interpreter.reuse.of, interpreter.estimates.nodes
    timed = {n: _times(interpreter, n, warmup) for n in gm.graph.nodes
             if n.op != "output" and n not in repeats and n not in estimated}
    guess = interpreter.estimates.fit(timed) if estimated else None
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if n in estimated:
            (fwd_s, bwd_s, spread_), source, first = guess(n), "estimated", ""
        elif n in repeats and repeats[n] in estimated:   # known early: estimated as it is
            (fwd_s, bwd_s, spread_), source, first = guess(repeats[n]), "estimated", ""
        elif n in repeats:
            (fwd_s, bwd_s, spread_), source, first = timed[repeats[n]], "reused", repeats[n].name
        else:
            (fwd_s, bwd_s, spread_), source, first = timed[n], "measured", ""
        n.meta["cost"] = NodeCost(fwd_s=fwd_s, bwd_s=bwd_s,
                                  out_bytes=0 if n.op == "get_attr" else interpreter.out_bytes[n],
                                  param_bytes=owned.get(n, 0), spread=spread_,
                                  saved_bytes=interpreter.saved_bytes.get(n, 0) +
                                  (interpreter.out_bytes[n] if n in kept else 0),
                                  source=source, reused_from=first,
                                  new_bytes=(0 if n.op == "get_attr" else
                                             interpreter.new_bytes.get(n)),
                                  views=interpreter.views.get(n, ()))
        n.meta["shapes"] = interpreter.shapes.get(n, ())
        n.meta["output_kept"] = n in kept      # in its saved_bytes: some node keeps it


def _bases(kept: set[fx.Node], gm: fx.GraphModule, interpreter: CostInterpreter
           ) -> set[fx.Node]:
    """The nodes whose memory the values in `kept` hold: a view (no memory of its own) kept
    keeps what it views, so a storage that several views of one value keep counts once, at the
    node that made it (and a view of a parameter counts nothing)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    found: set[fx.Node] = set()
    stack = list(kept)
    while stack:
        n = stack.pop()
        bases = interpreter.views.get(n, ())
        if interpreter.new_bytes.get(n) == 0:     # a view: what it views is kept
            stack.extend(by_name[b] for b in bases if b in by_name and by_name[b] not in found)
            continue
        found.add(n)
    return found


def _times(interpreter: CostInterpreter, n: fx.Node, warmup: int) -> tuple[float, float, float]:
    """A measured node's forward and backward times (medians of the runs after `warmup`) and
    its spread."""
    times = interpreter.times_s[n][warmup:] or interpreter.times_s[n]
    backward_times = interpreter.backward_s.get(n, [0.0])
    backward_times = backward_times[warmup:] or backward_times
    return statistics.median(times), statistics.median(backward_times), spread(times)


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


def _to_device(value: Any, device: torch.device) -> Any:
    return fx.node.map_aggregate(
        value, lambda v: v.to(device) if isinstance(v, torch.Tensor) else v)
