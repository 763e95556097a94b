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
"""

from ..device import start_timer  # noqa: F401 (imported from here by tests, as before)
from .annotate import (UNSTEADY, WRITTEN, annotate_costs, bind_inputs, measurement_spread,
                       spread)
from .interpreter import CostInterpreter, Estimates, Profile, tensor_bytes
from .reuse import Reuse

__all__ = ["CostInterpreter", "Estimates", "Profile", "Reuse", "UNSTEADY", "WRITTEN",
           "annotate_costs", "bind_inputs", "measurement_spread", "spread", "tensor_bytes"]
