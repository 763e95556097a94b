"""Min-max partition of a costed graph into pipeline stages.

`partition(graph, devices)` assigns every computing node a stage so that values only flow forward
(stage `s` reads only from stages `<= s`), and tries to make the slowest stage (compute on its
device plus the transfers it sends and receives, see `cost_model.stage_costs`) as fast as possible.
The result is a `Partition`: plain data that prints as a table and that tests can build by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch.fx as fx
from tabulate import tabulate

from .cost_model import (CostGraph, DeviceSpec, LinkFn, StageCost, cost_graph, default_link,
                         lower_bound_s, stage_costs)
from .errors import PartitionError


@dataclass(frozen=True)
class Partition:
    """Which stage each node runs in, what each stage costs, and how close to optimal that is.

    `stage_of` maps every computing node's name to its stage (graph inputs belong to no stage).
    `lower_bound_s` is a bound no partition can beat; `optimal` says the bottleneck is proven minimal.
    """

    stage_of: Mapping[str, int]
    devices: tuple[DeviceSpec, ...]
    stages: tuple[StageCost, ...]
    bottleneck_s: float
    lower_bound_s: float
    optimal: bool
    method: str = ""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def gap(self) -> float:
        """How far the bottleneck may be above optimal: bottleneck / lower bound (1.0 is optimal)."""
        return self.bottleneck_s / self.lower_bound_s if self.lower_bound_s > 0 else 1.0

    def nodes_of(self, stage: int) -> list[str]:
        return [name for name, s in self.stage_of.items() if s == stage]

    def table(self) -> str:
        rows = [(s, d.name, c.num_nodes, c.compute_s * 1e3, c.comm_s * 1e3, c.time_s * 1e3,
                 c.memory_bytes / 1e6, c.sent_bytes)
                for s, (d, c) in enumerate(zip(self.devices, self.stages))]
        return tabulate(rows, headers=["stage", "device", "nodes", "compute ms", "comm ms",
                                       "predicted ms", "memory MB", "bytes sent"],
                        floatfmt=".3f")

    def __str__(self) -> str:
        proof = "proven optimal" if self.optimal else f"at most {self.gap:.3f}x the optimum"
        return (f"{self.table()}\nbottleneck {self.bottleneck_s * 1e3:.3f} ms, lower bound "
                f"{self.lower_bound_s * 1e3:.3f} ms ({proof}; {self.method})")


def evaluate(graph: CostGraph, stage_of: Sequence[int], devices: Sequence[DeviceSpec],
             link: LinkFn = default_link, *, optimal: bool = False, method: str = "") -> Partition:
    """The `Partition` that assigns node `i` to `stage_of[i]`; checks that it is valid."""
    check_valid(graph, stage_of, len(devices))
    costs = stage_costs(graph, stage_of, devices, link)
    return Partition(
        stage_of={graph.names[i]: stage_of[i] for i in graph.compute_nodes},
        devices=tuple(devices), stages=tuple(costs),
        bottleneck_s=max(c.time_s for c in costs),
        lower_bound_s=lower_bound_s(graph, devices), optimal=optimal, method=method)


def check_valid(graph: CostGraph, stage_of: Sequence[int], num_stages: int) -> None:
    """Raise unless every compute node has a stage in range and no value flows backwards."""
    for i in graph.compute_nodes:
        if not 0 <= stage_of[i] < num_stages:
            raise PartitionError(f"node {graph.names[i]!r} is in stage {stage_of[i]}, "
                                 f"outside 0..{num_stages - 1}")
        for p in graph.preds[i]:
            if not graph.is_input[p] and stage_of[p] > stage_of[i]:
                raise PartitionError(
                    f"node {graph.names[i]!r} (stage {stage_of[i]}) reads {graph.names[p]!r} "
                    f"from the later stage {stage_of[p]}: stages must only pass values forward")


def partition(graph: CostGraph | fx.GraphModule, devices: Sequence[DeviceSpec],
              link: LinkFn = default_link) -> Partition:
    """Split `graph` into `len(devices)` stages, stage `s` running on `devices[s]`.

    First version: a time-balanced contiguous split of the topological order, evaluated with the
    full cost model.
    """
    if isinstance(graph, fx.GraphModule):
        graph = cost_graph(graph)
    k = len(devices)
    compute = graph.compute_nodes
    if k < 1:
        raise PartitionError("no devices: pass at least one device")
    if len(compute) < k:
        raise PartitionError(
            f"the graph has {len(compute)} computing nodes, too few for {k} stages: "
            f"use at most {len(compute)} devices")
    total = sum(graph.time_s[i] for i in compute) or 1.0
    stage_of = [0] * len(graph)
    done = 0.0
    stage = 0
    for position, i in enumerate(compute):
        remaining_nodes = len(compute) - position
        target = total * (stage + 1) / k
        if stage < k - 1 and position > 0 and (done >= target or remaining_nodes <= k - 1 - stage):
            stage += 1
        stage_of[i] = stage
        done += graph.time_s[i]
    return evaluate(graph, stage_of, devices, link, method="balanced slices of the graph order")
