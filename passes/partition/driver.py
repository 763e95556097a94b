"""The driver: `partition` and `num_stages_for`, over one device order or several.

For each device order, `_partition` slices the topological orders (`slicing.py`), settles the
ideal lattice with the exact search (`search.py`), solves each order's slicing exactly when
nothing proved optimality, and keeps the candidate with the least exact bottleneck. The
outcomes say what is proven; `_proof` words them for the partition's `Method`. When nothing
found fits memory, `_memory_error` names the stages that need more than their device has.
"""

from __future__ import annotations

import collections
import math
from dataclasses import replace
from typing import Iterator, Sequence

import torch.fx as fx

from ..cost_model import (CostGraph, DeviceSpec, LinkFn, Pricing, cost_graph, default_link,
                          format_bytes, lower_bound_s, stage_memory_bytes)
from ..errors import PartitionError
from .lattice import _Lattice
from .limits import _Budget, Limits
from .result import (_TOL, Certified, DeviceOrders, Infeasible, Method, Outcome, OverBudget,
                     Partition, Proved, Route, evaluate)
from .search import _exact
from .slicing import _best_slicing, _orders


def partition(graph: CostGraph | fx.GraphModule, devices: Sequence[DeviceSpec],
              link: LinkFn = default_link, *, activation_factor: float = 1.0,
              training: bool = False, reorder_devices: bool = False,
              limits: Limits = Limits()) -> Partition:
    """Split `graph` into `len(devices)` non-empty stages, stage `s` running on `devices[s]`.

    Minimises the bottleneck (see the package docstring for the methods and their proofs).
    `activation_factor` multiplies activation memory (e.g. the number of micro-batches in flight
    when training); `training` adds backward time when `graph` is a GraphModule;
    `reorder_devices` also tries every distinct order of the devices (at most
    `limits.device_orders`), and the result's `devices` says which was kept; `limits` bounds
    the exact methods' work.

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
        if count > limits.device_orders:
            raise PartitionError(
                f"{count} distinct orders of {len(devices)} devices are too many to try (at "
                f"most {limits.device_orders}): pass reorder_devices=False and order them "
                f"yourself")
        orders = list(_distinct_orders(devices))
    found = [_partition(graph, ds, link, activation_factor, limits) for ds in orders]
    results = [p for p in found if isinstance(p, Partition)]
    if not results:
        proven = all(isinstance(p, Infeasible) for p in found)
        raise _memory_error(graph, devices, link, activation_factor, limits, proven)
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
        solved = DeviceOrders(tried=len(orders), solved=sum(p.optimal for p in results))
        best = replace(best, lower_bound_s=min(bound, best.bottleneck_s), optimal=optimal,
                       method=replace(best.method, orders=solved))
    return best


def num_stages_for(graph: CostGraph | fx.GraphModule, devices: Sequence[DeviceSpec],
                   link: LinkFn = default_link, *, tolerance: float = 0.02,
                   activation_factor: float = 1.0, training: bool = False,
                   limits: Limits = Limits()) -> Partition:
    """How many of `devices` to use: "I have these (e.g. `[gpu] * 8`), how many stages pay?"

    Partitions the graph onto the first 1 .. len(devices) devices and returns the partition
    with the fewest stages whose bottleneck is within `tolerance` (relative) of the best: a
    stage beyond that adds a device but no speed. Its `num_stages` is the answer.
    """
    if isinstance(graph, fx.GraphModule):
        graph = cost_graph(graph, training=training, kinds=[d.kind for d in devices])
    if not devices:
        raise PartitionError("no devices: pass at least one")
    limit = min(len(devices), len(graph.compute_nodes))
    found = []
    for k in range(1, limit + 1):
        try:
            found.append(partition(graph, devices[:k], link, activation_factor=activation_factor,
                                   limits=limits))
        except PartitionError:
            continue
    if not found:
        raise _memory_error(graph, tuple(devices[:limit]), link, activation_factor, limits,
                            False)
    best_s = min(p.bottleneck_s for p in found)
    return next(p for p in found if p.bottleneck_s <= best_s * (1 + tolerance))


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
               activation_factor: float, limits: Limits) -> Partition | Infeasible | OverBudget:
    """The best partition for one device order; Infeasible when the exact search proved that
    none fits in memory, OverBudget when none found fits but that is not proven."""
    model = Pricing(graph, devices, link, activation_factor)
    bound = lower_bound_s(graph, devices)
    orders = list(_orders(graph))
    candidates: list[tuple[float, Sequence[int], str]] = []
    for name, order in orders:
        sliced = _best_slicing(model, order, bound)
        if sliced is not None:
            candidates.append((model.bottleneck_s(sliced), sliced, f"slicing the {name} order"))

    def exact(lattice: _Lattice, floor: float) -> Outcome:
        incumbent_s, incumbent, _ = min(candidates, key=lambda c: c[0],
                                        default=(math.inf, None, ""))
        return _exact(model, lattice, incumbent, incumbent_s, floor, budget)

    budget = _Budget(limits.work)
    lattice = _Lattice.ideals(graph, model.columns, limits.ideals)
    found = OverBudget() if lattice is None else exact(lattice, bound)
    if isinstance(found, Infeasible):
        return found
    if isinstance(found, OverBudget):
        why = "too many ideals" if lattice is None else "over its work limit"
        proof = f"bound: compute over speed (exact DP skipped: {why})"
    else:
        bound = max(bound, found.lower_bound_s)
        proof = _proof(found, len(lattice.masks))
        candidates.append((model.bottleneck_s(found.stage_of), found.stage_of, "the ideal DP"))
    proven = isinstance(found, Proved)
    if not proven:
        for name, order in orders:
            if len(order) <= limits.prefix_nodes:
                sliced = exact(_Lattice.prefixes(graph, order, model.columns), 0.0)
                if isinstance(sliced, (Proved, Certified)):
                    candidates.append((model.bottleneck_s(sliced.stage_of), sliced.stage_of,
                                       f"exact slicing of the {name} order"))
    if not candidates:
        return OverBudget()
    bottleneck, stage_of, how = min(candidates, key=lambda c: c[0])
    if proven:
        bound = max(bound, bottleneck)   # exhaustive: the bottleneck itself is the optimum
    optimal = proven or bottleneck <= bound * (1 + _TOL)
    return evaluate(graph, stage_of, devices, link, optimal=optimal,
                    method=Method(found_by=how, proof=proof, optimal=optimal),
                    lower_bound=bound, activation_factor=activation_factor)


def _proof(found: Proved | Certified, num_ideals: int) -> str:
    """Where the bound of what the exact search on the ideals established comes from."""
    ideals = f"DP over {num_ideals} ideals (Tarnawski et al. 2020)"
    if found.route is Route.DP:
        return ideals
    if found.route is Route.PROBES:
        return f"bound: {ideals} limited to narrow bands"
    finished = "on exact transfers" if isinstance(found, Proved) else "over its work limit"
    return f"{ideals}, then branch and bound {finished}"


def _memory_error(graph: CostGraph, devices: Sequence[DeviceSpec], link: LinkFn,
                  activation_factor: float, limits: Limits, proven: bool) -> PartitionError:
    """An error naming the stages that need more memory than their device has; `proven` says
    the exact search showed that no partition fits (else only that none was found)."""
    roomiest = max(d.memory_bytes for d in devices)
    for i in graph.compute_nodes:
        need = stage_memory_bytes(graph.param_bytes[i], graph.out_bytes[i], activation_factor)
        if need > roomiest:
            return PartitionError(
                f"node {graph.names[i]!r} alone needs {format_bytes(need)}, more than any device "
                f"has (at most {format_bytes(roomiest)}): use devices with more memory or a "
                f"smaller micro-batch")
    unbounded = tuple(replace(d, memory_bytes=math.inf) for d in devices)
    plan = _partition(graph, unbounded, link, activation_factor, limits)
    assert isinstance(plan, Partition), "the slicing always finds a partition without memory limits"
    over = [f"stage {s} on {d.name} needs {format_bytes(c.memory_bytes)} but has "
            f"{format_bytes(d.memory_bytes)}"
            for s, (d, c) in enumerate(zip(devices, plan.stages))
            if c.memory_bytes > d.memory_bytes]
    need = sum(c.memory_bytes for c in plan.stages)
    have = sum(d.memory_bytes for d in devices)
    verdict = ("no partition into {} stages fits the devices' memory" if proven else
               "fxpipe found no partition into {} stages that fits the devices' memory (the "
               "graph is too large for the exact search, so one may exist)")
    return PartitionError(
        f"{verdict.format(len(devices))}. The fastest "
        f"partition ignoring memory needs {format_bytes(need)} in all ({format_bytes(have)} "
        f"available): {'; '.join(over) or 'each stage fits, but no fast one does'}. Add devices, "
        f"use devices with more memory, or use smaller micro-batches")
