"""Min-max partition of a costed graph into pipeline stages.

`partition(graph, devices)` assigns every computing node a stage, stage `s` running on
`devices[s]`, so that

- values only flow forward (stage `s` reads only from stages `<= s`), every stage is non-empty;
- each stage fits its device's memory (`cost_model.stage_costs`: parameters plus activations);
- the bottleneck, the largest stage time (compute on its device plus the transfers it sends and
  receives, one per (producer, receiving stage)), is as small as the methods below can make it.

A node's compute time depends on the device: its kind's time (`CostGraph.device_times`: a GPU
may be 20x faster than a CPU on a matrix product and no faster on a reshape) over its speed.

The result is a `Partition`: plain data that prints as a table, carries a lower bound no
partition can beat, says whether its bottleneck is proven optimal, and records how in its
`Method`. It is a pure function of the CostGraph, the devices, the link function and the options
(`Limits` among them: the exact methods' work limits).

Devices are used in the order given: stage `s` runs on `devices[s]` (list them in the order of
the interconnect). The search knows each stage's node times, memory and links, so it puts more work
on faster devices and less on smaller ones, but it does not permute the devices unless asked
(`reorder_devices=True` tries every distinct order of a short device list and keeps the best).
Asking for more stages than computing nodes is an error; `num_stages_for` finds the partition
onto the fewest devices of a list that is as fast as using more.

Methods, all deterministic (their limits count work, not time); the partition with the least
exact bottleneck wins:

1. **Slicing topological orders** (`slicing.py`; always, the upper bound the others prune with).
2. **DP over ideals** (`lattice.py`; Tarnawski et al. 2020): the least *relaxed* bottleneck, a
   lower bound on every partition, exact for typical DNNs.
3. **Branch and bound on exact transfers** (`search.py`) when the DP's partition costs more
   under the exact model than the DP's value. Finishing proves the optimum.
4. **Band probes** (`search.py`) when the full DP is over its work limit: DPs limited to narrow
   bands of compute, raising the certified bound.
5. **Exact slicing** of each order (methods 2-3 on its prefixes) for graphs of up to
   `Limits.prefix_nodes` nodes when nothing above proved optimality.

The exact methods report typed outcomes (`result.py`: `Proved`, `Certified`, `Infeasible`,
`OverBudget`); `orders.py` combines them per device order, and across orders.

`lower_bound_s` is the best of: a weighted average of the devices' compute and the largest node
on the device it is fastest on (`cost_model.lower_bound_s`), the DP's value, the probes' L, and
the optimum itself when methods 2-3 finished. `optimal` is true when the bottleneck meets it.

Time on this machine (benchmarks/partition_speed.py, DNN-shaped graphs): ~0.02-0.07 s for
1,000 nodes, 0.4-0.75 s for 10,000 nodes into 2-8 stages (proven optimal), ~0.8 s for 50,000
nodes (slicing, certified within 0.1%).

Example (four equal nodes onto two devices; costs written by hand, as a user may):

>>> from torch import fx, nn
>>> from fxpipe.passes.cost_model import DeviceSpec, NodeCost
>>> from fxpipe.passes.partition import partition
>>> gm = fx.symbolic_trace(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]))
>>> for node in gm.graph.nodes:      # every node: placeholder and output cost nothing
...     node.meta["cost"] = NodeCost(fwd_s=1.0 if node.op == "call_module" else 0.0)
>>> found = partition(gm, [DeviceSpec("cpu"), DeviceSpec("cpu")])
>>> found.stage_of
{'_0': 0, '_1': 0, '_2': 1, '_3': 1}
>>> found.optimal, round(found.bottleneck_s, 2)
(True, 2.0)
"""

from .orders import num_stages_for, partition
from .limits import Limits
from .result import DeviceOrders, Method, Partition, check_valid, evaluate

__all__ = ["DeviceOrders", "Limits", "Method", "Partition", "check_valid", "evaluate",
           "num_stages_for", "partition"]
