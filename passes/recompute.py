"""Recomputing part of a stage: keep the expensive nodes' activations, recompute the cheap ones.

A training stage keeps, for every micro-batch in flight, what autograd saves for its backward.
Recomputing the whole stage keeps only what it received and runs its forward again in the
backward; often most of the bytes are kept by cheap nodes (activations, normalisations, dropout)
and most of the time spent in expensive ones (matmuls, convolutions). The partitioner prices the
choice (`cost_model.choose_recomputed`: the nodes to recompute, cheapest per byte freed first,
until the stage fits its memory; `StageCost.recomputed` names them), and `checkpoint_regions`
rewrites the stage so that each run of consecutive recomputed nodes becomes one `Recomputed`
submodule: `torch.utils.checkpoint` keeps the run's inputs, frees what its nodes save, and runs
them again when the backward reaches them.

The generated code reads as before, with the runs called by name:

    recomputed_0 = self.recomputed_0(linear, rng)
    gelu = recomputed_0[0]

Recomputation draws the same random numbers (the generator state is a graph value, see
`fxpipe.passes.randomness`, and a run carries the micro-batch seed it was first run under to
whichever thread recomputes it) and the runtime puts back the buffers a recomputed run writes
again. Nodes with side effects are
never recomputed.

Example (the GELU recomputed in the backward; the same output):

>>> import torch
>>> from torch import fx, nn
>>> from fxpipe.passes.recompute import checkpoint_regions
>>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)))
>>> x = torch.randn(2, 4)
>>> kept = gm(x)
>>> gm = checkpoint_regions(gm, {"_1"})
>>> [n.target for n in gm.graph.find_nodes(op="call_module")]
['0', 'recomputed_0', '2']
>>> torch.equal(gm(x), kept)
True
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

from .codegen import StageTracer
from .randomness import current_seed, microbatch_seed


_local = threading.local()


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """On this thread, `Recomputed` runs keep only their inputs: the runtime enters it for a
    forward whose backward it will run (`train_step`), and puts back around that backward the
    buffers a recomputed run writes again."""
    before, _local.on = getattr(_local, "on", False), True
    try:
        yield
    finally:
        _local.on = before


class Recomputed(nn.Module):
    """Runs `body` keeping only its inputs for the backward, which runs it again first (inside
    `recomputing()`; elsewhere, a plain call whose backward is the caller's, it runs as is)."""

    def __init__(self, body: fx.GraphModule):
        super().__init__()
        self.body = body
        # `checkpoint`'s first call imports torch._dynamo (about 70 MB resident and a second):
        # imported here, as the plan is made or loaded, not inside its first step.
        import torch._dynamo  # noqa: F401

    def forward(self, *args: Any) -> Any:
        if not (torch.is_grad_enabled() and getattr(_local, "on", False)):
            return self.body(*args)
        # The run takes this thread's micro-batch seed along: autograd may recompute it on
        # another thread (a GPU's backward runs on autograd's thread for that device).
        return checkpoint(functools.partial(_seeded_run, self.body, current_seed()), *args,
                          use_reentrant=False, preserve_rng_state=False)


def _seeded_run(body: fx.GraphModule, seed: int | None, *args: Any) -> Any:
    """`body(*args)` drawing from micro-batch seed `seed`, on whatever thread runs it."""
    with microbatch_seed(seed):
        return body(*args)


def _runs(gm: fx.GraphModule, names: set[str]) -> list[list[fx.Node]]:
    """Maximal runs of consecutive recomputed nodes, in graph order (parameter reads neither
    break a run nor join it; the stage's inputs and output, which compute nothing, are never
    in one)."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            continue
        if n.name in names and n.op in ("call_function", "call_method", "call_module"):
            current.append(n)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def checkpoint_regions(gm: fx.GraphModule, names: set[str]) -> fx.GraphModule:
    """Rewrite `gm` in place: each run of consecutive nodes named in `names` becomes a call of a
    `Recomputed` submodule `recomputed_<i>` taking the values the run reads."""
    for i, run in enumerate(_runs(gm, names)):
        members = set(run)
        inputs = list(dict.fromkeys(p for n in run for p in n.all_input_nodes
                                    if p not in members))
        outputs = [n for n in run if any(u not in members for u in n.users)]
        body = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for p in inputs:
            env[p] = body.placeholder(p.name)
        for n in run:
            env[n] = body.node_copy(n, lambda v: env[v])
        body.output(tuple(env[n] for n in outputs))
        body._tracer_cls = StageTracer
        name = f"recomputed_{i}"
        gm.add_submodule(name, Recomputed(fx.GraphModule(gm, body, class_name=name)))
        for p in inputs:                 # a parameter read inside the run comes before it
            if p.op == "get_attr":
                run[0].prepend(p)
        with gm.graph.inserting_before(run[0]):
            call = gm.graph.call_module(name, tuple(inputs))
            for k, n in enumerate(outputs):
                value = gm.graph.call_function(operator.getitem, (call, k))
                value.meta = dict(n.meta)
                n.replace_all_uses_with(value)
        for n in reversed(run):
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return gm
