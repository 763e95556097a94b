"""`CostGraph`, the partitioner's whole input, and `cost_graph`, the one reader of a
GraphModule's `node.meta["cost"]`: nodes that must share a stage contracted into one."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch.fx as fx

from ..errors import CostError
from ..state import state_units
from .values import DeviceSpec, KindTimes


@dataclass(frozen=True)
class CostGraph:
    """A costed DAG in topological order, the partitioner's whole input.

    Node `i` is either a graph input (`is_input[i]`: fed by the driver, placed in no stage) or a
    computing node. `preds[i]` are the nodes whose values node `i` reads; `to_output[i]` says its
    value is part of the graph's output (sent to the driver). `members[i]`, when given, names the
    graph nodes that node `i` stands for (`cost_graph` contracts nodes that must share a stage
    into one); by default node `i` is the graph node `names[i]`.

    `saved_bytes[i]` is what autograd keeps of node `i`'s forward for its backward (training);
    `output_kept[i]` says that counts node `i`'s own output (some node keeps it), and
    `recomputable[i]` that node `i` may be recomputed alone (one graph node, no side effects:
    `choose_recomputed`). Both are False throughout when not given.
    `new_bytes[i]` is the memory node `i`'s output takes that its inputs did not have (its
    `out_bytes` when not given; 0 for a view), and `views[i]` the nodes whose memory that output
    shares, which therefore live as long as it does (`forward_peak`).
    `time_s` is the reference time of every node (forward, plus backward when training); `kinds`
    maps a device kind (`DeviceSpec.kind`) to its own forward and backward columns, and the key
    None to the reference's split. A device's time for node `i` (`device_times`) is its kind's
    forward plus backward time, or the reference time when its kind has no column, over its speed.
    """

    names: tuple[str, ...]
    time_s: tuple[float, ...]
    out_bytes: tuple[int, ...]
    param_bytes: tuple[int, ...]
    preds: tuple[tuple[int, ...], ...]
    is_input: tuple[bool, ...]
    to_output: tuple[bool, ...]
    members: tuple[tuple[str, ...], ...] | None = None
    kinds: Mapping[str | None, KindTimes] = field(default_factory=dict, hash=False)
    saved_bytes: tuple[int, ...] | None = None   # kept for the backward; None: not measured
    output_kept: tuple[bool, ...] | None = None
    recomputable: tuple[bool, ...] | None = None
    new_bytes: tuple[int, ...] | None = None      # None: every output is new memory
    views: tuple[tuple[int, ...], ...] | None = None
    succs: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _device_times: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        n = len(self.names)
        if self.saved_bytes is None:
            object.__setattr__(self, "saved_bytes", (0,) * n)
        for name in ("output_kept", "recomputable"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, (False,) * n)
        if self.new_bytes is None:
            object.__setattr__(self, "new_bytes", tuple(self.out_bytes))
        if self.views is None:
            object.__setattr__(self, "views", ((),) * n)
        for column in (self.time_s, self.out_bytes, self.param_bytes, self.preds, self.is_input,
                       self.to_output, self.members or self.names, self.saved_bytes,
                       self.output_kept, self.recomputable, self.new_bytes, self.views,
                       *(c for t in self.kinds.values() for c in (t.fwd_s, t.bwd_s))):
            assert len(column) == n, "every CostGraph column needs one entry per node"
        succs: list[list[int]] = [[] for _ in range(n)]
        for i, ps in enumerate(self.preds):
            for p in ps:
                assert p < i, f"CostGraph must be in topological order: {p} -> {i}"
                succs[p].append(i)
            assert set(self.views[i]) <= set(ps), f"node {i} views a value it does not read"
        object.__setattr__(self, "succs", tuple(tuple(dict.fromkeys(s)) for s in succs))
        object.__setattr__(self, "_device_times", {})

    def __len__(self) -> int:
        return len(self.names)

    def node_names(self, i: int) -> tuple[str, ...]:
        """The graph nodes that node `i` stands for."""
        return self.members[i] if self.members is not None else (self.names[i],)

    @property
    def compute_nodes(self) -> list[int]:
        return [i for i in range(len(self)) if not self.is_input[i]]

    def kind_times(self, kind: str | None) -> KindTimes:
        """The forward and backward columns of a device kind, the reference's when it has none."""
        found = self.kinds.get(kind) or self.kinds.get(None)
        return found or KindTimes(self.time_s, (0.0,) * len(self))

    def device_columns(self, device: DeviceSpec) -> KindTimes:
        """Node `i`'s forward and backward time on `device`: its kind's, over its speed. A kind
        without a column takes the reference's split (which adds up to `time_s`)."""
        key = (device.kind, device.speed)
        if key not in self._device_times:
            t = self.kind_times(device.kind)
            self._device_times[key] = KindTimes(tuple(x / device.speed for x in t.fwd_s),
                                                tuple(x / device.speed for x in t.bwd_s))
        return self._device_times[key]

    def device_times(self, device: DeviceSpec) -> tuple[float, ...]:
        """Node `i`'s time on `device`: its forward plus backward time (`device_columns`)."""
        key = ("total", device.kind, device.speed)
        if key not in self._device_times:
            t = self.device_columns(device)
            self._device_times[key] = tuple(f + b for f, b in zip(t.fwd_s, t.bwd_s))
        return self._device_times[key]


def cost_graph(gm: fx.GraphModule, *, training: bool = False,
               kinds: Sequence[str] = ()) -> CostGraph:
    """Read `node.meta["cost"]` of every node into a CostGraph (`training` adds backward time).

    For every device kind in `kinds` the CostGraph also carries that kind's forward and backward
    columns, from `node.meta["costs"][kind]` (the reference cost where the kind was not measured).

    Parameter reads (`get_attr`) are left out: codegen copies one into every stage that reads it,
    and `annotate_costs` counts its bytes at its first reader. The nodes that read or write a
    parameter or buffer written in forward, with every node on a path between them
    (`fxpipe.passes.state.state_units`), become one node of the CostGraph, so they share a stage and
    the stage applies the writes in micro-batch order; its `members` name them.
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("output", "get_attr")]
    index = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: i for i, n in enumerate(nodes)}
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    outputs = set(output.all_input_nodes)
    for n in nodes:
        if n.meta.get("cost") is None:
            raise CostError(
                f"node {n.name!r} ({n.format_node()}) has no cost\nrun "
                f"fxpipe.passes.annotate_costs on the graph first, or set "
                f"node.meta['cost'] = NodeCost(...) by hand")
    preds = [list(dict.fromkeys(index[p] for p in n.all_input_nodes if p in index)) for n in nodes]
    units = _units(preds, state_units(nodes, preds))
    unit_of = {i: u for u, members in enumerate(units) for i in members}
    costs = [[nodes[i].meta["cost"] for i in members] for members in units]

    def columns(kind: str | None) -> KindTimes:
        per_unit = [[nodes[i].meta.get("costs", {}).get(kind) or nodes[i].meta["cost"]
                     for i in members] for members in units]
        return KindTimes(tuple(sum(c.fwd_s for c in cs) for cs in per_unit),
                         tuple(sum(c.bwd_s for c in cs) if training else 0.0 for cs in per_unit))

    return CostGraph(
        names=tuple(nodes[members[0]].name for members in units),
        time_s=tuple(sum(c.fwd_s + (c.bwd_s if training else 0.0) for c in cs) for cs in costs),
        out_bytes=tuple(_sent_bytes(nodes, members, outputs) for members in units),
        param_bytes=tuple(sum(c.param_bytes for c in cs) for cs in costs),
        saved_bytes=tuple(sum(c.saved_bytes for c in cs) if training else 0 for cs in costs),
        output_kept=tuple(len(members) == 1 and nodes[members[0]].meta.get("output_kept", False)
                          for members in units),
        recomputable=tuple(len(members) == 1 and not nodes[members[0]].is_impure()
                           for members in units),
        new_bytes=tuple(sum(c.out_bytes if c.new_bytes is None else c.new_bytes for c in cs)
                        for cs in costs),
        views=tuple(tuple(dict.fromkeys(
            unit_of[by_name[v]] for i in members for v in nodes[i].meta["cost"].views
            if v in by_name and unit_of[by_name[v]] != u)) for u, members in enumerate(units)),
        preds=tuple(tuple(dict.fromkeys(unit_of[p] for i in members for p in preds[i]
                                        if unit_of[p] != u)) for u, members in enumerate(units)),
        is_input=tuple(nodes[members[0]].op == "placeholder" for members in units),
        to_output=tuple(any(nodes[i] in outputs for i in members) for members in units),
        members=(tuple(tuple(nodes[i].name for i in members) for members in units)
                 if any(len(members) > 1 for members in units) else None),
        kinds={kind: columns(kind) for kind in (None, *dict.fromkeys(kinds))},
    )


def _units(preds: Sequence[Sequence[int]], groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """The nodes `0..n-1` with each group contracted into one unit, the units in a topological
    order of the contracted graph (acyclic: see `state_units`), each unit where its first node
    was as far as its inputs allow."""
    if not groups:
        return [[i] for i in range(len(preds))]
    unit_of = list(range(len(preds)))
    units: dict[int, list[int]] = {i: [i] for i in range(len(preds))}
    for members in groups:
        for i in members:
            del units[i]
            unit_of[i] = members[0]
        units[members[0]] = list(members)
    waiting = {u: len({unit_of[p] for i in members for p in preds[i]} - {u})
               for u, members in units.items()}
    readers: dict[int, set[int]] = {u: set() for u in units}
    for u, members in units.items():
        for p in {unit_of[p] for i in members for p in preds[i]} - {u}:
            readers[p].add(u)
    ready = [u for u, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        u = heapq.heappop(ready)
        order.append(units[u])
        for r in readers[u]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    assert len(order) == len(units), "contracting the state's nodes made a cycle"
    return order


def _sent_bytes(nodes: Sequence[fx.Node], members: Sequence[int], outputs: set[fx.Node]) -> int:
    """The bytes a unit sends: the outputs of its nodes that nodes outside it or the graph's
    output read."""
    inside = {nodes[i] for i in members}
    if len(members) == 1:
        return nodes[members[0]].meta["cost"].out_bytes
    return sum(nodes[i].meta["cost"].out_bytes for i in members
               if nodes[i] in outputs or any(u not in inside and u.op != "output"
                                             for u in nodes[i].users))
