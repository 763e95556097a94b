"""Method 2: dynamic programming over ideals (Tarnawski et al., "Efficient Algorithms for Device
Placement of DNN Graph Operators", NeurIPS 2020).

A valid partition is a chain of ideals (downward-closed node sets) {} = I_0 < I_1 < ... < I_k = V;
stage `s` is I_{s+1} - I_s. `_dp` over pairs of ideals minimises the largest *relaxed* stage time
(`cost_model.Pricing`, whose `relaxed_stage_s` `_StageCost` is tested against), where a stage's
transfers are priced from the pair alone: a received value over the cheapest link from an earlier
stage, a sent value once over the cheapest link to a later stage. Relaxed times never exceed exact
ones, so the DP's value bounds every partition from below, and it is exact when each value is
received by at most one later stage over uniform links (typical DNNs).

Only pairs whose compute fits under the best bottleneck known are tried, only ideals in the
compute bands where stage boundaries can fall take part, and sources are scanned from the
largest down, stopping once compute alone reaches the best value: O(n N) to list N ideals
(`Limits.ideals`; once per graph shape, which a graph costed for other micro-batches, threads or
devices keeps, so "auto" lists a graph's ideals once for all its configurations), then O(k P) for the P pairs tried (<= k N^2 / 2, about k N w in practice for a
band of w ideals). A sequential graph has n + 1 ideals; chains with parallel branches have few
more. Listing ideals grows as n times the graph's width; the DP as k times the pairs in the bands.

`_Lattice.prefixes` gives the same DP the n + 1 prefixes of one topological order instead, whose
chains are the contiguous slicings of that order (exact slicing, `search.py`).
"""

from __future__ import annotations

import bisect
import collections
import math
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

from ..cost_model import CostGraph, Held, Pricing
from .limits import _Budget
from .result import _TOL


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
    forward_columns: list[tuple[float, ...]]   # the forward part of each column
    masks: list[int] = field(default_factory=lambda: [0])
    time_s: list[list[float]] = field(default_factory=list)   # per column, per ideal
    forward_s: list[list[float]] = field(default_factory=list)   # per column, per ideal
    param_bytes: list[int] = field(default_factory=lambda: [0])
    saved_bytes: list[int] = field(default_factory=lambda: [0])
    out_bytes: list[int] = field(default_factory=lambda: [0])
    frontier: list[int] = field(default_factory=lambda: [0])   # members read outside, a mask
    output_mask: int = 0                                       # the graph's outputs
    _pairs: dict[tuple[int, int], _Pair] = field(default_factory=dict)
    _open: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    _sorted: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)

    @staticmethod
    def _empty(graph: CostGraph, nodes: list[int], columns: list[tuple[float, ...]],
               forward_columns: list[tuple[float, ...]]) -> _Lattice:
        bit = {i: b for b, i in enumerate(nodes)}
        return _Lattice(graph, nodes, [sum(1 << bit[j] for j in graph.succs[i])
                                       for i in range(len(graph))],
                        [tuple(bit[p] for p in graph.preds[i] if p in bit) for i in nodes],
                        [i for i in range(len(graph)) if graph.is_input[i]], columns,
                        forward_columns, time_s=[[0.0] for _ in columns],
                        forward_s=[[0.0] for _ in columns],
                        output_mask=sum(1 << b for b, i in enumerate(nodes)
                                        if graph.to_output[i]))

    @staticmethod
    def ideals(graph: CostGraph, columns: list[tuple[float, ...]],
               forward_columns: list[tuple[float, ...]], max_ideals: int) -> _Lattice | None:
        """All ideals, or None past `max_ideals`: their masks listed once per graph shape
        (`_shape_ideals`), their sums here, each ideal its parent's plus one node."""
        nodes = graph.compute_nodes
        shape = _shape_ideals(graph, max_ideals)
        if shape is None:
            return None
        lattice = _Lattice._empty(graph, nodes, columns, forward_columns)
        lattice.masks = list(shape.masks)
        lattice.frontier = list(shape.frontier)
        added = [nodes[b] for b in shape.bit]
        sums = [*lattice.time_s, *lattice.forward_s, lattice.param_bytes, lattice.saved_bytes,
                lattice.out_bytes]
        terms = [*columns, *forward_columns, graph.param_bytes, graph.saved_bytes,
                 graph.out_bytes]
        for total, term in zip(sums, terms):
            append = total.append
            for parent, i in zip(shape.parent, added):
                append(total[parent] + term[i])
        return lattice

    @staticmethod
    def prefixes(graph: CostGraph, order: list[int], columns: list[tuple[float, ...]],
                 forward_columns: list[tuple[float, ...]]) -> _Lattice:
        """The n + 1 prefixes of a topological order of the computing nodes."""
        lattice = _Lattice._empty(graph, order, columns, forward_columns)
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
        for column, times in zip(self.forward_columns, self.forward_s):
            times.append(times[parent] + column[i])
        self.param_bytes.append(self.param_bytes[parent] + graph.param_bytes[i])
        self.saved_bytes.append(self.saved_bytes[parent] + graph.saved_bytes[i])
        self.out_bytes.append(self.out_bytes[parent] + graph.out_bytes[i])
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
            received_bytes = sum(graph.out_bytes[p] for p in received)
            sending = tuple(p for b, p in self._frontier(i) if stage >> b & 1)
            returned = tuple(self.members(stage & self.output_mask))
            returned_bytes = sum(graph.out_bytes[p] for p in returned)
            sent_bytes = returned_bytes + sum(
                graph.out_bytes[p] for p in sending if not graph.to_output[p])
            sent_new = sum(graph.new_bytes[p] for p in returned) + sum(
                graph.new_bytes[p] for p in sending if not graph.to_output[p])
            self._pairs[key] = _Pair(
                tuple(times[i] - times[j] for times in self.time_s), tuple(received), sending,
                returned,
                Held(self.param_bytes[i] - self.param_bytes[j],
                     self.out_bytes[i] - self.out_bytes[j] + received_bytes,
                     self.saved_bytes[i] - self.saved_bytes[j], received_bytes, sent_bytes,
                     sent_new, returned_bytes, moved_bytes=sum(
                         graph.out_bytes[p] for p in sending if graph.output_kept[p])),
                tuple(times[i] - times[j] for times in self.forward_s))
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


@dataclass(frozen=True)
class _Shape:
    """Every ideal of a graph's computing nodes, by size: ideal `k` (k > 0) is ideal
    `parent[k]` plus bit `bit[k]`, and `frontier[k]` masks its members read outside it. It
    depends on the graph's shape alone, which the costings of one graph for other micro-batches,
    threads and devices share."""

    masks: tuple[int, ...]
    parent: tuple[int, ...]      # from ideal 1 on
    bit: tuple[int, ...]         # from ideal 1 on
    frontier: tuple[int, ...]


_SHAPES: collections.OrderedDict[tuple, _Shape | None] = collections.OrderedDict()
_SHAPES_KEPT = 4


def _shape_ideals(graph: CostGraph, max_ideals: int) -> _Shape | None:
    """`graph`'s ideals (`_Shape`), or None past `max_ideals`, listed once per shape: the last
    `_SHAPES_KEPT` shapes are kept. O(N * width) for N ideals."""
    nodes = graph.compute_nodes
    key = (max_ideals, tuple(nodes), tuple(tuple(graph.preds[i]) for i in nodes),
           tuple(tuple(graph.succs[i]) for i in nodes))
    if key in _SHAPES:
        _SHAPES.move_to_end(key)
        return _SHAPES[key]
    shape = _list_ideals(graph, max_ideals)
    _SHAPES[key] = shape
    if len(_SHAPES) > _SHAPES_KEPT:
        _SHAPES.popitem(last=False)
    return shape


def _list_ideals(graph: CostGraph, max_ideals: int) -> _Shape | None:
    """All ideals, grown one node at a time, or None past `max_ideals`."""
    nodes = graph.compute_nodes
    if len(nodes) + 1 > max_ideals:
        return None
    bit = {i: b for b, i in enumerate(nodes)}
    reader_mask = [sum(1 << bit[j] for j in graph.succs[i]) for i in nodes]
    pred_mask = [sum(1 << bit[p] for p in graph.preds[i] if p in bit) for i in nodes]
    pred_bits = [tuple(bit[p] for p in graph.preds[i] if p in bit) for i in nodes]
    masks, parents, bits, frontiers = [0], [], [], [0]
    seen = {0}
    ready = sum(1 << b for b in range(len(nodes)) if pred_mask[b] == 0)
    level = [(0, 0, ready)]                      # (ideal, its index, nodes that may join)
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
                if len(seen) > max_ideals:
                    return None
                b = low.bit_length() - 1
                joining = can_join & ~low
                readers = reader_mask[b]
                while readers:
                    r = readers & -readers
                    readers ^= r
                    if pred_mask[r.bit_length() - 1] & ~bigger == 0:
                        joining |= r
                frontier = frontiers[index]
                if reader_mask[b] & ~bigger:
                    frontier |= low
                for p in pred_bits[b]:     # only what b reads can stop being read outside
                    if frontier >> p & 1 and not reader_mask[p] & ~bigger:
                        frontier &= ~(1 << p)
                masks.append(bigger)
                parents.append(index)
                bits.append(b)
                frontiers.append(frontier)
                grown.append((bigger, len(masks) - 1, joining))
        level = grown
    return _Shape(tuple(masks), tuple(parents), tuple(bits), tuple(frontiers))


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
    returned: tuple[int, ...]      # members sent to the driver (graph outputs)
    held: Held                     # sent: values read after the ideal I or returned, each once
    forward_s: tuple[float, ...]   # per column


class _StageCost:
    """The relaxed time of a candidate stage on stage `s`'s device (inf if it does not fit)."""

    def __init__(self, model: Pricing, s: int):
        self.model, self.s = model, s
        self.column = model.column_of[s]
        self.receive = model.receive_min(s)
        self.send = model.send_min(s)
        self.returned = model.transfer(s, None)
        self.unbounded = model.unbounded[s]    # memory costs it nothing: skip pricing it

    def __call__(self, pair: _Pair) -> float:
        extra = 0.0 if self.unbounded else self.model.recompute_s(
            self.s, pair.held, pair.forward_s[self.column])
        if extra == math.inf:
            return math.inf
        return (pair.time_s[self.column] + extra + sum(self.returned[p] for p in pair.returned) +
                sum(self.receive[p] for p in pair.received) + self.relaxed_send(pair))

    def relaxed_send(self, pair: _Pair) -> float:
        return sum(self.send[p] for p in pair.sending)


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
