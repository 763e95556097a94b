"""The graph run whole as a stage runs it, timed: what `measure.calibrate` scales the node costs
to, and what `host.lock_held` runs on threads at once to measure the interpreter lock."""

from __future__ import annotations

import contextlib
import statistics
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpipe.passes.annotate_costs import bind_inputs
from fxpipe.passes.codegen import placed_copy
from fxpipe.passes.device import start_timer
from fxpipe.passes.materialize import holds_meta
from fxpipe.passes.randomness import microbatch_seed
from fxpipe.passes.state import unchanged_state

from .reference import copied


def computing(gm: fx.GraphModule) -> list[fx.Node]:
    """`gm`'s nodes that compute (not its inputs, attributes or output)."""
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


class WholeRuns:
    """`gm` run whole as a stage runs it (a copy placed on `device` where `gm` is elsewhere, one
    positional argument per input), forward then in training backward to its parameters; timed
    by the host's clock until the device's work is done (on a GPU the nodes' CUDA events time
    kernels alone; the graph's launches, which a small batch waits on, count here)."""

    def __init__(self, gm: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any],
                 training: bool, device: torch.device):
        self.module, self.training, self.device = placed_copy(gm, device), training, device
        self.inputs = bind_inputs(gm, *pytree.tree_map(
            lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, (args, kwargs)))
        self.meta = holds_meta(self.module)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.run = positional(self.module)

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Buffers and random generators left as they were after the runs."""
        with unchanged_state(self.module), torch.random.fork_rng(devices=[]), microbatch_seed(0):
            yield

    def runs(self, repeats: int, least_s: float = 0.0) -> list[tuple[float, float]]:
        """`repeats + 1` runs, and more until they fill `least_s`, each timed: (forward,
        forward and backward)."""
        times: list[tuple[float, float]] = []
        while len(times) <= repeats or sum(t for _, t in times) < least_s:
            fresh = copied(self.inputs)
            elapsed_s = start_timer(self.device, wall=True)
            with torch.set_grad_enabled(self.training and bool(self.params)):
                out = self.run(*fresh)
                forward_s = elapsed_s()
                loss = sum(t.float().sum() for t in pytree.tree_leaves(out)
                           if isinstance(t, torch.Tensor) and t.requires_grad)
                if isinstance(loss, torch.Tensor):
                    torch.autograd.grad(loss, self.params, allow_unused=True)
            times.append((forward_s, elapsed_s()))
        return times

    @staticmethod
    def medians(times: Sequence[tuple[float, float]]) -> tuple[float, float]:
        """Forward and backward medians of runs after the first (a warm-up)."""
        forward = statistics.median(f for f, _ in times[1:])
        return forward, max(0.0, statistics.median(s for _, s in times[1:]) - forward)


def positional(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` as generated code taking one positional argument per placeholder (no `*args`, no
    defaults), as a stage takes its inputs; on `gm`'s own parameters."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in graph.nodes:
        if n.op == "placeholder":
            n.target, n.args = n.name, ()
    return fx.GraphModule(gm, graph)
