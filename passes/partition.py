"""Min-max partition of a costed graph into pipeline stages.

`partition(graph, devices)` assigns every computing node a stage, stage `s` running on
`devices[s]`, so that

- values only flow forward (stage `s` reads only from stages `<= s`), every stage is non-empty;
- each stage fits its device's memory (`cost_model.stage_costs`: parameters plus activations);
- the bottleneck, the largest stage time (compute on its device plus the transfers it sends and
  receives, one per (producer, receiving stage)), is as small as the methods below can make it.

The result is a `Partition`: plain data that prints as a table, carries a lower bound no
partition can beat, and says whether its bottleneck is proven optimal. It is a pure function of
the CostGraph, the devices, the link function and the options.

Devices are used in the order given: stage `s` runs on `devices[s]` (list them in the order of
the interconnect). Since devices may differ, the search places nodes knowing each stage's speed,
memory and links; it does not permute the devices (`reorder_devices=True` tries every distinct
order of a short device list and keeps the best).

Methods (all run when they fit; the best partition under the exact cost model is kept):

1. **Ideal DP** (Tarnawski et al., "Efficient Algorithms for Device Placement of DNN Graph
   Operators", NeurIPS 2020). A valid partition is a chain of ideals (downward-closed node sets)
   0 = I_0 < I_1 < ... < I_k = V; stage `s` is I_{s+1} - I_s. Dynamic programming over pairs of
   ideals minimises the largest *relaxed* stage time, in which a stage's transfers are priced
   from the pair alone: a received value over the cheapest link from an earlier stage, a sent
   value once over the cheapest link to a later stage. Relaxed times never exceed exact ones, so
   the DP's value is a lower bound on every partition, and it is exact whenever each value is
   received by at most one later stage over uniform links (typical DNNs). Where the DP's best
   partition costs more under the exact model, a branch and bound over chains of ideals, pruned
   with the DP's values, finds the exact optimum. Time O(n N + k P) for N ideals and P pairs of
   ideals (P <= N^2 / 2, fewer after pruning pairs whose compute alone exceeds a known upper
   bound); run while N and P stay small, which they do for chains with parallel branches
   (a sequential model has n + 1 ideals).
2. **Slicing topological orders**: binary search on the bottleneck B; for a given B a greedy
   pass over the order closes each stage as late as its exact time allows (received values are
   priced over the real link, a sender is re-charged when a second stage receives its value, a
   stage is abandoned as soon as a transfer pushes an earlier stage over B). O(n + e) per pass,
   O((n + e) log(1/eps)) per order, run over the graph's order and a depth-first order that keeps
   each branch together.

The lower bound reported is the DP's value when method 1 ran, else `cost_model.lower_bound_s`
(total compute over total speed; the largest node on the fastest device). `optimal` is true when
the bottleneck meets the bound, or when the branch and bound finished.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, replace
from typing import Iterator, Mapping, Sequence

import torch.fx as fx
from tabulate import tabulate

from .cost_model import (DRIVER, CostGraph, DeviceSpec, Link, LinkFn, StageCost, cost_graph,
                         default_link, lower_bound_s, stage_costs, stage_memory_bytes)
from .errors import PartitionError

# Limits that keep the exact methods fast in pure Python; beyond them the slicing result stands,
# with the weaker bound. Measured on 2 shared cores: ~0.3 s at the limits.
IDEAL_LIMIT = 2_000
PAIR_LIMIT = 200_000
SEARCH_LIMIT = 20_000
REORDER_LIMIT = 24
# Relative slack for float noise: a bottleneck within it of the bound counts as meeting it.
_TOL = 1e-9


@dataclass(frozen=True)
class Partition:
    """Which stage each node runs in, what each stage costs, and how close to optimal that is.

    `stage_of` maps every computing node's name to its stage (graph inputs belong to no stage),
    in the graph's order. `lower_bound_s` is a bound no partition can beat; `optimal` says the
    bottleneck is proven minimal; `method` says how it was found and proven.
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
             link: LinkFn = default_link, *, optimal: bool = False, method: str = "",
             lower_bound: float | None = None, activation_factor: float = 1.0) -> Partition:
    """The `Partition` that assigns node `i` to `stage_of[i]`; checks that it is valid.

    `lower_bound` defaults to `cost_model.lower_bound_s`; a bound above the bottleneck can only
    be float noise and is clipped to it.
    """
    check_valid(graph, stage_of, len(devices))
    costs = stage_costs(graph, stage_of, devices, link, activation_factor=activation_factor)
    bottleneck = max(c.time_s for c in costs)
    bound = lower_bound_s(graph, devices) if lower_bound is None else lower_bound
    return Partition(
        stage_of={graph.names[i]: stage_of[i] for i in graph.compute_nodes},
        devices=tuple(devices), stages=tuple(costs), bottleneck_s=bottleneck,
        lower_bound_s=min(bound, bottleneck), optimal=optimal, method=method)


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
              link: LinkFn = default_link, *, activation_factor: float = 1.0,
              training: bool = False, reorder_devices: bool = False) -> Partition:
    """Split `graph` into `len(devices)` non-empty stages, stage `s` running on `devices[s]`.

    Minimises the bottleneck (see the module docstring for the methods and their proofs).
    `activation_factor` multiplies activation memory (e.g. the number of micro-batches in flight
    when training); `training` adds backward time when `graph` is a GraphModule;
    `reorder_devices` also tries every distinct order of the devices (at most 24 orders), and the
    result's `devices` says which was kept.

    Raises PartitionError when there are more devices than computing nodes, or when no partition
    found fits the devices' memory (naming the stages that need more than their device has).
    """
    if isinstance(graph, fx.GraphModule):
        graph = cost_graph(graph, training=training)
    devices = tuple(devices)
    _check_request(graph, devices)
    orders = [devices]
    if reorder_devices:
        orders = list(dict.fromkeys(itertools.islice(itertools.permutations(devices),
                                                     REORDER_LIMIT * math.factorial(len(devices)))))
        if len(orders) > REORDER_LIMIT:
            raise PartitionError(
                f"{len(orders)} distinct orders of {len(devices)} devices are too many to try "
                f"(at most {REORDER_LIMIT}): pass reorder_devices=False and order them yourself")
    results = []
    for ds in orders:
        result = _partition(graph, ds, link, activation_factor)
        if result is not None:
            results.append(result)
    if not results:
        raise _memory_error(graph, devices, link, activation_factor)
    best = min(results, key=lambda p: p.bottleneck_s)
    if len(orders) > 1:
        # The bound of one device order bounds only that order: the minimum over orders is valid.
        bound = min(p.lower_bound_s for p in results)
        best = replace(best, lower_bound_s=bound,
                       optimal=all(p.optimal for p in results if p is best or
                                   p.lower_bound_s < best.bottleneck_s * (1 - _TOL)) and
                       best.bottleneck_s <= bound * (1 + _TOL) or
                       all(p.optimal for p in results),
                       method=best.method + f"; best of {len(orders)} device orders")
    return best


def num_stages_for(graph: CostGraph | fx.GraphModule, device: DeviceSpec, max_stages: int,
                   link: LinkFn = default_link, *, tolerance: float = 0.02,
                   activation_factor: float = 1.0, training: bool = False) -> int:
    """How many stages to use when `max_stages` devices like `device` are available.

    Partitions the graph into 1 .. `max_stages` stages and returns the fewest whose bottleneck is
    within `tolerance` (relative) of the best: a stage beyond that adds a device but no speed.
    """
    if isinstance(graph, fx.GraphModule):
        graph = cost_graph(graph, training=training)
    limit = min(max_stages, len(graph.compute_nodes))
    bottlenecks = {}
    for k in range(1, limit + 1):
        try:
            bottlenecks[k] = partition(graph, [device] * k, link,
                                       activation_factor=activation_factor).bottleneck_s
        except PartitionError:
            continue
    if not bottlenecks:
        raise _memory_error(graph, (device,) * limit, link, activation_factor)
    best = min(bottlenecks.values())
    return min(k for k, b in bottlenecks.items() if b <= best * (1 + tolerance))


# ----------------------------------------------------------------------------------------------
# The search


def _check_request(graph: CostGraph, devices: Sequence[DeviceSpec]) -> None:
    k = len(devices)
    computing = len(graph.compute_nodes)
    if k < 1:
        raise PartitionError("no devices: pass at least one device")
    if computing < k:
        raise PartitionError(
            f"the graph has {computing} computing nodes, too few for {k} stages: use at most "
            f"{computing} devices (num_stages_for() picks a useful number)")
    for d in devices:
        if not d.speed > 0:
            raise PartitionError(f"device {d.name!r} has speed {d.speed}: speeds must be > 0")


class _Model:
    """The cost model flattened for the search: links between stages, relaxed transfer times."""

    def __init__(self, graph: CostGraph, devices: tuple[DeviceSpec, ...], link: LinkFn,
                 activation_factor: float):
        k = len(devices)
        self.graph = graph
        self.devices = devices
        self.link = link
        self.k = k
        self.activation_factor = activation_factor
        self.links = [[link(a, b) for b in devices] for a in devices]
        self.from_driver = [link(DRIVER, d) for d in devices]
        self.to_driver = [link(d, DRIVER) for d in devices]
        # The distinct links a stage may send to (later stages) or receive from (earlier ones).
        self._later = [tuple(dict.fromkeys(self.links[s][t] for t in range(s + 1, k)))
                       for s in range(k)]
        self._earlier = [tuple(dict.fromkeys(self.links[t][s] for t in range(s)))
                         for s in range(k)]

    def send_min(self, s: int, nbytes: int) -> float:
        """The least a stage-`s` value can cost its sender to reach one later stage."""
        return _cheapest(self._later[s], nbytes)

    def recv_min(self, s: int, p: int) -> float:
        """The least receiving node `p`'s value can cost stage `s`."""
        nbytes = self.graph.out_bytes[p]
        if self.graph.is_input[p]:
            return self.from_driver[s].time_s(nbytes)
        return _cheapest(self._earlier[s], nbytes)

    def memory(self, s: int, param_bytes: int, activation_bytes: int) -> bool:
        """True when stage `s` fits its device."""
        need = stage_memory_bytes(param_bytes, activation_bytes, self.activation_factor)
        return need <= self.devices[s].memory_bytes

    def bottleneck(self, stage_of: Sequence[int]) -> float:
        costs = stage_costs(self.graph, stage_of, self.devices, self.link,
                            activation_factor=self.activation_factor)
        return max(c.time_s for c in costs)


def _cheapest(links: tuple[Link, ...], nbytes: int) -> float:
    if len(links) == 1:
        return links[0].time_s(nbytes)
    return min((link.time_s(nbytes) for link in links), default=0.0)


def _partition(graph: CostGraph, devices: tuple[DeviceSpec, ...], link: LinkFn,
               activation_factor: float) -> Partition | None:
    """The best partition for one device order, or None when none found fits in memory."""
    model = _Model(graph, devices, link, activation_factor)
    bound = lower_bound_s(graph, devices)
    candidates: list[tuple[float, list[int], str]] = []
    for name, order in _orders(graph):
        sliced = _best_slicing(model, order, bound)
        if sliced is not None:
            candidates.append((model.bottleneck(sliced), sliced, f"slicing the {name} order"))
    upper = min((c[0] for c in candidates), default=math.inf)
    dp = _IdealDP.run(model, upper)
    method = "slicing topological orders (binary search on the bottleneck)"
    proven = False
    if dp is not None:
        bound = max(bound, dp.lower_bound)
        if dp.stage_of is not None:
            candidates.append((model.bottleneck(dp.stage_of), dp.stage_of, dp.method))
        proven = dp.proven
        method = dp.method
    if not candidates:
        return None
    bottleneck, stage_of, how = min(candidates, key=lambda c: c[0])
    if dp is not None and dp.proven:
        bound = max(bound, bottleneck)   # exhaustive: the bottleneck itself is the optimum
    optimal = proven or bottleneck <= bound * (1 + _TOL)
    if dp is None:
        method = f"{how}; bound: compute over speed ({_IdealDP.why_not(model)})"
    elif not dp.proven:
        method = f"{how}; {dp.method}"
    return evaluate(graph, stage_of, devices, link, optimal=optimal, method=method,
                    lower_bound=bound, activation_factor=activation_factor)


def _memory_error(graph: CostGraph, devices: Sequence[DeviceSpec], link: LinkFn,
                  activation_factor: float) -> PartitionError:
    """An error naming the stages that need more memory than their device has."""
    roomiest = max(d.memory_bytes for d in devices)
    for i in graph.compute_nodes:
        need = stage_memory_bytes(graph.param_bytes[i], graph.out_bytes[i], activation_factor)
        if need > roomiest:
            return PartitionError(
                f"node {graph.names[i]!r} alone needs {need / 1e6:.1f} MB, more than any device "
                f"has (at most {roomiest / 1e6:.1f} MB): use devices with more memory or a "
                f"smaller micro-batch")
    unbounded = tuple(replace(d, memory_bytes=math.inf) for d in devices)
    plan = _partition(graph, unbounded, link, activation_factor)
    assert plan is not None
    over = [f"stage {s} on {d.name} needs {c.memory_bytes / 1e6:.1f} MB but has "
            f"{d.memory_bytes / 1e6:.1f} MB"
            for s, (d, c) in enumerate(zip(devices, plan.stages)) if c.memory_bytes > d.memory_bytes]
    need = sum(c.memory_bytes for c in plan.stages)
    have = sum(d.memory_bytes for d in devices)
    return PartitionError(
        f"no partition into {len(devices)} stages fits the devices' memory. The fastest "
        f"partition ignoring memory needs {need / 1e6:.1f} MB in all ({have / 1e6:.1f} MB "
        f"available): {'; '.join(over) or 'each stage fits, but no fast one does'}. Add devices, "
        f"use devices with more memory, or use smaller micro-batches")


# ----------------------------------------------------------------------------------------------
# Method 2: slicing topological orders


def _orders(graph: CostGraph) -> Iterator[tuple[str, list[int]]]:
    """The graph's own order, and a depth-first order that keeps each branch together."""
    given = graph.compute_nodes
    yield "graph", given
    waiting = [sum(not graph.is_input[p] for p in graph.preds[i]) for i in range(len(graph))]
    stack = [i for i in reversed(given) if waiting[i] == 0]
    order = []
    while stack:
        i = stack.pop()
        order.append(i)
        for j in reversed(graph.succs[i]):
            waiting[j] -= 1
            if waiting[j] == 0:
                stack.append(j)
    if order != given:
        yield "depth-first", order


def _best_slicing(model: _Model, order: list[int], bound: float) -> list[int] | None:
    """The best contiguous slicing of `order` found by binary search on the bottleneck.

    Starts from the lower bound and gallops up (bound * (1 + 2^j / 1024)) to the first bottleneck
    the greedy pass meets, then bisects to a relative precision of 1e-4 (1e-7 on small graphs).
    """
    position = [-1] * len(model.graph)
    for at, i in enumerate(order):
        position[i] = at
    last = [max((position[j] for j in model.graph.succs[i]), default=-1)
            for i in range(len(model.graph))]
    best = _slice(model, order, position, last, math.inf)
    if best is None:
        return None
    high = best[1]
    low = bound
    step = 1 / 1024
    precision = 1e-7 if len(order) <= 2_000 else 1e-4
    while high > low * (1 + precision):
        target = min(low * (1 + step), (low + high) / 2) if step else (low + high) / 2
        found = _slice(model, order, position, last, target)
        if found is None:
            low = target
            step = step * 2 if step else 0
        else:
            best = found
            high = min(found[1], target)
            step = 0
    return best[0]


def _slice(model: _Model, order: list[int], position: list[int], last: list[int],
           limit: float) -> tuple[list[int], float] | None:
    """One greedy pass: close each stage at the last node that keeps every stage within `limit`.

    Returns the stage of every node and the bottleneck, or None when `limit` is not met. Stage
    times are exact except that a value sent to later stages is first charged at the cheapest
    link to one of them; the receiving stage tops the charge up to the real link, and charges
    again for every further receiving stage. Compute, received values and memory only grow as a
    stage grows, so a stage stops growing as soon as they pass the limit.
    """
    graph, devices, k = model.graph, model.devices, model.k
    times, out_bytes, params = graph.time_s, graph.out_bytes, graph.param_bytes
    preds, is_input, to_output = graph.preds, graph.is_input, graph.to_output
    n = len(order)
    stage_of = [-1] * len(graph)
    load = [0.0] * k
    received_once = bytearray(len(graph))   # some later stage already receives the value
    start = 0
    for s in range(k):
        speed, capacity = devices[s].speed, devices[s].memory_bytes
        to_driver, from_driver, links = model.to_driver[s], model.from_driver[s], model.links
        final = s == k - 1
        fixed = 0.0          # compute, received values and outputs: grows with the stage
        sending = 0.0        # values read after the stage's end, charged at the cheapest link
        param_bytes = activation_bytes = 0
        received: dict[int, None] = {}
        charges: list[tuple[int, float, int]] = []   # (earlier stage, extra time, producer)
        extra = [0.0] * k
        end = None
        for at in range(start, n - (k - 1 - s)):
            i = order[at]
            fixed += times[i] / speed
            param_bytes += params[i]
            activation_bytes += out_bytes[i]
            if to_output[i]:
                fixed += to_driver.time_s(out_bytes[i])
            if last[i] > at:
                sending += model.send_min(s, out_bytes[i])
            overflow = False
            for p in preds[i]:
                if is_input[p]:
                    if p not in received:
                        received[p] = None
                        fixed += from_driver.time_s(out_bytes[p])
                        activation_bytes += out_bytes[p]
                elif position[p] >= start:
                    if last[p] == at:
                        sending -= model.send_min(s, out_bytes[p])
                elif p not in received:
                    received[p] = None
                    sender = stage_of[p]
                    t = links[sender][s].time_s(out_bytes[p])
                    fixed += t
                    activation_bytes += out_bytes[p]
                    more = t if received_once[p] else t - model.send_min(sender, out_bytes[p])
                    charges.append((sender, more, p))
                    extra[sender] += more
                    overflow = overflow or load[sender] + extra[sender] > limit
            if overflow or fixed > limit or not model.memory(s, param_bytes, activation_bytes):
                break
            if fixed + sending <= limit and (not final or at == n - 1):
                end = (at + 1, fixed + sending, len(charges))
        if end is None:
            return None
        stop, load[s], num_charges = end
        for sender, more, p in charges[:num_charges]:
            load[sender] += more
            received_once[p] = 1
        for at in range(start, stop):
            stage_of[order[at]] = s
        start = stop
    return stage_of, max(load)


# ----------------------------------------------------------------------------------------------
# Method 1: dynamic programming over ideals, then branch and bound


@dataclass
class _IdealDP:
    """Tarnawski et al. 2020's DP over the graph's ideals, with the relaxed stage times.

    `lower_bound` bounds every partition; `stage_of` is the DP's (or the search's) best
    partition, None when none fits in memory; `proven` says it is exactly optimal.
    """

    lower_bound: float
    stage_of: list[int] | None
    proven: bool
    method: str

    @staticmethod
    def why_not(model: _Model) -> str:
        return (f"more than {IDEAL_LIMIT} ideals or {PAIR_LIMIT} pairs of ideals: the exact DP "
                f"was skipped")

    @staticmethod
    def run(model: _Model, upper: float) -> _IdealDP | None:
        """The DP's result, or None when the graph has too many ideals or pairs of them."""
        lattice = _Lattice.build(model.graph)
        if lattice is None:
            return None
        pairs = lattice.pairs(model, upper)
        if pairs is None:
            return None
        k = model.k
        full = len(lattice.masks) - 1
        # best[s][I]: the least relaxed bottleneck of splitting ideal I into stages 0..s.
        best: list[list[float]] = []
        choice: list[list[int]] = []
        for s in range(k):
            cost = _StageCost(model, lattice, s)
            values = [math.inf] * len(lattice.masks)
            chosen = [-1] * len(lattice.masks)
            targets = [full] if s == k - 1 else range(1, full)
            for i in targets:
                for j, pair in pairs[i]:
                    before = 0.0 if s == 0 else best[s - 1][j]
                    if (s == 0) != (j == 0) or before >= values[i]:
                        continue
                    value = max(before, cost(pair))
                    if value < values[i]:
                        values[i], chosen[i] = value, j
            best.append(values)
            choice.append(chosen)
        bound = best[k - 1][full]
        ideals = f"DP over {len(lattice.masks)} ideals"
        if bound == math.inf:
            if upper < math.inf:
                raise AssertionError("the DP lost the slicing's partition")
            return _IdealDP(math.inf, None, True, f"{ideals}: nothing fits in memory")
        chain = [full]
        for s in range(k - 1, 0, -1):
            chain.append(choice[s][chain[-1]])
        stage_of = lattice.stage_of(list(reversed(chain)))
        exact = model.bottleneck(stage_of)
        if exact <= bound * (1 + _TOL):
            return _IdealDP(bound, stage_of, True,
                            f"{ideals} (Tarnawski et al. 2020): proven optimal")
        searched = _search(model, lattice, pairs, best, stage_of, exact)
        if searched is None:
            return _IdealDP(bound, stage_of, False,
                            f"bound: {ideals}; branch and bound stopped after {SEARCH_LIMIT} steps")
        return _IdealDP(bound, searched, True,
                        f"{ideals}, then branch and bound on exact transfers: proven optimal")


@dataclass
class _Lattice:
    """The ideals of the graph's computing nodes as bit masks, with what the DP needs of each.

    Bit `b` stands for computing node `nodes[b]`; ideals are listed by size, the empty ideal
    first and the whole graph last.
    """

    graph: CostGraph
    nodes: list[int]
    masks: list[int]
    time_s: list[float]
    param_bytes: list[int]
    out_bytes: list[int]
    output_count: list[int]
    output_bytes: list[int]
    frontier: list[tuple[int, ...]]    # bits whose value is read outside the ideal
    reader_mask: list[int]             # graph node -> mask of the computing nodes reading it
    inputs: list[int]

    @staticmethod
    def build(graph: CostGraph) -> _Lattice | None:
        nodes = graph.compute_nodes
        bit = {i: b for b, i in enumerate(nodes)}
        pred_mask = [sum(1 << bit[p] for p in graph.preds[i] if p in bit) for i in nodes]
        reader_mask = [sum(1 << bit[j] for j in graph.succs[i]) for i in range(len(graph))]
        masks, seen, level = [0], {0}, [0]
        while level:
            grown = []
            for mask in level:
                for b in range(len(nodes)):
                    if not mask >> b & 1 and pred_mask[b] & ~mask == 0:
                        bigger = mask | 1 << b
                        if bigger not in seen:
                            seen.add(bigger)
                            grown.append(bigger)
            if len(seen) > IDEAL_LIMIT:
                return None
            level = sorted(grown)
            masks.extend(level)
        lattice = _Lattice(graph, nodes, masks, [], [], [], [], [], [], reader_mask,
                           [i for i in range(len(graph)) if graph.is_input[i]])
        for mask in masks:
            members = [nodes[b] for b in range(len(nodes)) if mask >> b & 1]
            outputs = [i for i in members if graph.to_output[i]]
            lattice.time_s.append(math.fsum(graph.time_s[i] for i in members))
            lattice.param_bytes.append(sum(graph.param_bytes[i] for i in members))
            lattice.out_bytes.append(sum(graph.out_bytes[i] for i in members))
            lattice.output_count.append(len(outputs))
            lattice.output_bytes.append(sum(graph.out_bytes[i] for i in outputs))
            lattice.frontier.append(tuple(b for b in range(len(nodes)) if mask >> b & 1 and
                                          reader_mask[nodes[b]] & ~mask))
        return lattice

    def pairs(self, model: _Model, upper: float) -> list[list[tuple[int, _Pair]]] | None:
        """For every ideal I, the ideals J < I whose difference may be a stage.

        A stage whose compute alone exceeds `upper` (the bottleneck of a known partition) on the
        fastest device cannot be in a better partition, so such pairs are skipped.
        """
        fastest = max(d.speed for d in model.devices)
        widest = upper * fastest * (1 + _TOL)
        by_time = sorted(range(len(self.masks)), key=lambda i: (self.time_s[i], i))
        sorted_times = [self.time_s[i] for i in by_time]
        pairs: list[list[tuple[int, _Pair]]] = [[] for _ in self.masks]
        count = 0
        for i, mask in enumerate(self.masks):
            low = bisect.bisect_left(sorted_times, self.time_s[i] - widest)
            high = bisect.bisect_right(sorted_times, self.time_s[i] * (1 + _TOL))
            count += high - low
            if count > PAIR_LIMIT * 4:
                return None
            for j in sorted(by_time[low:high]):
                inner = self.masks[j]
                if j < i and inner & ~mask == 0:
                    pairs[i].append((j, self._pair(j, i)))
            if sum(map(len, pairs)) > PAIR_LIMIT:
                return None
        return pairs

    def _pair(self, j: int, i: int) -> _Pair:
        stage = self.masks[i] & ~self.masks[j]
        received = [self.nodes[b] for b in self.frontier[j] if self.reader_mask[self.nodes[b]] & stage]
        received += [p for p in self.inputs if self.reader_mask[p] & stage]
        sending = [self.nodes[b] for b in self.frontier[i] if stage >> b & 1]
        out_bytes = self.graph.out_bytes
        return _Pair(
            time_s=self.time_s[i] - self.time_s[j],
            received=tuple(received), sending=tuple(sending),
            output_count=self.output_count[i] - self.output_count[j],
            output_bytes=self.output_bytes[i] - self.output_bytes[j],
            param_bytes=self.param_bytes[i] - self.param_bytes[j],
            activation_bytes=(self.out_bytes[i] - self.out_bytes[j] +
                              sum(out_bytes[p] for p in received)))

    def stage_of(self, chain: list[int]) -> list[int]:
        """The assignment of a chain of ideals (indices), the whole graph last."""
        stage_of = [-1] * len(self.graph)
        previous = 0
        for s, i in enumerate(chain):
            stage = self.masks[i] & ~previous
            for b, node in enumerate(self.nodes):
                if stage >> b & 1:
                    stage_of[node] = s
            previous = self.masks[i]
        return stage_of


@dataclass(frozen=True)
class _Pair:
    """A candidate stage I - J: what its relaxed time and memory depend on."""

    time_s: float
    received: tuple[int, ...]      # producers outside the stage read inside it
    sending: tuple[int, ...]       # members read after the ideal I
    output_count: int
    output_bytes: int
    param_bytes: int
    activation_bytes: int


class _StageCost:
    """The relaxed time of a candidate stage on stage `s`'s device (inf if it does not fit)."""

    def __init__(self, model: _Model, lattice: _Lattice, s: int):
        graph = model.graph
        self.model, self.s = model, s
        self.speed = model.devices[s].speed
        self.receive = {p: model.recv_min(s, p) for p in range(len(graph))
                        if graph.succs[p] and (graph.is_input[p] or s > 0)}
        self.send = {b: model.send_min(s, graph.out_bytes[b]) for b in range(len(graph))
                     if graph.succs[b] and s < model.k - 1}
        self.out = model.to_driver[s]

    def __call__(self, pair: _Pair) -> float:
        if not self.model.memory(self.s, pair.param_bytes, pair.activation_bytes):
            return math.inf
        out = pair.output_count * self.out.latency_s + pair.output_bytes / self.out.bytes_per_s
        return (pair.time_s / self.speed + out + sum(self.receive[p] for p in pair.received) +
                sum(self.send[p] for p in pair.sending))


class _OutOfSteps(Exception):
    pass


def _search(model: _Model, lattice: _Lattice, pairs: list[list[tuple[int, _Pair]]],
            best: list[list[float]], incumbent: list[int], incumbent_s: float) -> list[int] | None:
    """Branch and bound over chains of ideals, exact transfers at the leaves.

    Chains are built from the last stage back; a branch is cut when its relaxed stage times or
    the DP's value for what remains reach the best exact bottleneck found so far. Returns the
    optimal assignment, or None after SEARCH_LIMIT steps.
    """
    costs = [_StageCost(model, lattice, s) for s in range(model.k)]
    state = {"best": incumbent, "best_s": incumbent_s, "steps": 0}
    chain = [0] * model.k

    def visit(s: int, i: int, suffix: float) -> None:
        options = []
        for j, pair in pairs[i]:
            if (s == 0) != (j == 0):
                continue
            value = max(suffix, costs[s](pair), best[s - 1][j] if s else 0.0)
            if value < state["best_s"] * (1 - _TOL):
                options.append((value, j, pair))
        options.sort(key=lambda o: (o[0], o[1]))
        for value, j, pair in options:
            if value >= state["best_s"] * (1 - _TOL):
                return
            state["steps"] += 1
            if state["steps"] > SEARCH_LIMIT:
                raise _OutOfSteps
            chain[s] = i
            if s > 0:
                visit(s - 1, j, max(suffix, costs[s](pair)))
                continue
            stage_of = lattice.stage_of(chain)
            exact = model.bottleneck(stage_of)
            if exact < state["best_s"]:
                state["best"], state["best_s"] = stage_of, exact

    try:
        visit(model.k - 1, len(lattice.masks) - 1, 0.0)
    except _OutOfSteps:
        return None
    return state["best"]
