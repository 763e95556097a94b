"""Parameters and buffers written in forward: explicit updates, kept in one stage.

A model may write its own state while it runs: a counter `self.calls.add_(1)`, a running mean
`self.mean.mul_(0.9).add_(0.1 * x.mean(0))`, export's `copy_` of BatchNorm's new statistics. A
pipeline keeps such a write as the in-place update it is and applies it once per micro-batch, in
micro-batch order, as the model called once per micro-batch would. Two things make that hold:

- every read of the state after a write reads it through the write (`order_state_reads`), a
  graph edge rather than an accident of node order, and every node that reads or writes it is
  marked `node.meta["state"]` (the written targets);
- the partitioner keeps the marked nodes of one state, and every node on a path between them,
  in one stage (`state_units`): a stage runs micro-batches one after another, each in graph order.

`unchanged_state` lets a pass run the graph on examples and leave the state as it found it.

Example (a BatchNorm run in training leaves its statistics as they were):

>>> import torch
>>> from fxpipe.passes.state import unchanged_state
>>> norm = torch.nn.BatchNorm1d(4).train()
>>> with unchanged_state(norm):
...     _ = norm(torch.randn(8, 4))
>>> norm.running_mean, norm.num_batches_tracked
(tensor([0., 0., 0., 0.]), tensor(0))
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn


@contextlib.contextmanager
def unchanged_state(module: nn.Module) -> Iterator[None]:
    """Inside, run `module` freely: after, its parameters and buffers are the same tensors as
    before (an attribute reassigned in forward is put back) and the buffers hold their values.
    Every buffer's value is written back through `.data`, unread: comparing it first would make
    the host wait for a GPU, and a write through `.data` leaves the buffer's version as it is
    (a plain write bumps it, and autograd would refuse a backward through a node that saved the
    buffer before: BatchNorm's running statistics, kept by a node that was not recomputed)."""
    saved = [(owner, name, b, b.detach().clone()) for owner in module.modules()
             for name, b in owner._buffers.items() if b is not None]
    params = [(owner, name, p) for owner in module.modules()
              for name, p in owner._parameters.items()]
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, buffer, value in saved:
                owner._buffers[name] = buffer
                buffer.data.copy_(value)
        for owner, name, p in params:
            owner._parameters[name] = p


def read_after(value: torch.Tensor, *writes: object) -> torch.Tensor:
    """`value`, read once `writes` (in-place writes on memory it shares) have run: the edge."""
    return value


def order_state_reads(gm: fx.GraphModule, writes: Sequence[tuple[fx.Node, fx.Node, list[fx.Node]]],
                      same_value: Callable[[fx.Node, fx.Node], bool]) -> None:
    """Point every read of written state that follows a write at the write, and mark the nodes
    that read or write that state with `node.meta["state"]`.

    `writes` are `(write, written, aliases)` in graph order: an in-place op, the node whose value
    it writes, and the nodes sharing that memory (a `get_attr` among them). A later reader of an
    alias with the written value itself (`same_value`) reads the write's result; a reader of
    another view of that memory reads it through `read_after(view, write)`.
    """
    graph = gm.graph
    position: dict[fx.Node, float] = {n: i for i, n in enumerate(graph.nodes)}
    current: dict[fx.Node, fx.Node] = {}       # an alias -> the node that now stands for it
    touched: dict[fx.Node, set[str]] = {}
    for write, written, aliases in writes:
        targets = {a.target for a in aliases if a.op == "get_attr"}
        for alias in aliases:
            if position[alias] >= position[write]:
                continue
            stand = current.get(alias, alias)
            later = [u for u in stand.users if position.get(u, -1) > position[write]]
            if not later:
                continue
            if alias is written or same_value(alias, written):
                new = write
            else:
                with graph.inserting_after(write):
                    new = graph.call_function(read_after, (stand, write))
                position[new] = position[write] + 0.5
            for user in later:
                user.replace_input_with(stand, new)
            current[alias] = new
        for alias in [*aliases, *(current[a] for a in aliases if a in current)]:
            for n in [alias, *alias.users]:
                if n.op not in ("get_attr", "output", "placeholder"):
                    touched.setdefault(n, set()).update(targets)
    for n, targets in touched.items():
        n.meta["state"] = tuple(sorted(set(n.meta.get("state", ())) | targets))


def state_units(nodes: Sequence[fx.Node], preds: Sequence[Iterable[int]]) -> list[list[int]]:
    """The sets of nodes (indices into `nodes`, a topological order) that must share a stage.

    Nodes marked with a common written target (`node.meta["state"]`) belong together, with every
    node on a path between two of them (the convex hull). Sets that overlap, or that depend on
    each other both ways, are merged, so that contracting each set into one node leaves the graph
    acyclic. Each returned set is sorted; the sets are in the order of their first nodes.

    Each round takes every set's hull, merges the sets that overlap, then merges the sets on a
    common cycle of the contracted graph (its strongly connected components), until a round
    merges none: a few rounds of linear passes per set (a BatchNorm network in training marks
    hundreds of nodes, three targets each).
    """
    groups: dict[str, set[int]] = {}
    for i, n in enumerate(nodes):
        for target in n.meta.get("state", ()):
            groups.setdefault(target, set()).add(i)
    succs: list[list[int]] = [[] for _ in nodes]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    units = _disjoint(groups.values())
    while True:
        units = _disjoint([u | (_reach(u, succs) & _reach(u, preds)) for u in units])  # hulls
        merged = _on_cycles(units, preds)
        if len(merged) == len(units):
            return sorted((sorted(u) for u in units), key=lambda u: u[0])
        units = merged


def _disjoint(sets: Iterable[set[int]]) -> list[set[int]]:
    """`sets` with every two that share a member merged (transitively)."""
    owner: dict[int, int] = {}          # member -> index of the set that holds it
    merged: list[set[int] | None] = []
    for members in sets:
        into = {owner[i] for i in members if i in owner}
        found = set(members).union(*(merged[k] for k in into))
        for k in into:
            merged[k] = None
        for i in found:
            owner[i] = len(merged)
        merged.append(found)
    return [m for m in merged if m is not None]


def _on_cycles(units: list[set[int]], preds: Sequence[Iterable[int]]) -> list[set[int]]:
    """`units` (disjoint) with those on a common cycle of the graph, each unit contracted into
    one node, put together with the nodes of that cycle: still disjoint."""
    if not units:        # a graph without state: nothing to put together (nor to import)
        return []
    import networkx as nx    # here: 0.2 s of a fresh import, needed by graphs with state alone

    unit_of = {i: k for k, u in enumerate(units) for i in u}
    contracted = nx.DiGraph()
    contracted.add_nodes_from(("unit", k) for k in range(len(units)))
    for i, ps in enumerate(preds):
        for p in ps:
            a = ("unit", unit_of[p]) if p in unit_of else p
            b = ("unit", unit_of[i]) if i in unit_of else i
            if a != b:
                contracted.add_edge(a, b)
    found = []
    for component in nx.strongly_connected_components(contracted):
        joined = [units[v[1]] for v in component if isinstance(v, tuple)]
        if len(joined) > 1:         # units on a cycle, with the nodes between them
            found.append(set().union(*joined, (v for v in component if isinstance(v, int))))
        elif joined:
            found.append(joined[0])
    return found


def _reach(start: set[int], edges: Sequence[Iterable[int]]) -> set[int]:
    seen: set[int] = set()
    todo = list(start)
    while todo:
        for j in edges[todo.pop()]:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    return seen


class StateWatch:
    """Which buffers each node of a running graph touches, and which of them it writes.

    Watches what no graph edge shows: a module writing its own buffers (BatchNorm's statistics
    in train mode), the same module called from several nodes. After a run, `mark` writes the
    buffers written in forward into `node.meta["state"]` of every node that touched them.
    """

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.by_storage: dict[int, tuple[str, torch.Tensor]] = {}
        for name, b in gm.named_buffers():
            if storage_of(b) is not None:
                self.by_storage.setdefault(storage_of(b), (name, b))
        self.touched: dict[fx.Node, set[str]] = {}
        self.written: set[str] = set()

    @contextlib.contextmanager
    def watching(self, node: fx.Node, inputs: Iterable[object]) -> Iterator[None]:
        """Around running `node` on `inputs` (the values it reads)."""
        held = [*(self.gm.get_submodule(node.target).buffers() if node.op == "call_module"
                  else ()), *(t for t in inputs if isinstance(t, torch.Tensor))]
        found = dict(self.by_storage[s] for s in map(storage_of, held) if s in self.by_storage)
        before = {name: (b._version, b.detach().clone()) for name, b in found.items()}
        yield
        self.touched[node] = set(found)
        self.written.update(name for name, (version, value) in before.items()
                            if found[name]._version != version
                            or not torch.equal(found[name], value))

    def mark(self) -> None:
        for node, names in self.touched.items():
            if names & self.written:
                node.meta["state"] = tuple(sorted({*node.meta.get("state", ()),
                                                   *(names & self.written)}))


def storage_of(value: object) -> int | None:
    """Where a dense tensor's memory starts (None for anything else)."""
    if isinstance(value, torch.Tensor) and value.layout == torch.strided:
        return value.untyped_storage().data_ptr() or None
    return None
