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

The parts, each importable from here:

- `annotate.py`: the pass, `annotate_costs`: runs until steady, then writes `node.meta["cost"]`.
- `interpreter.py`: `CostInterpreter`, which times one run node by node, and `Estimates`, the
  costs of nodes that cannot run here.
- `reuse.py`: `Reuse`, the nodes of repeated blocks that run once, or never.

A `NodeCost` holds the measured forward latency, the optional backward, output bytes, parameter
bytes, the spread, and saved bytes: what autograd keeps, each node given gradients where the
model's training run has them, a value kept by several nodes counted once at its maker, a view's at
what it views; and new bytes and views: the memory an output takes that its inputs had not, and the
nodes whose memory it shares. More repeats run while the measurement is unsteady. A repeated
block's nodes run in the first run only and take the times of the block they repeat (`Reuse`,
`fxpipe.passes.blocks`); a node that cannot run (no kernel, over `max_node_bytes`) is estimated
from its FLOPs and bytes on meta, fitted to the nodes that ran (`Estimates`); `NodeCost.source`
says which. Costs live on nodes: later passes only read `node.meta["cost"]`, and a user may write
their own (analytic FLOP counts, say) and skip measuring.

Example (a node's cost, measured):

>>> import torch
>>> from fxpipe.passes.annotate_costs import annotate_costs
>>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
>>> gm = annotate_costs(gm, (torch.randn(2, 4),), repeats=1, warmup=0)
>>> cost = gm.graph.find_nodes(op="call_module", target="0")[0].meta["cost"]
>>> cost.out_bytes, cost.param_bytes
(32, 80)
"""

from ..device import start_timer  # noqa: F401 (imported from here by tests, as before)
from .annotate import (UNSTEADY, WRITTEN, annotate_costs, bind_inputs, measurement_spread,
                       spread)
from .interpreter import CostInterpreter, Estimates, Profile, tensor_bytes
from .reuse import Reuse

__all__ = ["CostInterpreter", "Estimates", "Profile", "Reuse", "UNSTEADY", "WRITTEN",
           "annotate_costs", "bind_inputs", "measurement_spread", "spread", "tensor_bytes"]
