"""`partition` and `num_stages_for`, the partitioner's entry points, over one device order or
several.

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

from ..cost_model import (CostGraph, DeviceSpec, Held, LinkFn, Pricing, cost_graph,
                          default_link, Memory, format_bytes, forward_peak, lower_bound_s,
                          standalone_held)
from ..errors import PartitionError
from .lattice import _Lattice
from .limits import _Budget, Limits
from .result import (_TOL, Certified, DeviceOrders, Infeasible, Method, Outcome, OverBudget,
                     Partition, Proved, Route, evaluate)
from .search import _exact
from .slicing import _best_slicing, _orders


def partition(graph: CostGraph | fx.GraphModule, devices: Sequence[DeviceSpec],
              link: LinkFn = default_link, *, memory: Memory = Memory(),
              training: bool = False, reorder_devices: bool = False,
              limits: Limits = Limits()) -> Partition:
    """Split `graph` into `len(devices)` non-empty stages, stage `s` running on `devices[s]`.

    Minimises the bottleneck (see the package docstring for the methods and their proofs).
    `memory` says what a stage holds (micro-batches in flight, training state) and whether it
    may recompute its activations to fit (`cost_model.Memory`); `training` adds backward time when `graph` is a GraphModule;
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
                f"{count} device orders are too many to try (at most {limits.device_orders})\n"
                f"{count} distinct orders of {len(devices)} devices; pass reorder_devices=False "
                f"and order them yourself")
        orders = list(_distinct_orders(devices))
    found = [_partition(graph, ds, link, memory, limits) for ds in orders]
    results = [p for p in found if isinstance(p, Partition)]
    if not results:
        proven = all(isinstance(p, Infeasible) for p in found)
        raise _memory_error(graph, devices, link, memory, limits, proven)
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
                   memory: Memory = Memory(), training: bool = False,
                   limits: Limits = Limits()) -> Partition:
    """How many of `devices` to use: "I have these (e.g. `[gpu] * 8`), how many stages pay?"

    Partitions the graph onto the first 1 .. len(devices) devices and returns the partition
    with the fewest stages whose bottleneck is within `tolerance` (relative) of the best: a
    stage beyond that adds a device but no speed. Its `num_stages` is the answer.
    """
    if isinstance(graph, fx.GraphModule):
        graph = cost_graph(graph, training=training, kinds=[d.kind for d in devices])
    if not devices:
        raise PartitionError("no devices\npass at least one")
    limit = min(len(devices), len(graph.compute_nodes))
    found = []
    for k in range(1, limit + 1):
        try:
            found.append(partition(graph, devices[:k], link, memory=memory, limits=limits))
        except PartitionError:
            continue
    if not found:
        raise _memory_error(graph, tuple(devices[:limit]), link, memory, limits, False)
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
        raise PartitionError("no devices\npass at least one device")
    if computing < k:
        shared = ("\nthe nodes that read or write a buffer written in forward count as one: "
                  "they share a stage" if graph.members is not None else "")
        raise PartitionError(
            f"the graph has {computing} computing nodes, too few for {k} stages{shared}\n"
            f"use at most {computing} devices (num_stages_for() picks a useful number)")
    for d in devices:
        if not d.speed > 0:
            raise PartitionError(f"device {d.name!r} has speed {d.speed}; speeds must be > 0")


def _partition(graph: CostGraph, devices: tuple[DeviceSpec, ...], link: LinkFn,
               memory: Memory, limits: Limits) -> Partition | Infeasible | OverBudget:
    """The best partition for one device order; Infeasible when the exact search proved that
    none fits in memory, OverBudget when none found fits but that is not proven."""
    model = Pricing(graph, devices, link, memory)
    bound = lower_bound_s(graph, devices)
    orders = list(_orders(graph))
    candidates: list[tuple[float, Sequence[int], str]] = []
    for name, order in orders:
        sliced = _best_slicing(model, order, bound)
        if sliced is not None and model.bottleneck_s(sliced) < math.inf:
            candidates.append((model.bottleneck_s(sliced), sliced, f"slicing the {name} order"))

    def exact(lattice: _Lattice, floor: float) -> Outcome:
        incumbent_s, incumbent, _ = min(candidates, key=lambda c: c[0],
                                        default=(math.inf, None, ""))
        return _exact(model, lattice, incumbent, incumbent_s, floor, budget)

    budget = _Budget(limits.work)
    lattice = _Lattice.ideals(graph, model.columns, model.forward_columns, limits.ideals)
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
                sliced = exact(_Lattice.prefixes(graph, order, model.columns,
                                                  model.forward_columns), 0.0)
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
                    lower_bound=bound, memory=memory)


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
                  memory: Memory, limits: Limits, proven: bool) -> PartitionError:
    """An error naming the stages that need more memory than their device has, and the least
    memory per device with which fxpipe finds a partition; `proven` says the exact search
    showed that no partition fits (else only that none was found)."""
    roomiest = max(d.memory_bytes for d in devices)
    fix = _fix(memory)
    for i in graph.compute_nodes:
        received = sum(graph.out_bytes[p] for p in graph.preds[i])
        held = Held(graph.param_bytes[i], graph.out_bytes[i] + received, graph.saved_bytes[i],
                    received, graph.out_bytes[i], graph.new_bytes[i],
                    graph.out_bytes[i] if graph.to_output[i] else 0, forward_peak(graph, [i]))
        if memory.choose(0, roomiest, held) is None:
            need = min(memory.need(0, held), memory.need(0, held, recompute=True)
                       if memory.training and memory.recompute != "never" else math.inf)
            return PartitionError(
                f"node {graph.names[i]!r} alone needs {format_bytes(need)}; no device has more "
                f"than {format_bytes(roomiest)}\nuse devices with more memory, {fix}")
    unbounded = tuple(replace(d, memory_bytes=math.inf) for d in devices)
    plan = _partition(graph, unbounded, link, memory, limits)
    assert isinstance(plan, Partition), "the slicing always finds a partition without memory limits"
    over = [f"stage {s} on {d.name} needs {format_bytes(c.memory_bytes)} but has "
            f"{format_bytes(d.memory_bytes)}"
            for s, (d, c) in enumerate(zip(devices, plan.stages))
            if c.memory_bytes > d.memory_bytes]
    least = least_memory_bytes(graph, len(devices), memory)
    verdict = ("no partition into {} stages fits the devices' memory" if proven else
               "fxpipe found no partition into {} stages that fits the devices' memory\n"
               "the graph is too large for the exact search, so one may exist")
    return PartitionError(
        f"{verdict.format(len(devices))}\nthe fastest partition ignoring memory: "
        f"{'; '.join(over) or 'each stage fits, but no fast one does'}\nwith "
        f"{format_bytes(least)} on each of the {len(devices)} devices a partition fits; add "
        f"devices, use devices with more memory, {fix}")


def _fix(memory: Memory) -> str:
    """What else frees memory, in the words of the options that do it."""
    if not memory.training:
        return "or use smaller micro-batches"
    also = "" if memory.recompute != "never" else "recompute='auto' (recompute activations), "
    held = {memory.held(s) for s in range(len(memory.in_flight))} \
        if isinstance(memory.in_flight, tuple) else {memory.in_flight}
    if len(held) == 1 and max(held) > 1:      # GPipe: every stage holds every micro-batch
        also += "schedule='1f1b' (fewer micro-batches in flight), "
    return f"{also}more micro-batches (chunks=), or an optimizer with less state"


def least_memory_bytes(graph: CostGraph, num_stages: int, memory: Memory) -> float:
    """The least memory per device with which slicing the graph's topological order into at
    most `num_stages` stages fits them all (within 1%), by bisection on the capacity: an upper
    bound of the least any partition needs, and what a partition fxpipe finds needs."""
    low = 0.0
    high = max(1.0, float(memory.need(0, standalone_held(graph, graph.compute_nodes))))
    while _slices_within(graph, num_stages, memory, high) is None:
        high *= 2
    while high - low > 0.01 * high:
        middle = (low + high) / 2
        low, high = (low, middle) if _slices_within(graph, num_stages, memory, middle) \
            is not None else (middle, high)
    # The greedy cut leaves out what stages hold across micro-batches (waiting between
    # stages): what its stages need with it.
    stage_of = _slices_within(graph, num_stages, memory, high)
    if stage_of is None:
        return high
    used = max(stage_of) + 1
    exact = Pricing(graph, [DeviceSpec("cpu", memory_bytes=high)] * used,
                    memory=memory).stage_costs(stage_of)
    return max(high, *(c.memory_bytes for c in exact))


def _slices_within(graph: CostGraph, num_stages: int, memory: Memory, capacity: float
                   ) -> list[int] | None:
    """The stage of every node (-1 for inputs) when cutting the topological order greedily,
    each stage as long as it fits `capacity`, needs at most `num_stages` stages; else None.
    A stage grows by the relaxed memory rule, its sums grown node by node (what it received,
    what it sends: a member read by a node not in it yet, or returned), then gives back its
    last nodes until it fits by the exact one (`standalone_held`; found by bisection)."""
    order = graph.compute_nodes
    stage_of = [-1] * len(graph)
    start = s = 0
    while start < len(order):
        if s >= num_stages:
            return None
        end = _grown_within(graph, order, start, memory, s, capacity)

        def fits(stop: int) -> bool:
            return memory.choose(s, capacity,
                                 standalone_held(graph, order[start:stop])) is not None
        if end > start and not fits(end):
            low, high = start, end           # fits(low) or low == start; not fits(high)
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (middle, high) if fits(middle) else (low, middle)
            end = low
        if end == start:
            return None
        for i in order[start:end]:
            stage_of[i] = s
        start, s = end, s + 1
    return stage_of


def _grown_within(graph: CostGraph, order: Sequence[int], start: int, memory: Memory, s: int,
                  capacity: float) -> int:
    """Where a stage starting at `order[start]` ends growing by the relaxed memory rule: the
    first position it does not fit at (`start`: not even its first node fits)."""
    members: set[int] = set()
    received: set[int] = set()
    outside: dict[int, int] = {}        # member -> its readers not in the stage yet
    sums = (0, 0, 0, 0, 0, 0, 0, 0)     # params, produced, saved, received, sent, their new
                                        # memory, returned, sent and kept

    def grown(i: int) -> tuple[int, ...]:
        params, produced, saved, inbound, sent, sent_new, returned, kept = sums
        for p in graph.preds[i]:
            if p in members:
                if outside[p] == 1:
                    if graph.output_kept[p]:
                        kept -= graph.out_bytes[p]
                    if not graph.to_output[p]:
                        sent -= graph.out_bytes[p]
                        sent_new -= graph.new_bytes[p]
            elif p not in received:
                inbound += graph.out_bytes[p]
        if graph.succs[i] or graph.to_output[i]:
            sent += graph.out_bytes[i]
            sent_new += graph.new_bytes[i]
        if graph.to_output[i]:
            returned += graph.out_bytes[i]
        if graph.succs[i] and graph.output_kept[i]:
            kept += graph.out_bytes[i]
        return (params + graph.param_bytes[i], produced + graph.out_bytes[i],
                saved + graph.saved_bytes[i], inbound, sent, sent_new, returned, kept)

    for at in range(start, len(order)):
        i = order[at]
        held = grown(i)
        params, produced, saved, inbound, sent, sent_new, returned, kept = held
        if memory.choose(s, capacity, Held(params, produced + inbound, saved, inbound, sent,
                                           sent_new, returned, moved_bytes=kept)) is None:
            return at
        for p in graph.preds[i]:
            if p in members:
                outside[p] -= 1
            else:
                received.add(p)
        members.add(i)
        outside[i] = len(graph.succs[i])
        sums = held
    return len(order)
