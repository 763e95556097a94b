"""What the partitioner returns, how it checks a result, and what its exact methods established.

A `Partition` is plain data that prints as a table: which stage each node runs in, what each
stage costs, a lower bound no partition can beat, whether its bottleneck is proven optimal, and
its `Method`, the record of how it was found and proven.

The exact methods (`search.py`) settle each family of ideals with one `Outcome`:

- `Proved`: the partition is optimal in the family (its bound is its bottleneck at the end);
- `Certified`: the best partition found, and a lower bound no partition of the family beats;
- `Infeasible`: proven that no partition of the family fits the devices' memory;
- `OverBudget`: the work limit ran out before anything was established.

`Route` says which exact method settled a `Proved` or `Certified` outcome; `orders.py` turns it
into the proof half of the method's sentence.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..cost_model import (CostGraph, DeviceSpec, LinkFn, Memory, StageCost, default_link,
                          lower_bound_s, stage_costs)
from ..errors import PartitionError

# Relative slack for float noise: a bottleneck within it of the bound counts as meeting it.
_TOL = 1e-9


@dataclass(frozen=True)
class DeviceOrders:
    """How many device orders `reorder_devices` tried, and how many were solved to optimality."""

    tried: int
    solved: int


@dataclass(frozen=True)
class Method:
    """How a partition was found and what proves its quality; `str()` is the sentence.

    `found_by` names the method whose partition won (e.g. "slicing the graph order"); `proof`
    names where the lower bound comes from; `optimal` says the partition is proven optimal for
    its device order; `orders` is set when several device orders were tried.
    """

    found_by: str
    proof: str
    optimal: bool = False
    orders: DeviceOrders | None = None

    def __str__(self) -> str:
        sentence = f"found by {self.found_by}; {self.proof}" + (
            ": proven optimal" if self.optimal else "")
        if self.orders is None:
            return sentence
        return (f"best of {self.orders.tried} device orders, {self.orders.solved} solved to "
                f"optimality; for this order: {sentence}")


class Route(enum.Enum):
    """The exact method that settled a family of ideals."""

    DP = "the DP over ideals, tight or with nothing better than the best known"
    PROBES = "DPs limited to narrow bands of compute"
    BRANCH_AND_BOUND = "branch and bound on exact transfers after the DP"


@dataclass(frozen=True)
class Proved:
    """`stage_of` is optimal in the family; `lower_bound_s` is the best relaxed value found."""

    stage_of: tuple[int, ...]
    lower_bound_s: float
    route: Route


@dataclass(frozen=True)
class Certified:
    """`stage_of` is the best found; no partition of the family is faster than `lower_bound_s`."""

    stage_of: tuple[int, ...]
    lower_bound_s: float
    route: Route


@dataclass(frozen=True)
class Infeasible:
    """Proven: no partition of the family fits the devices' memory."""


@dataclass(frozen=True)
class OverBudget:
    """The work limit ran out before the exact methods established anything."""


Outcome = Proved | Certified | Infeasible | OverBudget


@dataclass(frozen=True)
class Partition:
    """Which stage each node runs in, what each stage costs, and how close to optimal that is.

    `stage_of` maps every computing node's name to its stage (graph inputs belong to no stage),
    in the graph's order (the nodes a CostGraph node stands for, `CostGraph.members`,
    together). `lower_bound_s` is a bound no partition can beat; `optimal` says the bottleneck
    is proven minimal; `method` says how it was found and proven (None when the caller made it);
    `memory` is the rule its stages were priced by (what explaining a moved cut prices it by).
    """

    stage_of: Mapping[str, int]
    devices: tuple[DeviceSpec, ...]
    stages: tuple[StageCost, ...]
    bottleneck_s: float
    lower_bound_s: float
    optimal: bool
    method: Method | None = None
    memory: Memory = Memory()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def gap(self) -> float:
        """How far the bottleneck may be above optimal: bottleneck / lower bound (1.0 is optimal)."""
        return self.bottleneck_s / self.lower_bound_s if self.lower_bound_s > 0 else 1.0

    @property
    def stage_names(self) -> tuple[tuple[str, ...], ...]:
        """The node names of every stage, in the graph's order."""
        names: list[list[str]] = [[] for _ in self.stages]
        for name, s in self.stage_of.items():
            names[s].append(name)
        return tuple(tuple(ns) for ns in names)

    def nodes_of(self, stage: int) -> list[str]:
        return [name for name, s in self.stage_of.items() if s == stage]

    def table(self) -> str:
        from tabulate import tabulate     # here: only a printed plan needs it
        rows = [(s, d.name, c.num_nodes, c.compute_s * 1e3, c.comm_s * 1e3, c.time_s * 1e3,
                 c.memory_bytes / 1e6, c.sent_bytes)
                for s, (d, c) in enumerate(zip(self.devices, self.stages))]
        return tabulate(rows, headers=["stage", "device", "nodes", "compute ms", "comm ms",
                                       "predicted ms", "memory MB", "bytes sent"],
                        floatfmt=".3f")

    def __str__(self) -> str:
        proof = "proven optimal" if self.optimal else f"at most {self.gap:.3f}x the optimum"
        how = f"; {self.method}" if self.method is not None else ""
        return (f"{self.table()}\nbottleneck {self.bottleneck_s * 1e3:.3f} ms, lower bound "
                f"{self.lower_bound_s * 1e3:.3f} ms ({proof}{how})")


def evaluate(graph: CostGraph, stage_of: Sequence[int], devices: Sequence[DeviceSpec],
             link: LinkFn = default_link, *, optimal: bool = False, method: Method | None = None,
             lower_bound: float | None = None, memory: Memory = Memory()) -> Partition:
    """The `Partition` that assigns node `i` to `stage_of[i]`; checks that it is valid.

    `lower_bound` defaults to `cost_model.lower_bound_s`; a bound above the bottleneck can only
    be float noise and is clipped to it.
    """
    check_valid(graph, stage_of, len(devices))
    costs = stage_costs(graph, stage_of, devices, link, memory=memory)
    bottleneck = max(c.time_s for c in costs)
    bound = lower_bound_s(graph, devices) if lower_bound is None else lower_bound
    return Partition(
        stage_of={name: stage_of[i] for i in graph.compute_nodes for name in graph.node_names(i)},
        devices=tuple(devices), stages=tuple(costs), bottleneck_s=bottleneck,
        lower_bound_s=min(bound, bottleneck), optimal=optimal, method=method, memory=memory)


def check_valid(graph: CostGraph, stage_of: Sequence[int], num_stages: int) -> None:
    """Raise unless every compute node has a stage in range and no value flows backwards."""
    for i in graph.compute_nodes:
        if not 0 <= stage_of[i] < num_stages:
            raise PartitionError(f"node {graph.names[i]!r} is in stage {stage_of[i]}, "
                                 f"outside 0..{num_stages - 1}")
        for p in graph.preds[i]:
            if not graph.is_input[p] and stage_of[p] > stage_of[i]:
                raise PartitionError(
                    f"node {graph.names[i]!r} reads {graph.names[p]!r} from a later stage\n"
                    f"node {graph.names[i]!r} is in stage {stage_of[i]}, {graph.names[p]!r} in "
                    f"the later stage {stage_of[p]}; stages must only pass values forward")
