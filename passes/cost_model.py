"""The cost model: what a stage costs, as pure functions of plain data.

The partitioner minimises these numbers and the schedule simulator predicts with them, so the plan
and the prediction always agree. Nothing here touches a GraphModule except `cost_graph`, which
reads `node.meta["cost"]` (and `node.meta["costs"][kind]` per device kind) once and returns a
`CostGraph`, plain tuples a test can also build by hand.

Units are in the names: seconds (`_s`), bytes (`_bytes`), bytes per second (`bytes_per_s`).
"""

from __future__ import annotations

import collections
import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Collection, Literal, Mapping, NamedTuple, Sequence

import torch.fx as fx

from .device import is_cpu
from .errors import CostError
from .state import state_units


CostSource = Literal["measured", "reused", "estimated"]


@dataclass(frozen=True)
class NodeCost:
    """What one node costs: written by `annotate_costs` (or by hand) as `node.meta["cost"]`.

    `fwd_s` and `bwd_s` are measured on a reference device of speed 1.0; `out_bytes` is the size of
    the node's output (what a consumer on another stage receives); `param_bytes` the parameters and
    buffers the node owns; `saved_bytes` what autograd keeps of its forward for its backward
    (tensors other than parameters, measured with saved-tensor hooks; 0 when not measured): the
    tensors it makes inside, and its own output when it or any node reading it keeps it, so a
    value kept by several nodes is counted once, at the node that makes it.

    `source` says where the times come from: "measured" on this node, "reused" from `reused_from`,
    the same node of the block this node's block repeats (`fxpipe.passes.blocks`), or
    "estimated" from its FLOPs and bytes where it could not run.
    """

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    out_bytes: int = 0
    param_bytes: int = 0
    spread: float = 0.0     # how unsteady the measurement was: (p90 - p10) / median of the repeats
    saved_bytes: int = 0
    source: CostSource = "measured"
    reused_from: str = ""   # the node measured for this one, when "reused"


@dataclass(frozen=True)
class DeviceSpec:
    """A device a stage runs on: its torch name, relative speed and memory (`inf`: unbounded).

    `threads` is a CPU stage's intra-op thread count (None: the cores shared evenly among the CPU
    stages). Devices of one `kind` run a node in the same time, so costs are measured once per
    kind; `speed` scales the measured time by hand (2.0: twice as fast as measured).
    """

    name: str
    speed: float = 1.0
    memory_bytes: float = math.inf
    threads: int | None = None

    @property
    def kind(self) -> str:
        """What a node's cost depends on: the device, and a CPU stage's thread count."""
        if is_cpu(self.name):
            return "cpu" if self.threads is None else f"cpu/{self.threads}"
        return self.name


@dataclass(frozen=True)
class Link:
    """The time to move `n` bytes between two devices is `latency_s + n / bytes_per_s`."""

    latency_s: float
    bytes_per_s: float = math.inf

    def time_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


# Between two stages on the same device nothing is copied; the hand-off itself (a queue put and a
# thread wake-up) still costs tens of microseconds on CPU, which is what bounds a CPU pipeline.
SAME_DEVICE = Link(latency_s=30e-6)
HOST_DEVICE = Link(latency_s=15e-6, bytes_per_s=12e9)   # PCIe-class copy
PEER_DEVICE = Link(latency_s=10e-6, bytes_per_s=20e9)

LinkFn = Callable[[DeviceSpec, DeviceSpec], Link]


def default_link(src: DeviceSpec, dst: DeviceSpec) -> Link:
    """A link by device kinds; `fxpipe.devices.measure_links` measures real ones."""
    if src.name == dst.name or (is_cpu(src.name) and is_cpu(dst.name)):
        return SAME_DEVICE
    if is_cpu(src.name) or is_cpu(dst.name):
        return HOST_DEVICE
    return PEER_DEVICE


# The driver feeds graph inputs and collects graph outputs; it lives on the host.
DRIVER_DEVICE = DeviceSpec("cpu")


@dataclass(frozen=True)
class KindTimes:
    """One device kind's time per node at speed 1.0: forward, and backward (zeros in inference)."""

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]


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
    succs: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _device_times: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        n = len(self.names)
        if self.saved_bytes is None:
            object.__setattr__(self, "saved_bytes", (0,) * n)
        for name in ("output_kept", "recomputable"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, (False,) * n)
        for column in (self.time_s, self.out_bytes, self.param_bytes, self.preds, self.is_input,
                       self.to_output, self.members or self.names, self.saved_bytes,
                       self.output_kept, self.recomputable,
                       *(c for t in self.kinds.values() for c in (t.fwd_s, t.bwd_s))):
            assert len(column) == n, "every CostGraph column needs one entry per node"
        succs: list[list[int]] = [[] for _ in range(n)]
        for i, ps in enumerate(self.preds):
            for p in ps:
                assert p < i, f"CostGraph must be in topological order: {p} -> {i}"
                succs[p].append(i)
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
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    outputs = set(output.all_input_nodes)
    for n in nodes:
        if n.meta.get("cost") is None:
            raise CostError(
                f"node {n.name!r} ({n.format_node()}) has no cost: run fxpipe.passes.annotate_costs on the "
                f"graph first, or set node.meta['cost'] = NodeCost(...) by hand")
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


@dataclass(frozen=True)
class StageCost:
    """One stage's predicted cost: compute on its device, transfers in and out, memory held.

    `compute_s` is forward plus backward compute; `backward_s` the backward part of it, which
    includes the forward run again when the stage recomputes (`recompute`, `recompute_s`). A
    forward action of the stage takes `forward_step_s`, a backward one `backward_step_s`:
    gradients cross the same links as the values they belong to. `memory_bytes` is what the stage
    holds at its peak (`Memory.need`); `memory_kept_bytes` what it would hold keeping every
    activation, and `memory_recomputing_bytes` recomputing them (equal outside training). A
    stage that recomputes part of its forward instead (`recomputed` names the nodes:
    `Pricing.recompute_part`) has `recompute` False, their forward as `recompute_s` and
    `Memory.need_partial` as `memory_bytes`.
    """

    compute_s: float
    comm_s: float
    memory_bytes: int
    sent_bytes: int
    received_bytes: int
    num_nodes: int
    backward_s: float = 0.0
    recompute: bool = False
    recompute_s: float = 0.0
    memory_kept_bytes: int = 0
    memory_recomputing_bytes: int = 0
    recomputed: tuple[str, ...] = ()

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def forward_step_s(self) -> float:
        return self.compute_s - self.backward_s + self.comm_s

    @property
    def backward_step_s(self) -> float:
        return self.backward_s + self.comm_s


OPTIMIZER_STATE = {"sgd": 0.0, "momentum": 1.0, "adagrad": 1.0, "rmsprop": 1.0,
                   "adam": 2.0, "adamw": 2.0}   # state bytes per parameter byte


class Held(NamedTuple):
    """What a stage holds, the bytes `Memory` prices: its parameters and buffers, the values its
    nodes make and receive per micro-batch (`activation_bytes`), what autograd keeps of its
    forward per micro-batch (`saved_bytes`), the values it receives, and the values it sends
    (each once: read by a later stage or returned)."""

    param_bytes: int = 0
    activation_bytes: int = 0
    saved_bytes: int = 0
    received_bytes: int = 0
    sent_bytes: int = 0


@dataclass(frozen=True)
class Memory:
    """What a stage holds at its peak, and what recomputation it may use to fit its device.

    In inference a stage holds its parameters and buffers, and `in_flight` micro-batches of the
    values its nodes produce and receive (`activation_bytes`). In training it holds its
    parameters, their gradients and `optimizer_state` bytes of optimizer state per parameter
    byte, and for each of the `in_flight[s]` micro-batches whose backward is still to come (read
    off the timetable: GPipe holds all of them, 1F1B fewer on later stages) what autograd keeps
    for it (`saved_bytes`, measured) and the values it received. Recomputing, it keeps only the
    values it received per micro-batch, and one micro-batch's saved values while that one's
    backward runs, at the cost of running its forward again; its peak is then in the backward,
    where the gradients of what it sent (`sent_bytes`, each value once) wait for it, up to one
    per micro-batch in flight (measured: without them the peak was a quarter too low).
    Recomputing part of its forward (`need_partial`) it also keeps, per micro-batch, what the
    part it does not recompute saves.

    `recompute`: "never", "always" (every stage), or "auto" (a stage recomputes only when it
    does not fit otherwise).
    """

    in_flight: tuple[int, ...] | int = 1
    training: bool = False
    optimizer_state: float = 2.0
    recompute: str = "never"

    def held(self, s: int) -> int:
        """Micro-batches stage `s` holds at once."""
        if isinstance(self.in_flight, int):
            return self.in_flight
        return self.in_flight[s] if s < len(self.in_flight) else max(self.in_flight, default=1)

    def need(self, s: int, held: Held, recompute: bool = False) -> int:
        """Stage `s`'s peak memory holding `held`, recomputing its whole forward or not."""
        if recompute and self.training:
            return self.need_partial(s, held, 0, held.saved_bytes)
        if not self.training:
            return held.param_bytes + self.held(s) * held.activation_bytes
        return self._state(held) + self.held(s) * (held.saved_bytes + held.received_bytes)

    def need_partial(self, s: int, held: Held, kept_bytes: int, transient_bytes: int) -> int:
        """Stage `s`'s peak memory in training recomputing part of its forward: `kept_bytes` per
        micro-batch in flight are what the part it keeps saves (0 recomputing all of it), and
        `transient_bytes` what the largest recomputed run saves, once, while it runs again."""
        return self._state(held) + self.held(s) * (
            held.received_bytes + held.sent_bytes + kept_bytes) + transient_bytes

    def must_free(self, s: int, held: Held, capacity: float) -> float:
        """The bytes per micro-batch in flight that the nodes stage `s` recomputes must save, at
        the least, for it to fit `capacity` recomputing part of its forward: whatever it keeps,
        the nodes it does not recompute keep what they save (`need_partial`)."""
        return held.saved_bytes - (capacity - self.need_partial(s, held, 0, 0)) / self.held(s)

    def _state(self, held: Held) -> int:
        """Weights, their gradients and the optimizer's state."""
        return math.ceil(held.param_bytes * (2 + self.optimizer_state))

    def choose(self, s: int, capacity: float, held: Held) -> bool | None:
        """Whether stage `s` recomputes, or None when it fits its device neither way."""
        if self.training and self.recompute == "always":
            return True if self.need(s, held, recompute=True) <= capacity else None
        if self.need(s, held) <= capacity:
            return False
        if self.training and self.recompute == "auto" and \
                self.need(s, held, recompute=True) <= capacity:
            return True
        return None

    def recomputes(self, s: int, capacity: float, held: Held) -> bool:
        """Whether stage `s` recomputes as priced: as `choose` says, and where it fits neither
        way (priced over its device) as `recompute` has every stage do."""
        choice = self.choose(s, capacity, held)
        return self.training and self.recompute == "always" if choice is None else choice


@dataclass(frozen=True)
class Choice:
    """What a stage recomputes: node names, the time that adds per micro-batch, and what the
    stage keeps per micro-batch in flight and while one micro-batch is recomputed."""

    nodes: tuple[str, ...]
    extra_s: float
    kept_bytes: int          # per micro-batch in flight
    transient_bytes: int     # one micro-batch's recomputed activations, during its backward


class StageNodes(NamedTuple):
    """One stage's nodes in graph order, what choosing the ones it recomputes reads
    (`stage_nodes`): per node its name, its forward time on the stage's device, what it saves
    for its backward and what its output weighs, whether it may be recomputed, the stage's nodes
    it reads whose output no node keeps (a recomputed run reading one keeps it), the stage's
    nodes reading it, and whether anything outside the stage reads it (a later stage, the
    output). Nodes are indices into the stage."""

    names: tuple[str, ...]
    fwd_s: tuple[float, ...]
    saved_bytes: tuple[int, ...]
    out_bytes: tuple[int, ...]
    recomputable: tuple[bool, ...]
    unkept_inputs: tuple[tuple[int, ...], ...]
    readers: tuple[tuple[int, ...], ...]
    read_outside: tuple[bool, ...]


def stage_nodes(graph: CostGraph, members: Sequence[int], forward: Sequence[float]) -> StageNodes:
    """The `StageNodes` of the stage of `graph`'s nodes `members` (in order), forward times
    `forward` per graph node."""
    local = {i: at for at, i in enumerate(members)}
    return StageNodes(
        tuple(graph.names[i] for i in members), tuple(forward[i] for i in members),
        tuple(graph.saved_bytes[i] for i in members), tuple(graph.out_bytes[i] for i in members),
        tuple(graph.recomputable[i] for i in members),
        tuple(tuple(local[p] for p in graph.preds[i] if p in local and not graph.output_kept[p])
              for i in members),
        tuple(tuple(local[j] for j in graph.succs[i] if j in local) for i in members),
        tuple(graph.to_output[i] or any(j not in local for j in graph.succs[i])
              for i in members))


def stage_memory(nodes: StageNodes, recomputed: Collection[str]) -> Choice:
    """What the stage keeps when the nodes named in `recomputed` are recomputed (see `Choice`).

    A recomputed node keeps nothing of its own; each maximal run of consecutive recomputed
    nodes is one checkpoint, which keeps what enters the run (unless a node keeps it already),
    while the nodes reading what leaves the run keep that; the transient is the largest run's
    saved bytes, alive while that run is recomputed."""
    chosen = [name in recomputed for name in nodes.names]
    kept = sum(b for b, c in zip(nodes.saved_bytes, chosen) if not c)
    transient = extra = 0.0
    for run in _runs(chosen):
        entering = {p for i in run for p in nodes.unkept_inputs[i] if p not in run}
        leaving = {i for i in run if nodes.read_outside[i] or
                   any(r not in run for r in nodes.readers[i])}
        kept += sum(nodes.out_bytes[i] for i in entering | leaving)
        transient = max(transient, sum(nodes.saved_bytes[i] for i in run))
        extra += sum(nodes.fwd_s[i] for i in run)
    return Choice(tuple(n for n, c in zip(nodes.names, chosen) if c), extra, int(kept),
                  int(transient))


def _runs(chosen: Sequence[bool]) -> list[range]:
    """The maximal runs of consecutive chosen positions."""
    runs, start = [], None
    for at, c in enumerate([*chosen, False]):
        if c and start is None:
            start = at
        elif not c and start is not None:
            runs.append(range(start, at))
            start = None
    return runs


RECOMPUTE_WINDOW = 4      # the longest run of nodes weighed as one step of `choose_recomputed`
RECOMPUTE_LARGEST = 400   # stages with more candidates recompute whole, rather than search


def choose_recomputed(nodes: StageNodes, *, memory: Memory, stage: int, held: Held,
                      capacity: float, spend: Callable[[int], None] | None = None
                      ) -> Choice | None:
    """The nodes of stage `stage` (holding `held`: its parameters, received and sent values) to
    recompute so that it fits `capacity` by `memory`'s rule (`Memory.need_partial`: what the
    nodes it keeps save per micro-batch in flight, and one micro-batch's recomputed run).
    Greedy: each step adds the run of up to `RECOMPUTE_WINDOW` consecutive candidates that
    frees the most bytes per second of forward it adds (a node alone often frees nothing: its
    neighbours keep its input and output), until the stage fits. None when no step frees more,
    or on a stage too large to search. `spend`, when given, is told the work of each choice
    tried (the stage's node count), and may raise to stop the search."""
    def need(choice: Choice) -> float:
        return memory.need_partial(stage, held, choice.kept_bytes, choice.transient_bytes)

    candidates = [name for name, ok in zip(nodes.names, nodes.recomputable) if ok]
    if len(candidates) > RECOMPUTE_LARGEST:
        return None
    chosen: set[str] = set()
    choice = stage_memory(nodes, chosen)
    while need(choice) > capacity:
        best, best_rate = None, 0.0
        free = [name for name in candidates if name not in chosen]
        for i in range(len(free)):
            for j in range(i + 1, min(i + RECOMPUTE_WINDOW, len(free)) + 1):
                if spend is not None:
                    spend(len(nodes.names))
                trial = stage_memory(nodes, chosen | set(free[i:j]))
                rate = (need(choice) - need(trial)) / max(trial.extra_s - choice.extra_s, 1e-9)
                if rate > best_rate:
                    best, best_rate = trial, rate
        if best is None:
            return None
        chosen, choice = set(best.nodes), best
    return choice


def stage_costs(graph: CostGraph, stage_of: Sequence[int], devices: Sequence[DeviceSpec],
                link: LinkFn = default_link, *, memory: Memory = Memory()) -> list[StageCost]:
    """The cost of every stage, given `stage_of[i]` for every compute node (ignored for inputs).

    A value is sent once per (producer, receiving stage), however many nodes there read it; graph
    inputs come from the driver and graph outputs go back to it, and both ends of a transfer pay
    for it. Memory follows `memory` (`Memory.need`); a stage recomputes as `Memory.recomputes`
    says (a stage that fits neither way is priced over its device). See `Pricing`.
    """
    return Pricing(graph, devices, link, memory).stage_costs(stage_of)


class StageTally:
    """One stage's sums, grown value by value: its compute, forward and backward, what it holds
    (`held`), and its transfers both ways the cost model prices them (`Pricing`): `exact_comm_s`
    over the real link per (producer, receiving stage), `relaxed_comm_s` at the cheapest link
    (0 unless asked for: `Pricing.tally`)."""

    __slots__ = ("compute_s", "forward_s", "backward_s", "num_nodes", "param_bytes",
                 "activation_bytes", "saved_bytes", "received_bytes", "sent_once_bytes",
                 "sent_bytes", "exact_comm_s", "relaxed_comm_s")

    def __init__(self):
        self.compute_s = self.forward_s = self.backward_s = 0.0
        self.exact_comm_s = self.relaxed_comm_s = 0.0
        self.num_nodes = self.param_bytes = self.activation_bytes = self.saved_bytes = 0
        self.received_bytes = self.sent_once_bytes = self.sent_bytes = 0

    @property
    def held(self) -> Held:
        return Held(self.param_bytes, self.activation_bytes, self.saved_bytes,
                    self.received_bytes, self.sent_once_bytes)


class Pricing:
    """The cost rules of one device order, in the views the partitioner searches with.

    Exact (`stage_costs`, `bottleneck_s`): a value is sent once per (producer, receiving stage)
    over the link between their devices, and both ends pay for it.

    Relaxed (`send_min`, `receive_min`, `relaxed_stage_s`): a stage priced knowing only which of
    its values are read by later stages, not by which ones: a received value costs the cheapest
    link from any earlier stage, a sent value the cheapest link to one later stage, once. Relaxed
    times never exceed exact ones, so a minimum over them is a lower bound, and they are equal
    when every value is read by at most one later stage over uniform links.

    Both views are read off one `StageTally` per stage (`tally`); the partitioner's incremental
    forms (slicing, the DP's pairs, branch and bound's sends) sum the same terms as they go and
    price them by the same rules: every transfer from one column of `transfer` (the relaxed
    `send_min` and `receive_min` are least values of those columns), and memory
    (`recompute_s`): what the stage holds (`Held`, `Memory.need`) must fit its device,
    recomputing its forward in the backward where `memory` allows and it must.
    """

    def __init__(self, graph: CostGraph, devices: Sequence[DeviceSpec], link: LinkFn = default_link,
                 memory: Memory = Memory()):
        k = len(devices)
        self.graph = graph
        self.devices = tuple(devices)
        self.link = link
        self.k = k
        self.memory = memory
        self.links = [[link(a, b) for b in devices] for a in devices]
        # Node times per stage (its device's kind over its speed), as distinct columns with
        # their forward parts (what recomputing adds), and the least time per node: the floor no
        # device goes below, whose forward adds nothing.
        self.times = [graph.device_times(d) for d in devices]
        keys = [(t, graph.device_columns(d).fwd_s) for t, d in zip(self.times, devices)]
        distinct = list(dict.fromkeys(keys))
        self.column_of = [distinct.index(key) for key in keys]
        self.columns = [t for t, _ in distinct] + [tuple(map(min, zip(*self.times)))]
        self.floor_column = len(distinct)
        self.forward_columns = [f for _, f in distinct] + [(0.0,) * len(graph)]
        self._driver_links = ([link(DRIVER_DEVICE, d) for d in devices],
                              [link(d, DRIVER_DEVICE) for d in devices])
        self._over: dict[Link, list[float]] = {}
        # Stages whose memory never constrains them: nothing to price (the hot loops skip it).
        self.unbounded = [d.memory_bytes == math.inf and
                          not (memory.training and memory.recompute == "always")
                          for d in devices]
        self._send: dict[int, list[float]] = {}
        self._receive: dict[int, list[float]] = {}
        # Recomputing part of a stage ("auto"): the choice per (stage, members), and per column
        # the least forward time per byte a node frees (`recompute_s`'s bound).
        self.partial = (memory.training and memory.recompute == "auto" and
                        any(graph.recomputable))
        self._parts: dict[tuple[int, tuple[int, ...]], Choice | None] = {}
        self._per_byte: dict[int, float] = {}

    def transfer(self, src: int | None, dst: int | None) -> list[float]:
        """Per node: the time its value takes from stage `src` to stage `dst` (None: the
        driver) over the link between their devices (`Link.time_s`), which both ends pay. The
        one price of a transfer: every view, exact or relaxed, reads these columns."""
        link = (self._driver_links[0][dst] if src is None else
                self._driver_links[1][src] if dst is None else self.links[src][dst])
        if link not in self._over:
            self._over[link] = [link.time_s(b) for b in self.graph.out_bytes]
        return self._over[link]

    def send_min(self, s: int) -> list[float]:
        """Per node: the least its value costs a stage-`s` sender to reach one later stage."""
        if s not in self._send:
            self._send[s] = _least([self.transfer(s, t) for t in range(s + 1, self.k)],
                                   len(self.graph), 0.0)
        return self._send[s]

    def receive_min(self, s: int) -> list[float]:
        """Per node: the least receiving its value can cost stage `s`: from the driver for a
        graph input, else from the cheapest earlier stage (inf: there is none)."""
        if s not in self._receive:
            earlier = _least([self.transfer(t, s) for t in range(s)], len(self.graph), math.inf)
            self._receive[s] = [fed if is_input else t for fed, t, is_input in
                                zip(self.transfer(None, s), earlier, self.graph.is_input)]
        return self._receive[s]

    def recompute_s(self, s: int, held: Held, forward_s: float) -> float:
        """The time recomputation adds to a stage holding `held`, forward `forward_s`, on stage
        `s`'s device, at most what it adds as `stage_costs` prices it: 0 when it keeps its
        activations, inf when it fits neither way (`Memory.choose`), and when it must
        recompute, its forward, or where it may recompute part of it (`recompute_part`) a
        bound: the bytes it must free (`Memory.must_free`) at the least time per byte any
        recomputable node frees, which a relaxed view can sum without knowing its nodes."""
        if self.unbounded[s]:
            return 0.0
        capacity = self.devices[s].memory_bytes
        choice = self.memory.choose(s, capacity, held)
        if choice is None:
            return math.inf
        if not choice:
            return 0.0
        if not self.partial:
            return forward_s
        per_byte = self.per_byte(self.column_of[s])
        if per_byte == math.inf:      # no recomputable node frees anything: all of it
            return forward_s
        return min(forward_s, max(0.0, self.memory.must_free(s, held, capacity)) * per_byte)

    def per_byte(self, column: int) -> float:
        """The least forward time per saved byte of a recomputable node in `column` (inf when
        none saves anything)."""
        if column not in self._per_byte:
            graph, forward = self.graph, self.forward_columns[column]
            self._per_byte[column] = min(
                (forward[i] / graph.saved_bytes[i] for i in graph.compute_nodes
                 if graph.recomputable[i] and graph.saved_bytes[i] > 0), default=math.inf)
        return self._per_byte[column]

    def recompute_part(self, s: int, stage_of: Sequence[int], held: Held, forward_s: float,
                       spend: Callable[[int], None] | None = None) -> Choice | None:
        """The part of its forward stage `s` recomputes instead of all of it ("auto" in
        training, a stage that must recompute to fit): the nodes `choose_recomputed` picks, when
        they add less than the whole forward `forward_s`; None where it recomputes whole. A
        stage's `held` is a function of its members, so the choice is kept per members;
        `spend` is told the work of choosing (`choose_recomputed`)."""
        if not self.partial:
            return None
        members = tuple(i for i in self.graph.compute_nodes if stage_of[i] == s)
        if (s, members) not in self._parts:
            nodes = stage_nodes(self.graph, members, self.forward_columns[self.column_of[s]])
            choice = choose_recomputed(nodes, memory=self.memory, stage=s, held=held,
                                       capacity=self.devices[s].memory_bytes, spend=spend)
            self._parts[s, members] = (choice if choice is not None and
                                       choice.extra_s < forward_s else None)
        return self._parts[s, members]

    def tally(self, stage_of: Sequence[int], relaxed: bool = False) -> list[StageTally]:
        """Every stage's sums under `stage_of` (`StageTally`), transfers priced exactly, and
        relaxed too when `relaxed` (it reads `send_min` and `receive_min`, which cost O(n) per
        stage to build)."""
        graph, k = self.graph, self.k
        tallies = [StageTally() for _ in range(k)]
        forward = [self.forward_columns[c] for c in self.column_of]
        backward = [self.graph.device_columns(d).bwd_s for d in self.devices]
        out_bytes, succs, to_output = graph.out_bytes, graph.succs, graph.to_output
        for i in range(len(graph)):
            nbytes = out_bytes[i]
            receivers = dict.fromkeys(stage_of[j] for j in succs[i])
            if graph.is_input[i]:
                for r in receivers:
                    tally = tallies[r]
                    t = self.transfer(None, r)[i]
                    tally.exact_comm_s += t
                    tally.relaxed_comm_s += t
                    tally.received_bytes += nbytes
                    tally.activation_bytes += nbytes
                continue
            s = stage_of[i]
            tally = tallies[s]
            tally.compute_s += self.times[s][i]
            tally.forward_s += forward[s][i]
            tally.backward_s += backward[s][i]
            tally.param_bytes += graph.param_bytes[i]
            tally.activation_bytes += nbytes
            tally.saved_bytes += graph.saved_bytes[i]
            tally.num_nodes += len(graph.node_names(i))
            receivers.pop(s, None)
            if receivers or to_output[i]:
                tally.sent_once_bytes += nbytes
            if receivers and relaxed:
                tally.relaxed_comm_s += self.send_min(s)[i]
            for r in receivers:
                t = self.transfer(s, r)[i]
                tally.exact_comm_s += t
                tally.sent_bytes += nbytes
                reader = tallies[r]
                reader.exact_comm_s += t
                if relaxed:
                    reader.relaxed_comm_s += self.receive_min(r)[i]
                reader.received_bytes += nbytes
                reader.activation_bytes += nbytes
            if to_output[i]:
                t = self.transfer(s, None)[i]
                tally.exact_comm_s += t
                tally.relaxed_comm_s += t
                tally.sent_bytes += nbytes
        return tallies

    def stage_costs(self, stage_of: Sequence[int],
                    spend: Callable[[int], None] | None = None) -> list[StageCost]:
        """Every stage's exact cost (see `stage_costs`); `spend` is told the work of choosing
        what stages recompute (`recompute_part`)."""
        costs = []
        for s, tally in enumerate(self.tally(stage_of)):
            held = tally.held
            recompute = self.memory.recomputes(s, self.devices[s].memory_bytes, held)
            kept, recomputing = self.memory.need(s, held), self.memory.need(s, held, True)
            part = (self.recompute_part(s, stage_of, held, tally.forward_s, spend) if recompute
                    else None)
            if part is None:
                extra, need = (tally.forward_s, recomputing) if recompute else (0.0, kept)
                recomputed: tuple[str, ...] = ()
            else:
                extra, recomputed, recompute = part.extra_s, part.nodes, False
                need = self.memory.need_partial(s, held, part.kept_bytes, part.transient_bytes)
            costs.append(StageCost(tally.compute_s + extra, tally.exact_comm_s, need,
                                   tally.sent_bytes, tally.received_bytes, tally.num_nodes,
                                   tally.backward_s + extra, recompute, extra, kept,
                                   recomputing, recomputed))
        return costs

    def bottleneck_s(self, stage_of: Sequence[int],
                     spend: Callable[[int], None] | None = None) -> float:
        """The exact bottleneck of a partition (`spend`: see `stage_costs`)."""
        return max(c.time_s for c in self.stage_costs(stage_of, spend))

    def relaxed_stage_s(self, stage_of: Sequence[int]) -> list[float]:
        """Every stage's relaxed time (the definition the partitioner's incremental forms are
        tested against): compute, values received at `receive_min`, values read by a later
        stage sent once at `send_min`, outputs returned to the driver, and what recomputing
        adds (`recompute_s`; inf for a stage that does not fit)."""
        return [t.compute_s + t.relaxed_comm_s + self.recompute_s(s, t.held, t.forward_s)
                for s, t in enumerate(self.tally(stage_of, relaxed=True))]


def _least(columns: Sequence[list[float]], n: int, empty: float) -> list[float]:
    """The least of `columns` per node (`empty` when there is no column); a column met
    twice (two stages over one link) is read once."""
    distinct = list({id(c): c for c in columns}.values())
    if not distinct:
        return [empty] * n
    return list(map(min, *distinct)) if len(distinct) > 1 else list(distinct[0])


def format_bytes(nbytes: float) -> str:
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



def lower_bound_s(graph: CostGraph, devices: Sequence[DeviceSpec]) -> float:
    """No partition onto `devices` has a bottleneck below this.

    The slowest node must run whole on the device it is fastest on. And for any weights
    w_d >= 0 summing to 1, the weighted average of the stages' compute, which is at most the
    bottleneck, is at least sum_i min_d w_d t_i(d): node `i` counts at its cheapest weighted
    device. With w_d proportional to a device's speed (the reciprocal of its total time) this
    is total compute over total speed; when devices of different kinds are faster at different
    nodes, `_best_weights` searches for larger weights' bound.
    """
    nodes = graph.compute_nodes
    if not nodes:
        return 0.0
    # Devices with the same times are interchangeable: one group, its weight shared evenly.
    groups: dict[tuple[float, ...], int] = collections.Counter(
        tuple(map(graph.device_times(d).__getitem__, nodes)) for d in devices)
    columns, counts = list(groups), list(groups.values())
    largest = max(min(column[at] for column in columns) for at in range(len(nodes)))
    return max(largest, _best_weights(columns, counts))


def _weighted_bound(columns: Sequence[Sequence[float]], counts: Sequence[int],
                    share: Sequence[float]) -> float:
    """sum_i min_g share[g] * columns[g][i]: the bound of weights `share[g]` per device of group
    `g` (the shares times the counts sum to 1)."""
    return sum(min(u * t for u, t in zip(share, ts)) for ts in zip(*columns))


def _best_weights(columns: Sequence[Sequence[float]], counts: Sequence[int]) -> float:
    """The bound of good weights: from weights proportional to speed, which are optimal when
    every group's column is a multiple of the others', a few rounds of moving weight between
    two groups, each a search on a concave function of one variable."""
    totals = [sum(column) for column in columns]
    if min(totals) <= 0:
        return 0.0
    norm = sum(c / t for c, t in zip(counts, totals))
    share = [1 / (t * norm) for t in totals]
    best = _weighted_bound(columns, counts, share)
    proportional = all(all(math.isclose(a * totals[0], b * t, rel_tol=1e-9)
                           for a, b in zip(columns[0], column))
                       for column, t in zip(columns, totals))
    if proportional:
        return best
    for _ in range(1 if len(columns) == 2 else 3):    # with two groups one search is exhaustive
        for g in range(len(columns)):
            for h in range(g + 1, len(columns)):
                # Move delta of the total weight from group h to group g (delta may be < 0).
                low, high = -share[g] * counts[g], share[h] * counts[h]

                def moved(delta: float) -> list[float]:
                    u = list(share)
                    u[g] += delta / counts[g]
                    u[h] = max(0.0, u[h] - delta / counts[h])
                    u[g] = max(0.0, u[g])
                    return u

                for _ in range(40):     # ternary search: the bound is concave in delta
                    a, b = low + (high - low) / 3, high - (high - low) / 3
                    if _weighted_bound(columns, counts, moved(a)) < \
                            _weighted_bound(columns, counts, moved(b)):
                        low = a
                    else:
                        high = b
                candidate = moved((low + high) / 2)
                value = _weighted_bound(columns, counts, candidate)
                if value > best:
                    best, share = value, candidate
    return best
