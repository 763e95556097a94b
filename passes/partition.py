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
partition can beat, and says whether its bottleneck is proven optimal. It is a pure function of
the CostGraph, the devices, the link function and the options.

Devices are used in the order given: stage `s` runs on `devices[s]` (list them in the order of
the interconnect). The search knows each stage's node times, memory and links, so it puts more work
on faster devices and less on smaller ones, but it does not permute the devices unless asked
(`reorder_devices=True` tries every distinct order of a short device list and keeps the best).
Asking for more stages than computing nodes is an error; `num_stages_for` tells how many
stages of one kind of device are worth using.

Methods, all deterministic (their limits count work, not time); the partition with the least
exact bottleneck wins:

1. **Slicing topological orders** (always; the upper bound the others prune with). Binary
   search on the bottleneck B; for a given B one greedy pass closes each stage as late as its
   time allows: received values are priced over the real link, a sender is re-charged when a
   second stage receives its value, and a stage stops growing as soon as a transfer pushes an
   earlier stage over B. O(n + e) per pass, O((n + e) log(1/eps)) per order; run over the
   graph's order and a depth-first order that keeps each branch together.
2. **DP over ideals** (Tarnawski et al., "Efficient Algorithms for Device Placement of DNN Graph
   Operators", NeurIPS 2020). A valid partition is a chain of ideals (downward-closed node sets)
   {} = I_0 < I_1 < ... < I_k = V; stage `s` is I_{s+1} - I_s. The DP over pairs of ideals
   minimises the largest *relaxed* stage time (`cost_model.Pricing`, whose `relaxed_stage_s`
   the DP's incremental form is tested against), where a stage's transfers are priced from the
   pair alone: a received value over the cheapest link from an earlier stage, a sent value once
   over the cheapest link to a later stage. Relaxed times never exceed exact ones, so the DP's
   value bounds every partition from below, and it is exact when each value is received by at
   most one later stage over uniform links (typical DNNs). Only pairs whose compute fits under
   the best bottleneck known are tried, only ideals in the compute bands where stage boundaries
   can fall take part, and sources are scanned from the largest down, stopping once compute
   alone reaches the best value: O(n N) to list N ideals (IDEAL_LIMIT), then O(k P) for the P
   pairs tried (<= k N^2 / 2, about k N w in practice for a band of w ideals). A sequential
   graph has n + 1 ideals; chains with parallel branches have few more.
3. **Branch and bound on exact transfers**, when the DP's partition costs more under the exact
   model than the DP's value (a value received by several stages, or unequal links): chains are
   built from the last stage back, so each stage's sends are priced exactly, and what precedes
   it is bounded by the DP's values. Finishing proves the optimum.
4. **Band probes** when the full DP is over its work limit: a DP limited to stages of at most L
   needs only the ideals in narrow bands and either finds the relaxed optimum or proves every
   partition slower than L; L rises from the compute bound until the work limit, raising the
   certified bound.
5. **Exact slicing** of each order (methods 2-3 on the n + 1 prefixes of the order) for graphs
   of up to PREFIX_LIMIT nodes when nothing above proved optimality: the best contiguous split
   of that order, so never worse than a split of it by node counts, parameters or time.

`lower_bound_s` is the best of: a weighted average of the devices' compute and the largest node
on the device it is fastest on (`cost_model.lower_bound_s`), the DP's value, the probes' L, and the optimum
itself when methods 2-3 finished. `optimal` is true when the bottleneck meets it.

Time on this machine (benchmarks/partition_speed.py, DNN-shaped graphs): ~0.02-0.07 s for
1,000 nodes, 0.4-0.75 s for 10,000 nodes into 2-8 stages (proven optimal), ~0.8 s for 50,000
nodes (slicing, certified within 0.1%). Slicing grows as (n + e) log(1/eps), nearly independent
of k; listing ideals as n times the graph's width; the DP as k times the pairs in the bands, and
it stops at WORK_LIMIT (about 1 s), after which the slicing and a weaker bound stand.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Iterator, Mapping, NamedTuple, Sequence

import torch.fx as fx
from tabulate import tabulate

from .cost_model import (CostGraph, DeviceSpec, LinkFn, Pricing, StageCost, cost_graph,
                         default_link, lower_bound_s, stage_costs, stage_memory_bytes)
from .errors import PartitionError

# Limits that keep the exact methods fast in pure Python; beyond them the slicing result stands,
# with a weaker bound. Work, not time, so that results do not depend on the machine's load.
IDEAL_LIMIT = 50_000        # ideals listed before the exact DP is given up (~0.3 s to list)
PREFIX_LIMIT = 3_000        # nodes up to which each order's slicing is also solved exactly
WORK_LIMIT = 1_000_000      # subset tests + 8 per candidate stage, per call (~1 s here)
REORDER_LIMIT = 24          # device orders `reorder_devices` may try
# Relative slack for float noise: a bottleneck within it of the bound counts as meeting it.
_TOL = 1e-9


@dataclass(frozen=True)
class Partition:
    """Which stage each node runs in, what each stage costs, and how close to optimal that is.

    `stage_of` maps every computing node's name to its stage (graph inputs belong to no stage),
    in the graph's order (the nodes a CostGraph node stands for, `CostGraph.members`,
    together). `lower_bound_s` is a bound no partition can beat; `optimal` says the bottleneck
    is proven minimal; `method` says how it was found and proven.
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
        stage_of={name: stage_of[i] for i in graph.compute_nodes for name in graph.node_names(i)},
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
        graph = cost_graph(graph, training=training, kinds=[d.kind for d in devices])
    devices = tuple(devices)
    _check_request(graph, devices)
    orders = [devices]
    if reorder_devices:
        count = math.factorial(len(devices))
        for copies in collections.Counter(devices).values():
            count //= math.factorial(copies)
        if count > REORDER_LIMIT:
            raise PartitionError(
                f"{count} distinct orders of {len(devices)} devices are too many to try (at "
                f"most {REORDER_LIMIT}): pass reorder_devices=False and order them yourself")
        orders = list(_distinct_orders(devices))
    results, proven_infeasible = [], True
    for ds in orders:
        result, infeasible = _partition(graph, ds, link, activation_factor)
        if result is not None:
            results.append(result)
        proven_infeasible = proven_infeasible and infeasible
    if not results:
        raise _memory_error(graph, devices, link, activation_factor, proven_infeasible)
    best = min(results, key=lambda p: p.bottleneck_s)
    if len(orders) > 1:
        # Each order's bound holds for that order only, so the smallest is the one that holds;
        # an order where nothing was found is bounded by compute alone.
        bounds = [p.lower_bound_s for p in results]
        if len(results) < len(orders):
            bounds.append(lower_bound_s(graph, devices))
        bound = min(bounds)
        optimal = (best.bottleneck_s <= bound * (1 + _TOL) or
                   len(results) == len(orders) and all(p.optimal for p in results))
        proven = sum(p.optimal for p in results)
        best = replace(best, lower_bound_s=min(bound, best.bottleneck_s), optimal=optimal,
                       method=f"best of {len(orders)} device orders, {proven} solved to "
                              f"optimality; for this order: {best.method}")
    return best


def num_stages_for(graph: CostGraph | fx.GraphModule, devices: Sequence[DeviceSpec],
                   link: LinkFn = default_link, *, tolerance: float = 0.02,
                   activation_factor: float = 1.0, training: bool = False) -> int:
    """How many of `devices` to use: "I have these (e.g. `[gpu] * 8`), how many stages pay?"

    Partitions the graph onto the first 1 .. len(devices) devices and returns the fewest whose
    bottleneck is within `tolerance` (relative) of the best: a stage beyond that adds a device but
    no speed.
    """
    if isinstance(graph, fx.GraphModule):
        graph = cost_graph(graph, training=training, kinds=[d.kind for d in devices])
    if not devices:
        raise PartitionError("no devices: pass at least one")
    limit = min(len(devices), len(graph.compute_nodes))
    bottlenecks = {}
    for k in range(1, limit + 1):
        try:
            bottlenecks[k] = partition(graph, devices[:k], link,
                                       activation_factor=activation_factor).bottleneck_s
        except PartitionError:
            continue
    if not bottlenecks:
        raise _memory_error(graph, tuple(devices[:limit]), link, activation_factor, False)
    best = min(bottlenecks.values())
    return min(k for k, b in bottlenecks.items() if b <= best * (1 + tolerance))


# ----------------------------------------------------------------------------------------------
# The search


def _distinct_orders(devices: tuple[DeviceSpec, ...]) -> Iterator[tuple[DeviceSpec, ...]]:
    """Every distinct order of `devices`, the given one first."""
    kinds = list(dict.fromkeys(devices))
    left = collections.Counter(devices)

    def extend(prefix: tuple[DeviceSpec, ...]) -> Iterator[tuple[DeviceSpec, ...]]:
        if len(prefix) == len(devices):
            yield prefix
        for kind in kinds:
            if left[kind]:
                left[kind] -= 1
                yield from extend(prefix + (kind,))
                left[kind] += 1

    yield devices
    yield from (order for order in extend(()) if order != devices)


def _check_request(graph: CostGraph, devices: Sequence[DeviceSpec]) -> None:
    k = len(devices)
    computing = len(graph.compute_nodes)
    if k < 1:
        raise PartitionError("no devices: pass at least one device")
    if computing < k:
        shared = (" (the nodes that read or write a buffer written in forward count as one: "
                  "they share a stage)" if graph.members is not None else "")
        raise PartitionError(
            f"the graph has {computing} computing nodes{shared}, too few for {k} stages: use at "
            f"most {computing} devices (num_stages_for() picks a useful number)")
    for d in devices:
        if not d.speed > 0:
            raise PartitionError(f"device {d.name!r} has speed {d.speed}: speeds must be > 0")


def _partition(graph: CostGraph, devices: tuple[DeviceSpec, ...], link: LinkFn,
               activation_factor: float) -> tuple[Partition | None, bool]:
    """The best partition for one device order, or (None, whether no partition fits is
    proven) when none found fits in memory."""
    model = Pricing(graph, devices, link, activation_factor)
    bound = lower_bound_s(graph, devices)
    orders = list(_orders(graph))
    candidates: list[tuple[float, list[int], str]] = []
    for name, order in orders:
        sliced = _best_slicing(model, order, bound)
        if sliced is not None:
            candidates.append((model.bottleneck_s(sliced), sliced, f"slicing the {name} order"))

    def exact(lattice: _Lattice, floor: float) -> _Exact | None:
        incumbent_s, incumbent, _ = min(candidates, key=lambda c: c[0],
                                        default=(math.inf, None, ""))
        return _exact(model, lattice, incumbent, incumbent_s, floor, budget)

    budget = _Budget(WORK_LIMIT)
    lattice = _Lattice.ideals(graph, model.columns)
    found = None if lattice is None else exact(lattice, bound)
    if found is not None and found.stage_of is None:
        if found.proven:
            return None, True
        found = None
    if found is None:
        why = "too many ideals" if lattice is None else "over its work limit"
        proof = f"bound: compute over speed (exact DP skipped: {why})"
    else:
        bound = max(bound, found.lower_bound)
        ideals = f"DP over {len(lattice.masks)} ideals (Tarnawski et al. 2020)"
        proof = {"tight": ideals, "nothing better": ideals,
                 "probes": f"bound: {ideals} limited to narrow bands"}.get(
            found.note, f"{ideals}, then {found.note}")
        candidates.append((model.bottleneck_s(found.stage_of), found.stage_of, "the ideal DP"))
    proven = found is not None and found.proven
    if not proven:
        for name, order in orders:
            if len(order) <= PREFIX_LIMIT:
                sliced = exact(_Lattice.prefixes(graph, order, model.columns), 0.0)
                if sliced is not None and sliced.stage_of is not None:
                    candidates.append((model.bottleneck_s(sliced.stage_of), sliced.stage_of,
                                       f"exact slicing of the {name} order"))
    if not candidates:
        return None, False
    bottleneck, stage_of, how = min(candidates, key=lambda c: c[0])
    if proven:
        bound = max(bound, bottleneck)   # exhaustive: the bottleneck itself is the optimum
    optimal = proven or bottleneck <= bound * (1 + _TOL)
    return evaluate(graph, stage_of, devices, link, optimal=optimal,
                    method=f"found by {how}; {proof}" + (": proven optimal" if optimal else ""),
                    lower_bound=bound, activation_factor=activation_factor), False


def _memory_error(graph: CostGraph, devices: Sequence[DeviceSpec], link: LinkFn,
                  activation_factor: float, proven: bool) -> PartitionError:
    """An error naming the stages that need more memory than their device has; `proven` says
    the exact search showed that no partition fits (else only that none was found)."""
    roomiest = max(d.memory_bytes for d in devices)
    for i in graph.compute_nodes:
        need = stage_memory_bytes(graph.param_bytes[i], graph.out_bytes[i], activation_factor)
        if need > roomiest:
            return PartitionError(
                f"node {graph.names[i]!r} alone needs {_size(need)}, more than any device "
                f"has (at most {_size(roomiest)}): use devices with more memory or a "
                f"smaller micro-batch")
    unbounded = tuple(replace(d, memory_bytes=math.inf) for d in devices)
    plan, _ = _partition(graph, unbounded, link, activation_factor)
    assert plan is not None
    over = [f"stage {s} on {d.name} needs {_size(c.memory_bytes)} but has "
            f"{_size(d.memory_bytes)}"
            for s, (d, c) in enumerate(zip(devices, plan.stages))
            if c.memory_bytes > d.memory_bytes]
    need = sum(c.memory_bytes for c in plan.stages)
    have = sum(d.memory_bytes for d in devices)
    verdict = ("no partition into {} stages fits the devices' memory" if proven else
               "fxpipe found no partition into {} stages that fits the devices' memory (the "
               "graph is too large for the exact search, so one may exist)")
    return PartitionError(
        f"{verdict.format(len(devices))}. The fastest "
        f"partition ignoring memory needs {_size(need)} in all ({_size(have)} "
        f"available): {'; '.join(over) or 'each stage fits, but no fast one does'}. Add devices, "
        f"use devices with more memory, or use smaller micro-batches")


def _size(nbytes: float) -> str:
    """`nbytes` in the unit that shows it (`512 B`, `1.5 KB`, `20.0 MB`, `3.2 GB`; powers of
    1000), so a small model's memory error does not read `0.0 MB`."""
    if not math.isfinite(nbytes):
        return "unbounded memory"
    if round(abs(nbytes)) < 1000:
        return f"{nbytes:.0f} B"
    for unit, scale in (("KB", 1e3), ("MB", 1e6)):
        if round(abs(nbytes) / scale, 1) < 1000:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1e9:.1f} GB"


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


def _best_slicing(model: Pricing, order: list[int], bound: float) -> list[int] | None:
    """The best contiguous slicing of `order` found by binary search on the bottleneck.

    Starts from the lower bound and gallops up (bound * (1 + 2^j / 1024)) to the first bottleneck
    the greedy pass meets, then bisects to a relative precision of 1e-4 (1e-7 on small graphs).
    A pass that fails because later stages re-charged an earlier one for sending it their values
    is retried (up to 3 times) with that stage closed earlier by the amount it went over.
    """
    position = [-1] * len(model.graph)
    for at, i in enumerate(order):
        position[i] = at
    last = [max((position[j] for j in model.graph.succs[i]), default=-1)
            for i in range(len(model.graph))]

    def feasible(limit: float) -> tuple[list[int], float] | None:
        reserve = [0.0] * model.k
        for _ in range(4):
            over: dict[int, float] = {}
            found = _slice(model, order, position, last, limit, reserve, over)
            if found is not None or not over:
                return found
            for s, amount in over.items():
                reserve[s] += amount
        return None

    best = feasible(math.inf)
    if best is None:
        return None
    high = best[1]
    low = bound
    step = 1 / 1024
    precision = 1e-7 if len(order) <= 2_000 else 1e-4
    for _ in range(200):
        if high - low <= precision * high:
            break
        target = (low + high) / 2
        if step and low > 0:
            target = min(target, low * (1 + step))
        found = feasible(target)
        if found is None:
            low = target
            step = step * 2 if step else 0
        else:
            best = found
            high = min(found[1], target)
            step = 0
    return best[0]


def _slice(model: Pricing, order: list[int], position: list[int], last: list[int],
           limit: float, reserve: list[float], over: dict[int, float]
           ) -> tuple[list[int], float] | None:
    """One greedy pass: close each stage at the last node that keeps every stage within `limit`
    (stage `s`'s own time within `limit - reserve[s]`, room for later charges).

    Returns the stage of every node and the bottleneck, or None when `limit` is not met; `over`
    then says by how much later transfers pushed which earlier stages over the limit. Stage
    times are exact except that a value sent to later stages is first charged at the cheapest
    link to one of them; the receiving stage tops the charge up to the real link, and charges
    again for every further receiving stage. Compute, received values and memory only grow as a
    stage grows, so a stage stops growing as soon as they pass the limit.
    """
    graph, devices, k = model.graph, model.devices, model.k
    out_bytes, params = graph.out_bytes, graph.param_bytes
    preds, is_input, to_output = graph.preds, graph.is_input, graph.to_output
    n = len(order)
    stage_of = [-1] * len(graph)
    load = [0.0] * k
    received_once = bytearray(len(graph))   # some later stage already receives the value
    start = 0
    for s in range(k):
        times = model.times[s]
        to_driver, from_driver, links = model.to_driver[s], model.from_driver[s], model.links
        send_min = model.send_min(s)
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
            fixed += times[i]
            param_bytes += params[i]
            activation_bytes += out_bytes[i]
            if to_output[i]:
                fixed += to_driver.time_s(out_bytes[i])
            if last[i] > at:
                sending += send_min[i]
            overflow = False
            for p in preds[i]:
                if is_input[p]:
                    if p not in received:
                        received[p] = None
                        fixed += from_driver.time_s(out_bytes[p])
                        activation_bytes += out_bytes[p]
                elif position[p] >= start:
                    if last[p] == at:
                        sending -= send_min[p]
                elif p not in received:
                    received[p] = None
                    sender = stage_of[p]
                    t = links[sender][s].time_s(out_bytes[p])
                    fixed += t
                    activation_bytes += out_bytes[p]
                    more = t if received_once[p] else t - model.send_min(sender)[p]
                    charges.append((sender, more, p))
                    extra[sender] += more
                    if load[sender] + extra[sender] > limit:
                        overflow = True
                        over[sender] = max(over.get(sender, 0.0),
                                           load[sender] + extra[sender] - limit)
            if overflow or fixed > limit or not model.fits(s, param_bytes, activation_bytes):
                break
            if fixed + sending <= limit - reserve[s] and (not final or at == n - 1):
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


class _OverBudget(Exception):
    pass


class _Budget:
    """Counts the exact methods' work (subset tests; 8 per candidate stage) against a limit.

    Work, not time, so that the result does not depend on the machine's load.
    """

    def __init__(self, limit: int):
        self.left = limit
        self.floor = 0

    def spend(self, amount: int) -> None:
        self.left -= amount
        if self.left < self.floor:
            raise _OverBudget

    @contextlib.contextmanager
    def share(self, fraction: float) -> Iterator[None]:
        """Within the block, spend at most `fraction` of what is left."""
        saved = self.floor
        self.floor = max(saved, self.left - int(self.left * fraction))
        try:
            yield
        finally:
            self.floor = saved


@dataclass
class _Lattice:
    """A family of ideals as bit masks, with what the DP needs of each.

    Either every ideal of the computing nodes (`ideals`), or the prefixes of one topological
    order (`prefixes`, whose chains are the contiguous slicings of that order). Bit `b` stands
    for computing node `nodes[b]`; ideals are listed by size, empty first and the whole graph last.
    `time_s[c]` is every ideal's compute under node-time column `columns[c]` (`Pricing.columns`).
    """

    graph: CostGraph
    nodes: list[int]
    reader_mask: list[int]             # graph node -> mask of the computing nodes reading it
    pred_bits: list[tuple[int, ...]]   # bit -> bits of the computing nodes it reads
    inputs: list[int]
    columns: list[tuple[float, ...]]
    masks: list[int] = field(default_factory=lambda: [0])
    time_s: list[list[float]] = field(default_factory=list)   # per column, per ideal
    param_bytes: list[int] = field(default_factory=lambda: [0])
    out_bytes: list[int] = field(default_factory=lambda: [0])
    output_count: list[int] = field(default_factory=lambda: [0])
    output_bytes: list[int] = field(default_factory=lambda: [0])
    frontier: list[int] = field(default_factory=lambda: [0])   # members read outside, a mask
    _pairs: dict[tuple[int, int], _Pair] = field(default_factory=dict)
    _open: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    _sorted: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)

    @staticmethod
    def _empty(graph: CostGraph, nodes: list[int], columns: list[tuple[float, ...]]) -> _Lattice:
        bit = {i: b for b, i in enumerate(nodes)}
        return _Lattice(graph, nodes, [sum(1 << bit[j] for j in graph.succs[i])
                                       for i in range(len(graph))],
                        [tuple(bit[p] for p in graph.preds[i] if p in bit) for i in nodes],
                        [i for i in range(len(graph)) if graph.is_input[i]], columns,
                        time_s=[[0.0] for _ in columns])

    @staticmethod
    def ideals(graph: CostGraph, columns: list[tuple[float, ...]]) -> _Lattice | None:
        """All ideals, grown one node at a time, or None past IDEAL_LIMIT. O(N * width)."""
        nodes = graph.compute_nodes
        if len(nodes) + 1 > IDEAL_LIMIT:
            return None
        lattice = _Lattice._empty(graph, nodes, columns)
        bit = {i: b for b, i in enumerate(nodes)}
        pred_mask = [sum(1 << bit[p] for p in graph.preds[i] if p in bit) for i in nodes]
        ready = sum(1 << b for b in range(len(nodes)) if pred_mask[b] == 0)
        seen = {0}
        level = [(0, 0, ready)]                      # (mask, index, nodes that may join)
        while level:
            grown = []
            for mask, index, can_join in level:
                rest = can_join
                while rest:
                    low = rest & -rest
                    rest ^= low
                    bigger = mask | low
                    if bigger in seen:
                        continue
                    seen.add(bigger)
                    if len(seen) > IDEAL_LIMIT:
                        return None
                    b = low.bit_length() - 1
                    joining = can_join & ~low
                    readers = lattice.reader_mask[nodes[b]]
                    while readers:
                        r = readers & -readers
                        readers ^= r
                        if pred_mask[r.bit_length() - 1] & ~bigger == 0:
                            joining |= r
                    grown.append((bigger, lattice._add(index, b, bigger), joining))
            level = grown
        return lattice

    @staticmethod
    def prefixes(graph: CostGraph, order: list[int],
                 columns: list[tuple[float, ...]]) -> _Lattice:
        """The n + 1 prefixes of a topological order of the computing nodes."""
        lattice = _Lattice._empty(graph, order, columns)
        for b in range(len(order)):
            lattice._add(b, b, (1 << (b + 1)) - 1)
        return lattice

    def _add(self, parent: int, b: int, mask: int) -> int:
        """Record ideal `mask`, which is ideal `parent` plus bit `b`; returns its index."""
        i = self.nodes[b]
        graph = self.graph
        self.masks.append(mask)
        for column, times in zip(self.columns, self.time_s):
            times.append(times[parent] + column[i])
        self.param_bytes.append(self.param_bytes[parent] + graph.param_bytes[i])
        self.out_bytes.append(self.out_bytes[parent] + graph.out_bytes[i])
        output = graph.to_output[i]
        self.output_count.append(self.output_count[parent] + output)
        self.output_bytes.append(self.output_bytes[parent] + output * graph.out_bytes[i])
        frontier = self.frontier[parent]
        if self.reader_mask[i] & ~mask:
            frontier |= 1 << b
        for p in self.pred_bits[b]:        # only what b reads can stop being read outside
            if frontier >> p & 1 and not self.reader_mask[self.nodes[p]] & ~mask:
                frontier &= ~(1 << p)
        self.frontier.append(frontier)
        return len(self.masks) - 1

    def members(self, mask: int) -> list[int]:
        return [self.nodes[b] for b in _bits(mask)]

    def pair(self, j: int, i: int) -> _Pair:
        """The candidate stage I - J (J a subset of I), computed once."""
        key = (j, i)
        if key not in self._pairs:
            stage = self.masks[i] & ~self.masks[j]
            graph = self.graph
            received = [p for _, p in self._frontier(j) if self.reader_mask[p] & stage]
            received += [p for p in self.inputs if self.reader_mask[p] & stage]
            self._pairs[key] = _Pair(
                tuple(times[i] - times[j] for times in self.time_s), tuple(received),
                tuple(p for b, p in self._frontier(i) if stage >> b & 1),
                self.output_count[i] - self.output_count[j],
                self.output_bytes[i] - self.output_bytes[j],
                self.param_bytes[i] - self.param_bytes[j],
                self.out_bytes[i] - self.out_bytes[j] + sum(graph.out_bytes[p] for p in received))
        return self._pairs[key]

    def _frontier(self, i: int) -> list[tuple[int, int]]:
        """(bit, node) of the members of ideal `i` read outside it, computed once."""
        if i not in self._open:
            self._open[i] = [(b, self.nodes[b]) for b in _bits(self.frontier[i])]
        return self._open[i]

    def by_time(self, c: int) -> tuple[list[int], list[float]]:
        """The ideals sorted by their compute in column `c`, and those computes."""
        if c not in self._sorted:
            times = self.time_s[c]
            order = sorted(range(len(self.masks)), key=lambda i: (times[i], i))
            self._sorted[c] = order, [times[i] for i in order]
        return self._sorted[c]

    def subsets(self, i: int, c: int, widest: float, budget: _Budget) -> Iterator[int]:
        """The ideals that are proper subsets of ideal `i` with at most `widest` less compute in
        column `c`."""
        candidates, times = self.by_time(c)
        mask, time_s = self.masks[i], self.time_s[c][i]
        low = bisect.bisect_left(times, time_s - widest) if widest < math.inf else 0
        high = bisect.bisect_right(times, time_s * (1 + _TOL))
        budget.spend(high - low)
        for j in candidates[low:high]:
            if j < i and self.masks[j] & ~mask == 0:
                yield j

    def stage_of(self, chain: list[int]) -> list[int]:
        """The assignment of a chain of ideals (indices), the whole graph last."""
        stage_of = [-1] * len(self.graph)
        previous = 0
        for s, i in enumerate(chain):
            for node in self.members(self.masks[i] & ~previous):
                stage_of[node] = s
            previous = self.masks[i]
        return stage_of


def _bits(mask: int) -> list[int]:
    """The positions of the set bits of `mask`, lowest first."""
    found = []
    while mask:
        low = mask & -mask
        mask ^= low
        found.append(low.bit_length() - 1)
    return found


class _Pair(NamedTuple):
    """A candidate stage I - J: what its relaxed time and memory depend on."""

    time_s: tuple[float, ...]      # compute per column
    received: tuple[int, ...]      # producers outside the stage read inside it
    sending: tuple[int, ...]       # members read after the ideal I
    output_count: int
    output_bytes: int
    param_bytes: int
    activation_bytes: int


class _StageCost:
    """The relaxed time of a candidate stage on stage `s`'s device (inf if it does not fit)."""

    def __init__(self, model: Pricing, s: int):
        self.model, self.s = model, s
        self.column = model.column_of[s]
        self.receive = model.receive_min(s)
        self.send = model.send_min(s)
        self.out = model.to_driver[s]
        self.capacity = model.devices[s].memory_bytes
        self.factor = model.activation_factor

    def __call__(self, pair: _Pair) -> float:
        # Rounding activations up adds less than a byte: only a near miss needs the exact test.
        if pair.param_bytes + pair.activation_bytes * self.factor + 1 > self.capacity and \
                not self.model.fits(self.s, pair.param_bytes, pair.activation_bytes):
            return math.inf
        out = pair.output_count * self.out.latency_s + pair.output_bytes / self.out.bytes_per_s
        return (pair.time_s[self.column] + out + sum(self.receive[p] for p in pair.received) +
                self.relaxed_send(pair))

    def relaxed_send(self, pair: _Pair) -> float:
        return sum(self.send[p] for p in pair.sending)


@dataclass
class _Exact:
    """What the exact methods proved on one family of ideals.

    `lower_bound` bounds every partition of the family; `stage_of` is the best partition found
    (None when none fits in memory); `proven` says it is optimal in the family.
    """

    lower_bound: float
    stage_of: list[int] | None
    proven: bool
    note: str


def _exact(model: Pricing, lattice: _Lattice, incumbent: list[int] | None, incumbent_s: float,
           floor: float, budget: _Budget) -> _Exact | None:
    """The DP over `lattice`, then branch and bound; None when `budget` runs out first.

    `incumbent` is the best partition known (bottleneck `incumbent_s`, inf if none): stages
    that alone take longer cannot improve on it and are skipped. When that DP is too big,
    `_probe` raises the lower bound `floor` instead. Each step gets half the budget left.
    """
    costs = [_StageCost(model, s) for s in range(model.k)]
    try:
        with budget.share(0.5):
            best = _dp(model, lattice, costs, incumbent_s, budget)
    except _OverBudget:
        with budget.share(0.5):
            return _probe(model, lattice, costs, floor, incumbent, incumbent_s, budget)
    k, full = model.k, len(lattice.masks) - 1
    value = best[k - 1][full][0]
    bound = min(value, incumbent_s)
    if value == math.inf:
        return _Exact(bound, incumbent, True, "nothing better")
    stage_of = _chain(lattice, best, k)
    exact = model.bottleneck_s(stage_of)
    if exact <= bound * (1 + _TOL):
        return _Exact(bound, stage_of, True, "tight")
    if exact > incumbent_s:
        stage_of, exact = incumbent, incumbent_s
    try:
        with budget.share(0.5):
            found = _search(model, lattice, costs, best, stage_of, exact, budget)
    except _OverBudget:
        return _Exact(bound, stage_of, False, "branch and bound over its work limit")
    return _Exact(bound, found, True, "branch and bound on exact transfers")


def _probe(model: Pricing, lattice: _Lattice, costs: list[_StageCost], floor: float,
           incumbent: list[int] | None, incumbent_s: float, budget: _Budget) -> _Exact | None:
    """A lower bound from DPs limited to stages of at most L, for L rising from `floor`.

    A DP limited to L finds the least relaxed bottleneck when it is at most L, and otherwise
    proves every partition slower than L; a small L keeps only the ideals in narrow bands of
    compute around the stage boundaries, so such DPs stay cheap where the full one is not. L
    gallops up (floor * (1 + 2^j / 512)) until a DP succeeds or the budget is spent.
    """
    if floor <= 0:
        return None
    k = model.k
    proven = floor
    step = 1 / 512
    while proven * (1 + step) < incumbent_s:
        limit = proven * (1 + step)
        try:
            best = _dp(model, lattice, costs, limit, budget)
        except _OverBudget:
            break
        value = best[k - 1][-1][0]
        if value < math.inf:
            stage_of = _chain(lattice, best, k)
            exact = model.bottleneck_s(stage_of)
            if exact > incumbent_s:
                stage_of, exact = incumbent, incumbent_s
            return _Exact(value, stage_of, exact <= value * (1 + _TOL), "probes")
        proven = limit
        step *= 2
    if proven <= floor:
        return None
    return _Exact(proven, incumbent, False, "probes")


def _chain(lattice: _Lattice, best: list[list[tuple[float, int]]], k: int) -> list[int]:
    """The DP's best assignment, followed back from the whole graph."""
    chain = [len(lattice.masks) - 1]
    for s in range(k - 1, 0, -1):
        chain.append(best[s][chain[-1]][1])
    return lattice.stage_of(list(reversed(chain)))


def _dp(model: Pricing, lattice: _Lattice, costs: list[_StageCost], limit_s: float,
        budget: _Budget) -> list[list[tuple[float, int]]]:
    """best[s][I] = (least relaxed bottleneck of splitting ideal I into stages 0..s, the ideal
    before stage s). Only stages whose compute alone stays within `limit_s` are tried, only
    ideals reachable within it extended, and only ideals the remaining stages can finish ended."""
    k, full = model.k, len(lattice.masks) - 1
    limit = limit_s * (1 + _TOL)
    by_floor, floor_times = lattice.by_time(model.floor_column)
    total = lattice.time_s[model.floor_column][full]
    unreached = (math.inf, -1)
    best: list[list[tuple[float, int]]] = []
    for s in range(k):
        values = [unreached] * len(lattice.masks)
        column = lattice.time_s[model.column_of[s]]
        by_time, _ = lattice.by_time(model.column_of[s])
        sources = [0] if s == 0 else [j for j in by_time if best[s - 1][j][0] <= limit]
        times = [column[j] for j in sources]
        if s == k - 1:
            targets = [full]
        elif not sources:
            targets = []
        else:   # reachable from a source in one stage, and finishable by the stages left
            # (no ideal's compute is below its floor: the least time of its nodes anywhere)
            low = total - (k - 1 - s) * limit
            high = times[-1] + limit
            targets = sorted(i for i in by_floor[bisect.bisect_left(floor_times, low):
                                                 bisect.bisect_right(floor_times, high)]
                             if 0 < i < full and column[i] <= high)
        masks, previous = lattice.masks, best[-1] if s else None
        for i in targets:
            # Largest sources first: the stage's compute grows, and once it alone reaches the
            # best value found no smaller source can do better.
            mask, time_i, value_i, source_i = masks[i], column[i], limit, -1
            first = bisect.bisect_right(times, time_i * (1 + _TOL)) - 1
            at = first
            while at >= 0 and time_i - times[at] <= value_i:
                j = sources[at]
                at -= 1
                if j >= i or masks[j] & ~mask:
                    continue
                before = previous[j][0] if s else 0.0
                if before > value_i or before == value_i and source_i >= 0:
                    continue
                budget.spend(8)
                value = max(before, costs[s](lattice.pair(j, i)))
                if value < value_i or value == value_i and source_i < 0:
                    value_i, source_i = value, j
            budget.spend(first - at)
            if source_i >= 0:
                values[i] = (value_i, source_i)
        best.append(values)
    return best


def _search(model: Pricing, lattice: _Lattice, costs: list[_StageCost],
            best: list[list[tuple[float, int]]], incumbent: list[int], incumbent_s: float,
            budget: _Budget) -> list[int]:
    """Branch and bound over chains of ideals, from the last stage back; the optimal assignment.

    A stage chosen after the later ones knows where its values go, so its sends are priced
    exactly (one per receiving stage, over the real link); what precedes it is bounded by the
    DP's value. A branch is cut when either reaches the best exact bottleneck found so far.
    Raises _OverBudget past WORK_LIMIT.
    """
    graph = model.graph
    stage_of = [-1] * len(graph)
    state = {"best": incumbent, "best_s": incumbent_s}

    def sends(s: int, sending: tuple[int, ...]) -> float:
        total = 0.0
        for p in sending:
            for t in dict.fromkeys(stage_of[r] for r in graph.succs[p] if stage_of[r] > s):
                total += model.links[s][t].time_s(graph.out_bytes[p])
        return total

    def visit(s: int, i: int, suffix: float) -> None:
        cut = state["best_s"] * (1 - _TOL)
        sources = [0] if s == 0 else lattice.subsets(i, model.column_of[s], cut, budget)
        options = []
        for j in sources:
            before = best[s - 1][j][0] if s else 0.0
            if before >= cut:
                continue
            pair = lattice.pair(j, i)
            relaxed = costs[s](pair)
            if max(suffix, relaxed, before) < cut:
                options.append((max(suffix, relaxed, before), j, relaxed, pair))
        options.sort(key=lambda o: o[:2])
        for _, j, relaxed, pair in options:
            cut = state["best_s"] * (1 - _TOL)
            if max(suffix, relaxed) >= cut:
                continue
            budget.spend(8 + len(pair.sending))
            members = lattice.members(lattice.masks[i] & ~lattice.masks[j])
            for node in members:
                stage_of[node] = s
            cost = relaxed - costs[s].relaxed_send(pair) + sends(s, pair.sending)
            if max(suffix, cost, best[s - 1][j][0] if s else 0.0) < cut:
                if s > 0:
                    visit(s - 1, j, max(suffix, cost))
                else:
                    exact = model.bottleneck_s(stage_of)
                    if exact < state["best_s"]:
                        state["best"], state["best_s"] = list(stage_of), exact
            for node in members:
                stage_of[node] = -1

    visit(model.k - 1, len(lattice.masks) - 1, 0.0)
    return state["best"]
