"""The cost model: what a stage costs, as pure functions of plain data.

The partitioner minimises these numbers and the schedule simulator predicts with them, so the plan
and the prediction always agree. Nothing here touches a GraphModule except `cost_graph`, which
reads `node.meta["cost"]` (and `node.meta["costs"][kind]` per device kind) once and returns a
`CostGraph`, plain tuples a test can also build by hand.

Units are in the names: seconds (`_s`), bytes (`_bytes`), bytes per second (`bytes_per_s`).

The parts, each importable from here:

- `values.py`: the plain values: `NodeCost`, `DeviceSpec`, `Link` and the default links,
  `KindTimes`, `StageCost`, `HostCosts` (a call's own work and the interpreter lock's share of
  an action), `format_bytes`.
- `graph.py`: `CostGraph` and `cost_graph`, which reads a GraphModule's costs into one.
- `gpu.py`: a GPU's memory arithmetic (the caching allocator's blocks and segments, cuBLAS's
  workspace, the CUDA context).
- `memory.py`: what a stage holds (`Held`) and what that needs (`Memory`), one forward's live
  set (`forward_peak`), and what a training stage holds along the timetable.
- `recompute.py`: the nodes a stage recomputes to fit (`choose_recomputed`) and what that keeps.
- `tally.py`: one stage's sums (`StageTally`), from which both views of `Pricing` are read.
- `pricing.py`: `Pricing`, the cost rules of one device order, exact and relaxed, and
  `stage_costs`.
- `bound.py`: `lower_bound_s`, below which no partition's bottleneck goes.

Each part imports only those above it in this list (`gpu.py` none).

One vocabulary for a stage's time (compute + transfers, forward and backward apart) and memory:
`Held` (what a stage holds: parameters, activations, saved, received and sent bytes, the record
`Memory` prices) and `StageTally` (one stage's sums, its transfers priced exactly and relaxed),
from which `Pricing` reads its exact view (`stage_costs`; `inference_held`, `training_held`) and
its relaxed one (`relaxed_stage_s`, the lower-bound view). Slicing, the DP's pairs and branch and
bound sum the same terms incrementally and price them through the same `Pricing`: a transfer is one
column of `Pricing.transfer` (per node, its value's time from one stage, or the driver, to another
over their link), the relaxed `send_min` / `receive_min` the least of those columns. Each view is
tested against the exact one. The exact view calls a stage over its device infeasible
(`bottleneck_s` inf), which slicing makes room for and the exact search skips;
`fxpipe/runtime/memory.py` measures beside it. `cost_graph` contracts the nodes that must share a
stage into one unit and carries a forward and backward column per device kind
(`node.meta["costs"][kind]`).

Partial recomputation is priced inside the partitioner: with "auto" in training the exact view
(hence the brute force and every candidate's check) has a stage that must recompute run the nodes
`choose_recomputed` picks (runs of up to 4 nodes, most bytes freed per second of forward first,
until it fits by `Memory.need_partial`; `StageCost.recomputed`) when they cost less than its whole
forward, and compile only rewrites those stages. The greedy choice reads the stage's nodes, too
costly per candidate pair of the DP, so the relaxed views (DP, slicing, probes) price it at a lower
bound: the bytes the recomputed nodes must save to fit (`Memory.must_free`) times the least forward
time per saved byte of any recomputable node (`CostGraph.recomputable`), at most the whole forward.
The DP's value stays a lower bound, branch and bound settles the exact optimum (choosing what a
chain's stages recompute counts against its work limit), and the optimality claim is about what
runs.
"""

from .values import (DRIVER_DEVICE, HOST_DEVICE, PEER_DEVICE, SAME_DEVICE, CostSource,
                     DeviceSpec, HostCosts, KindTimes, Link, LinkFn, NodeCost, StageCost,
                     default_link, format_bytes)
from .graph import CostGraph, cost_graph
from .gpu import (CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, GPU_BLOCK_BYTES,
                  GPU_LARGE_ROUND_BYTES, GPU_MID_BYTES, GPU_MID_SEGMENT_BYTES, GPU_SMALL_BYTES,
                  GPU_SMALL_SEGMENT_BYTES, cublas_workspace_bytes, gpu_block_bytes,
                  gpu_segment_bytes)
from .memory import OPTIMIZER_STATE, WAIT_SLACK, Held, Memory, forward_peak, standalone_held
from .recompute import (RECOMPUTE_LARGEST, RECOMPUTE_WINDOW, Choice, StageNodes,
                        choose_recomputed, stage_memory, stage_nodes)
from .tally import StageTally
from .pricing import Pricing, stage_costs
from .bound import lower_bound_s

__all__ = [
    "CUBLAS_WORKSPACE_BYTES", "CUDA_CONTEXT_BYTES", "Choice", "CostGraph", "CostSource",
    "DRIVER_DEVICE", "DeviceSpec", "GPU_BLOCK_BYTES", "GPU_LARGE_ROUND_BYTES", "GPU_MID_BYTES",
    "GPU_MID_SEGMENT_BYTES", "GPU_SMALL_BYTES", "GPU_SMALL_SEGMENT_BYTES", "HOST_DEVICE", "Held",
    "HostCosts", "KindTimes", "Link", "LinkFn", "Memory", "NodeCost", "OPTIMIZER_STATE",
    "PEER_DEVICE", "Pricing", "RECOMPUTE_LARGEST", "RECOMPUTE_WINDOW", "SAME_DEVICE", "StageCost",
    "StageNodes", "StageTally", "WAIT_SLACK", "choose_recomputed", "cost_graph",
    "cublas_workspace_bytes", "default_link", "format_bytes", "forward_peak", "gpu_block_bytes",
    "gpu_segment_bytes", "lower_bound_s", "standalone_held", "stage_costs", "stage_memory",
    "stage_nodes",
]
