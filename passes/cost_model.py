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
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Collection, Literal, Mapping, NamedTuple, Sequence

import torch.fx as fx

from .device import is_cpu, is_gpu, same_memory
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

    `new_bytes` is the memory the node's output takes that no input of the node had: a view
    (`view`, `transpose`, a tuple's item, a slice) takes none, its bytes are its base's, and
    `views` names the nodes whose memory its output shares (their memory lives as long as it
    does); None: not measured, the whole output is new. Read by the liveness of a stage's
    forward (`forward_peak`).
    """

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    out_bytes: int = 0
    param_bytes: int = 0
    spread: float = 0.0     # how unsteady the measurement was: (p90 - p10) / median of the repeats
    saved_bytes: int = 0
    source: CostSource = "measured"
    reused_from: str = ""   # the node measured for this one, when "reused"
    new_bytes: int | None = None
    views: tuple[str, ...] = ()


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


def default_link(src: DeviceSpec, dst: DeviceSpec, same_device: Link = SAME_DEVICE) -> Link:
    """A link by device kinds, a hand-off on one device costing `same_device` (planning passes
    the runtime's own, measured: `fxpipe.measure.priced_link`); `fxpipe.devices.measure_links`
    measures real ones."""
    if src.name == dst.name or (is_cpu(src.name) and is_cpu(dst.name)):
        return same_device
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


# A GPU's caching allocator (PyTorch's CUDACachingAllocator): every block rounds up to 512
# bytes (what `torch.cuda.memory_allocated` counts); blocks are cut from segments the allocator
# reserves from the driver: 2 MiB ones for requests up to 1 MiB, 20 MiB ones up to 10 MiB, and
# larger requests rounded up to 2 MiB (what `torch.cuda.memory_reserved` counts).
GPU_BLOCK_BYTES = 512
GPU_SMALL_BYTES = 1 << 20
GPU_SMALL_SEGMENT_BYTES = 2 << 20
GPU_MID_BYTES = 10 << 20
GPU_MID_SEGMENT_BYTES = 20 << 20
GPU_LARGE_ROUND_BYTES = 2 << 20
# cuBLAS's workspace, one per (handle, stream), so one per GPU stage: PyTorch's default
# CUBLAS_WORKSPACE_CONFIG is ":4096:8" on Hopper (8 x 4 MiB), ":4096:2:16:8" before it.
CUBLAS_WORKSPACE_BYTES = {"hopper": 32 << 20, "older": (2 << 22) + (8 << 14)}
# What a process's CUDA context takes on each GPU it uses, outside PyTorch's allocator (its
# kernels and cuBLAS/cuDNN handles; about 0.5 GB with CUDA 12): not in a stage's memory, not
# charged against `DeviceSpec.memory_bytes` (a GPU's budget is what is free once it exists).
CUDA_CONTEXT_BYTES = 512 << 20


def gpu_block_bytes(nbytes: int) -> int:
    """The bytes the caching allocator hands out for a tensor of `nbytes`: 512-byte blocks."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // GPU_BLOCK_BYTES) * GPU_BLOCK_BYTES


def gpu_segment_bytes(nbytes: int) -> int:
    """The segment the caching allocator reserves from the driver when no cached one has room
    for a tensor of `nbytes`: 2 MiB up to 1 MiB, 20 MiB up to 10 MiB, else the block rounded up
    to 2 MiB."""
    block = gpu_block_bytes(nbytes)
    if block == 0:
        return 0
    if block <= GPU_SMALL_BYTES:
        return GPU_SMALL_SEGMENT_BYTES
    if block < GPU_MID_BYTES:
        return GPU_MID_SEGMENT_BYTES
    return -(-block // GPU_LARGE_ROUND_BYTES) * GPU_LARGE_ROUND_BYTES


def cublas_workspace_bytes(capability: tuple[int, int] | None) -> int:
    """cuBLAS's workspace per stream on a GPU of compute capability `capability` (None:
    unknown, priced as Hopper's, the larger)."""
    return CUBLAS_WORKSPACE_BYTES["hopper" if capability is None or capability[0] >= 9
                                  else "older"]


OPTIMIZER_STATE = {"sgd": 0.0, "momentum": 1.0, "adagrad": 1.0, "rmsprop": 1.0,
                   "adam": 2.0, "adamw": 2.0}   # state bytes per parameter byte


class Held(NamedTuple):
    """What a stage holds, the bytes `Memory` prices: its parameters and buffers, the values its
    nodes make and receive per micro-batch (`activation_bytes`), what autograd keeps of its
    forward per micro-batch (`saved_bytes`), the values it receives, and the values it sends
    (each once: read by a later stage or returned).

    For inference also: the new memory of the values it sends or returns (`sent_new_bytes`:
    alive together at the end of its forward), the values it returns to the driver
    (`returned_bytes`, held until the join), and, known only to the exact view
    (`Pricing.stage_costs`), the live set at the worst point of one micro-batch's forward
    (`peak_bytes`, `forward_peak`) and what it holds across micro-batches at its fullest
    (`across_bytes`: values sent to later stages and not yet taken, outputs waiting for the
    join). Where they are 0 `Memory.need` takes their lower bounds, which every relaxed view
    sums as it grows a stage.

    For training also: what of `saved_bytes` a later stage takes over (`moved_bytes`: a value
    the stage sends that a node keeps, read by a stage in the same memory, is that stage's
    from its first use: the relaxed views count every kept value sent, a lower bound), and,
    known only to the exact view, a backward's transient gradients (`backward_bytes`, the most
    over the stage's nodes of the gradient of a node's output and those it makes for its
    inputs) and the largest weight gradient made before it is added into `.grad`
    (`grad_temp_bytes`), and the values it returns, or sends to another memory, that no node
    keeps (`outputs_bytes`: the stage holds its outputs per micro-batch until that one's
    backward, unless it recomputes its whole forward)."""

    param_bytes: int = 0
    activation_bytes: int = 0
    saved_bytes: int = 0
    received_bytes: int = 0
    sent_bytes: int = 0
    sent_new_bytes: int = 0
    returned_bytes: int = 0
    peak_bytes: int = 0
    across_bytes: int = 0
    moved_bytes: int = 0
    backward_bytes: int = 0
    grad_temp_bytes: int = 0
    outputs_bytes: int = 0
    # The exact view's training timeline (`Pricing.training_held`): per action start, the
    # micro-batches held, the bytes held besides them, and whether it is a backward.
    arms: tuple[tuple[int, int, bool], ...] = ()


@dataclass(frozen=True)
class Memory:
    """What a stage holds at its peak, and what recomputation it may use to fit its device.

    In inference a stage holds its parameters and buffers, the live set of one micro-batch's
    forward at its worst point (`forward_peak`: the values it received, the values its nodes
    made that a later node of the stage still reads, or that it sends; a view's memory is its
    base's), and across the `microbatches`: the values it sent to later stages that these have
    not taken yet (read off the predicted timeline, `Pricing.stage_costs`), and the outputs it
    returns, held until the join, which then makes one more copy of them. The relaxed views
    price the live set at its lower bound: the values received, and those sent at the end of the
    forward (`Held`).

    In training it holds its parameters and `optimizer_state` bytes of optimizer state per
    parameter byte throughout, and for each micro-batch whose backward is still to come what
    autograd keeps for it (`saved_bytes`, measured, less what a later stage took over,
    `moved_bytes`), the values it received, and its outputs no node keeps (`outputs_bytes`).
    Gradients exist from a step's first backward on (until the optimizer's `zero_grad`, which
    sets them to None by default), so its peak is the larger of: the first backward starting,
    `in_flight[s]` micro-batches held (read off the timetable: GPipe holds all of them, 1F1B
    fewer on later stages), and a later backward,
    every gradient made and `after_backward[s]` micro-batches held (GPipe: one fewer; 1F1B:
    as many, where a forward follows each backward), with the largest weight gradient made
    before it is added in (`grad_temp_bytes`); both with the backward's transient gradients
    (`backward_bytes`). Recomputing, it keeps only the values it received per micro-batch,
    and one micro-batch's saved values while that one's backward runs, at the cost of running
    its forward again. Recomputing part of its forward (`need_partial`) it keeps, per
    micro-batch, what the part it does not recompute saves, and once what the largest
    recomputed run saves while it runs again.

    `recompute`: "never", "always" (every stage), or "auto" (a stage recomputes only when it
    does not fit otherwise).
    """

    in_flight: tuple[int, ...] | int = 1
    training: bool = False
    optimizer_state: float = 2.0
    recompute: str = "never"
    microbatches: int = 1
    after_backward: tuple[int, ...] | int | None = None   # None: as many as `in_flight`
    # Each stage's row of the timetable, ("F" or "B", micro-batch) per action: the exact
    # view's training timeline (None: `in_flight` and `after_backward` alone).
    rows: tuple[tuple[tuple[str, int], ...], ...] | None = None
    # What a stage on a GPU holds besides its values: cuBLAS's workspace on its stream
    # (`cublas_workspace_bytes`; planning sets it, 0 by default). The CUDA context is not a
    # stage's (`CUDA_CONTEXT_BYTES`).
    gpu_overhead_bytes: int = 0

    def held(self, s: int) -> int:
        """Micro-batches stage `s` holds at once."""
        if isinstance(self.in_flight, int):
            return self.in_flight
        return self.in_flight[s] if s < len(self.in_flight) else max(self.in_flight, default=1)

    def held_after(self, s: int) -> int:
        """Micro-batches stage `s` holds as a backward after its first starts (0: none runs)."""
        after = self.after_backward
        if after is None:
            return self.held(s)
        if isinstance(after, int):
            return after
        return after[s] if s < len(after) else max(after, default=1)

    def need(self, s: int, held: Held, recompute: bool = False) -> int:
        """Stage `s`'s peak memory holding `held`, recomputing its whole forward or not."""
        if not self.training:
            return held.param_bytes + self.inference_bytes(held)
        if recompute:
            return self.need_partial(s, held._replace(outputs_bytes=0), 0, held.saved_bytes)
        return self.need_partial(s, held, max(0, held.saved_bytes - held.moved_bytes), 0)

    def inference_bytes(self, held: Held) -> int:
        """What an inference stage holds besides its parameters, at its fullest: during a
        forward, that forward's live set (at least what it received and what it sends) and
        what it holds across micro-batches (at least the outputs of the others waiting for the
        join); or at the join, every micro-batch's outputs and the joined copy."""
        m = self.microbatches
        forward = max(held.peak_bytes, held.received_bytes + held.sent_new_bytes)
        across = max(held.across_bytes, (m - 1) * held.returned_bytes)
        join = 2 * m * held.returned_bytes if m > 1 else 0
        return max(forward + across, join)

    def need_partial(self, s: int, held: Held, kept_bytes: int, transient_bytes: int) -> int:
        """Stage `s`'s peak memory in training recomputing part of its forward: `kept_bytes` per
        micro-batch in flight are what the part it keeps saves (its saved bytes less those
        moved, recomputing nothing; 0 recomputing all of it), and `transient_bytes` what the
        largest recomputed run saves, once, while it runs again (see the class)."""
        first, later = self._arms(s, held, kept_bytes)
        most = max(first, later) + transient_bytes
        per_batch = held.received_bytes + held.outputs_bytes + kept_bytes
        for count, fixed, backward in held.arms:
            most = max(most, count * per_batch + fixed +
                       (held.backward_bytes + transient_bytes if backward else 0))
        return self._state(held) + most

    def _arms(self, s: int, held: Held, kept_bytes: int) -> tuple[int, int]:
        """What a training stage holds besides its parameters and optimizer state, as its first
        backward starts and as a later one runs (0 where none does), less a recomputed run."""
        per_batch = held.received_bytes + held.outputs_bytes + kept_bytes
        first = self.held(s) * per_batch + held.backward_bytes
        after = self.held_after(s)
        later = (held.param_bytes + after * per_batch + held.backward_bytes +
                 held.grad_temp_bytes) if after > 0 else held.param_bytes
        return first, later

    def must_free(self, s: int, held: Held, capacity: float) -> float:
        """The bytes per micro-batch in flight that the nodes stage `s` recomputes must save, at
        the least, for it to fit `capacity` recomputing part of its forward: whatever it keeps,
        the nodes it does not recompute keep what they save (`need_partial`, a recomputed run's
        own bytes aside)."""
        room = capacity - self._state(held)
        first, later = self._arms(s, held, 0)
        kept = (room - first) / self.held(s)
        after = self.held_after(s)
        if after > 0:
            kept = min(kept, (room - later) / after)
        elif room < later:
            kept = -math.inf
        return max(0, held.saved_bytes - held.moved_bytes) - kept

    def _state(self, held: Held) -> int:
        """Weights and the optimizer's state."""
        return math.ceil(held.param_bytes * (1 + self.optimizer_state))

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


def stage_nodes(graph: CostGraph, members: Sequence[int], forward: Sequence[float],
                moved: Collection[int] = ()) -> StageNodes:
    """The `StageNodes` of the stage of `graph`'s nodes `members` (in order), forward times
    `forward` per graph node; the nodes in `moved` keep their output for a later stage in the
    same memory, which takes it over (not saved here: `Held.moved_bytes`)."""
    local = {i: at for at, i in enumerate(members)}
    return StageNodes(
        tuple(graph.names[i] for i in members), tuple(forward[i] for i in members),
        tuple(graph.saved_bytes[i] - (graph.out_bytes[i] if i in moved else 0)
              for i in members), tuple(graph.out_bytes[i] for i in members),
        tuple(graph.recomputable[i] for i in members),
        tuple(tuple(local[p] for p in graph.preds[i] if p in local and not graph.output_kept[p])
              for i in members),
        tuple(tuple(local[j] for j in graph.succs[i] if j in local) for i in members),
        tuple(graph.to_output[i] or any(j not in local for j in graph.succs[i])
              for i in members))


def forward_peak(graph: CostGraph, members: Sequence[int]) -> int:
    """The most memory one micro-batch's forward of the stage made of `graph`'s nodes `members`
    (in graph order) holds at once, its parameters aside.

    The values it receives live for the whole forward (the runtime holds them until it
    returns), each once however many members read it. A member's output takes its `new_bytes`
    as it runs, and lives until its last reader in the stage has run, or, read by a later stage
    or returned, until the forward ends; a value a member's output views (`views`) lives as long
    as that output. The peak is the most, over the members in order, of what lives while one
    runs: its output, and its inputs among the rest. O(members + edges)."""
    local = {i: at for at, i in enumerate(members)}
    n = len(members)
    received = dict.fromkeys(p for i in members for p in graph.preds[i] if p not in local)
    last = [0] * n
    for at, i in enumerate(members):
        readers = graph.succs[i]
        if graph.to_output[i] or any(j not in local for j in readers):
            last[at] = n - 1
        else:
            last[at] = max((local[j] for j in readers), default=at)
    for at in range(n - 1, -1, -1):      # a view keeps its base: later members first
        for p in graph.views[members[at]]:
            if p in local:
                last[local[p]] = max(last[local[p]], last[at])
    change = [0] * (n + 1)
    for at, i in enumerate(members):
        change[at] += graph.new_bytes[i]
        change[last[at] + 1] -= graph.new_bytes[i]
    live = peak = sum(graph.out_bytes[p] for p in received)
    for at in range(n):
        live += change[at]
        peak = max(peak, live)
    return peak


def standalone_held(graph: CostGraph, members: Sequence[int]) -> Held:
    """What the stage made of `graph`'s nodes `members` (in graph order) holds as the exact view
    counts it (`Pricing.stage_costs`), with every other node in other stages in the same memory
    and nothing waiting between stages (which needs the others' times)."""
    inside = set(members)
    received = dict.fromkeys(p for i in members for p in graph.preds[i] if p not in inside)
    received_bytes = sum(graph.out_bytes[p] for p in received)
    read_outside = [i for i in members if any(j not in inside for j in graph.succs[i])]
    outside = set(read_outside)
    sent = [i for i in members if graph.to_output[i] or any(j not in inside
                                                             for j in graph.succs[i])]
    saved = list(itertools.accumulate(graph.saved_bytes[i] for i in members))
    return Held(
        param_bytes=sum(graph.param_bytes[i] for i in members),
        activation_bytes=sum(graph.out_bytes[i] for i in members) + received_bytes,
        saved_bytes=sum(graph.saved_bytes[i] for i in members),
        received_bytes=received_bytes,
        sent_bytes=sum(graph.out_bytes[i] for i in sent),
        sent_new_bytes=sum(graph.new_bytes[i] for i in sent),
        returned_bytes=sum(graph.out_bytes[i] for i in members if graph.to_output[i]),
        peak_bytes=forward_peak(graph, members),
        moved_bytes=sum(graph.out_bytes[i] for i in read_outside if graph.output_kept[i]),
        backward_bytes=sum(graph.out_bytes[i] for i in read_outside) + max(0, max(
            (kept + (0 if i in outside else graph.out_bytes[i]) +
             sum(graph.out_bytes[p] for p in graph.preds[i])
             for i, kept in zip(members, saved)), default=0) - (saved[-1] if saved else 0)),
        grad_temp_bytes=max((graph.param_bytes[i] for i in members), default=0))


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
                 "sent_bytes", "sent_new_bytes", "returned_bytes", "kept_sent_bytes",
                 "exact_comm_s", "relaxed_comm_s")

    def __init__(self):
        self.compute_s = self.forward_s = self.backward_s = 0.0
        self.exact_comm_s = self.relaxed_comm_s = 0.0
        self.num_nodes = self.param_bytes = self.activation_bytes = self.saved_bytes = 0
        self.received_bytes = self.sent_once_bytes = self.sent_bytes = 0
        self.sent_new_bytes = self.returned_bytes = self.kept_sent_bytes = 0

    @property
    def held(self) -> Held:
        """What the stage holds as the relaxed views count it (`Held`)."""
        return Held(self.param_bytes, self.activation_bytes, self.saved_bytes,
                    self.received_bytes, self.sent_once_bytes, self.sent_new_bytes,
                    self.returned_bytes, moved_bytes=self.kept_sent_bytes)


WAIT_SLACK = 0.25    # a receiver this close (a share of the sender's forward) may be late


def _timeline_arms(rows: Sequence[Sequence[tuple[str, int]]], reads: Sequence[set[int]]
                   ) -> list[tuple[tuple[int, int, int, bool, bool], ...]]:
    """What each stage holds as each of its actions starts in a training step, whatever the
    stages' speeds (on CPUs sharing cores they are not what was predicted: measured, a stage
    predicted as fast as its neighbours was held up by them).

    An action happens before another when a path of the timetable leads to it: a stage's row
    in order, a forward after its senders' forward of that micro-batch, a backward after its
    readers' backward. At each action's start, per stage, distinct: the micro-batches the
    stage holds (forwarded, not yet backpropagated, the one starting among them); of the
    earlier ones, how many it sent forward values of, and gradients of what it received of,
    that a reader may not have taken yet (the taking does not happen before); whether a
    backward ran already (every gradient exists); whether it is a backward."""
    k = len(rows)
    readers = [[r for r in range(k) if s in reads[r]] for s in range(k)]
    position = {(s, phase, m): q for s in range(k) for q, (phase, m) in enumerate(rows[s])}
    ancestors: dict[tuple[int, str, int], frozenset] = {}

    def before(action: tuple[int, str, int]) -> frozenset:
        """Every action that happens before `action` (iteratively, in the rows' order)."""
        if action in ancestors:
            return ancestors[action]
        stack = [action]
        while stack:
            top = stack[-1]
            s, phase, m = top
            q = position[top]
            parents = ([(s, *rows[s][q - 1])] if q else []) + [
                (t, phase, m) for t in (reads[s] if phase == "F" else readers[s])
                if (t, phase, m) in position]
            missing = [p for p in parents if p not in ancestors]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            found = set(parents)
            for p in parents:
                found |= ancestors[p]
            ancestors[top] = frozenset(found)
        return ancestors[action]

    arms = []
    for s in range(k):
        found: dict[tuple[int, int, int, bool, bool], None] = {}
        forwarded: list[int] = []
        backpropagated: list[int] = []
        for phase, m in rows[s]:
            done = before((s, phase, m))
            waiting_f = sum(1 for j in forwarded if any((r, "F", j) not in done
                                                        for r in readers[s]))
            waiting_b = sum(1 for j in backpropagated if any((t, "B", j) not in done
                                                             for t in reads[s]))
            count = len(forwarded) - len(backpropagated) + (phase == "F")
            found[count, waiting_f, waiting_b, bool(backpropagated), phase == "B"] = None
            (forwarded if phase == "F" else backpropagated).append(m)
        arms.append(tuple(found))
    return arms


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
        self._arms: dict[tuple, list] = {}     # the training timeline per stage graph
        # What a GPU stage holds besides its values (cuBLAS's workspace on its stream).
        self.overhead = [memory.gpu_overhead_bytes if is_gpu(d.name) else 0 for d in devices]

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

    def recompute_s(self, s: int, held: Held, forward_s: float, margin: float = 0.0) -> float:
        """The time recomputation adds to a stage holding `held`, forward `forward_s`, on stage
        `s`'s device, at most what it adds as `stage_costs` prices it: 0 when it keeps its
        activations, inf when it fits neither way (`Memory.choose`), and when it must
        recompute, its forward, or where it may recompute part of it (`recompute_part`) a
        bound: the bytes it must free (`Memory.must_free`) at the least time per byte any
        recomputable node frees, which a relaxed view can sum without knowing its nodes.
        `margin`: bytes of the device kept free (slicing's room for what only the exact view
        counts)."""
        if self.unbounded[s]:
            return 0.0
        capacity = self.devices[s].memory_bytes - margin - self.overhead[s]
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
        moved = self.moved(s, stage_of, members)
        if (s, members, moved) not in self._parts:
            nodes = stage_nodes(self.graph, members, self.forward_columns[self.column_of[s]],
                                moved)
            choice = choose_recomputed(nodes, memory=self.memory, stage=s, held=held,
                                       capacity=self.devices[s].memory_bytes - self.overhead[s],
                                       spend=spend)
            self._parts[s, members, moved] = (choice if choice is not None and
                                              choice.extra_s < forward_s else None)
        return self._parts[s, members, moved]

    def moved(self, s: int, stage_of: Sequence[int], members: Sequence[int]) -> frozenset[int]:
        """Stage `s`'s members whose kept output a later stage in the same memory takes over."""
        graph, here = self.graph, self.devices[s].name
        return frozenset(i for i in members if graph.output_kept[i] and any(
            stage_of[j] != s and same_memory(self.devices[stage_of[j]].name, here)
            for j in graph.succs[i]))

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
                tally.sent_new_bytes += graph.new_bytes[i]
            if to_output[i]:
                tally.returned_bytes += nbytes
            if receivers and graph.output_kept[i]:
                tally.kept_sent_bytes += nbytes
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
        tallies = self.tally(stage_of)
        exact = (self.training_held(stage_of, tallies) if self.memory.training else
                 self.inference_held(stage_of, tallies))
        for s, tally in enumerate(tallies):
            held = exact[s]
            overhead = self.overhead[s]
            recompute = self.memory.recomputes(s, self.devices[s].memory_bytes - overhead, held)
            kept = self.memory.need(s, held) + overhead
            recomputing = self.memory.need(s, held, True) + overhead
            part = (self.recompute_part(s, stage_of, held, tally.forward_s, spend) if recompute
                    else None)
            if part is None:
                extra, need = (tally.forward_s, recomputing) if recompute else (0.0, kept)
                recomputed: tuple[str, ...] = ()
            else:
                extra, recomputed, recompute = part.extra_s, part.nodes, False
                need = self.memory.need_partial(s, held, part.kept_bytes,
                                                part.transient_bytes) + overhead
            costs.append(StageCost(tally.compute_s + extra, tally.exact_comm_s, need,
                                   tally.sent_bytes, tally.received_bytes, tally.num_nodes,
                                   tally.backward_s + extra, recompute, extra, kept,
                                   recomputing, recomputed))
        return costs

    def inference_held(self, stage_of: Sequence[int], tallies: Sequence[StageTally]
                       ) -> list[Held]:
        """Every stage's `Held` in inference with what only the exact view knows: its forward's
        live set (`forward_peak`) and what it holds across micro-batches at its fullest.

        Across micro-batches, read off the forwards' predicted timeline (each stage's forwards
        in order, each starting once its own previous one ended and its senders' ended, taking
        its forward compute and transfers): while stage `s` runs micro-batch j's forward it
        holds what it sent of the earlier micro-batches that some receiver has not started yet,
        and the earlier micro-batches' outputs for the join. A receiver predicted to start
        less than `WAIT_SLACK` of the sender's forward before it counts as not started: stages
        the partitioner balances are within noise of each other (measured: a receiver
        predicted 5% faster was the slower one)."""
        graph, k, m = self.graph, self.k, self.memory.microbatches
        members: list[list[int]] = [[] for _ in range(k)]
        reads: list[set[int]] = [set() for _ in range(k)]
        sent = [0] * k                   # per micro-batch, to later stages, each value once
        for i in graph.compute_nodes:
            s = stage_of[i]
            members[s].append(i)
            receivers = {stage_of[j] for j in graph.succs[i]} - {s}
            if receivers:
                sent[s] += graph.out_bytes[i]
            for r in receivers:
                reads[r].add(s)
        step = [t.compute_s + t.exact_comm_s for t in tallies]
        start = [[0.0] * m for _ in range(k)]
        for s in range(k):               # a stage reads only from earlier ones
            for j in range(m):
                ready = max((start[t][j] + step[t] for t in reads[s]), default=0.0)
                start[s][j] = max(ready, start[s][j - 1] + step[s] if j else 0.0)
        held = []
        for s, tally in enumerate(tallies):
            receivers = [r for r in range(k) if s in reads[r]]
            across = 0
            slack = WAIT_SLACK * step[s]
            for j in range(m):
                waiting = sum(1 for earlier in range(j) if receivers and
                              max(start[r][earlier] for r in receivers) >=
                              start[s][j] - slack)
                across = max(across, waiting * sent[s] + j * tally.returned_bytes)
            held.append(tally.held._replace(peak_bytes=forward_peak(graph, members[s]),
                                            across_bytes=across))
        return held

    def training_held(self, stage_of: Sequence[int], tallies: Sequence[StageTally]
                      ) -> list[Held]:
        """Every stage's `Held` in training with what only the exact view knows: the kept
        values it sends that a stage in the same memory takes over (`moved_bytes`: the relaxed
        views count every kept value it sends), a backward's transient gradients (those of
        what it sends, held as long as its backward runs, and the most over its nodes of the
        gradient of a node's output and those it makes for what it reads), its largest weight
        gradient before it is added into `.grad`, and with the timetable's rows
        (`Memory.rows`) what it holds as each action starts (`_timeline_arms`)."""
        graph, devices, k = self.graph, self.devices, self.k
        moved, transient, temp = [0] * k, [0] * k, [0] * k
        sent, received = [0] * k, [0] * k      # per micro-batch, from and to other stages
        saved = [0] * k         # what the stage's nodes so far keep, per micro-batch
        stays = [0] * k         # of which the kept values it sends
        outputs = [0] * k       # what it returns or sends to another memory, not kept
        reads: list[set[int]] = [set() for _ in range(k)]
        for i in graph.compute_nodes:
            s = stage_of[i]
            receivers = {stage_of[j] for j in graph.succs[i]} - {s}
            # As node i's backward runs, the later nodes' backwards have freed what they kept
            # but for the values the stage sent (the executor holds them until its backward
            # ends): what is kept then is the nodes' up to i, the kept values sent, and i's
            # transient gradients (`stays[s]` is added once the stage's nodes are all seen).
            saved[s] += graph.saved_bytes[i]
            if receivers and graph.output_kept[i]:
                stays[s] += graph.out_bytes[i]
            transient[s] = max(transient[s], saved[s] - stays[s] +
                               (0 if receivers else graph.out_bytes[i]) +
                               sum(graph.out_bytes[p] for p in graph.preds[i]))
            temp[s] = max(temp[s], graph.param_bytes[i])
            if graph.output_kept[i] and any(same_memory(devices[r].name, devices[s].name)
                                            for r in receivers):
                moved[s] += graph.out_bytes[i]
            if receivers:
                sent[s] += graph.out_bytes[i]
            if not graph.output_kept[i] and (graph.to_output[i] or any(
                    not same_memory(devices[r].name, devices[s].name) for r in receivers)):
                outputs[s] += graph.out_bytes[i]
            for r in receivers:
                reads[r].add(s)
                received[r] += graph.out_bytes[i]
        # A backward holds the gradients of what the stage sent, what a later stage took over
        # of its kept values (back from it: that stage's backward of the micro-batch is done),
        # and its nodes' transient gradients beyond what they keep.
        held = [t.held._replace(moved_bytes=moved[s], grad_temp_bytes=temp[s],
                                outputs_bytes=outputs[s],
                                backward_bytes=sent[s] + moved[s] +
                                max(0, transient[s] + stays[s] - saved[s]))
                for s, t in enumerate(tallies)]
        rows = self.memory.rows
        if rows is None or len(rows) != k:
            return held
        key = tuple(frozenset(r) for r in reads)
        if key not in self._arms:
            self._arms[key] = _timeline_arms(rows, reads)
        return [h._replace(arms=tuple(
            (count, waiting_f * sent[s] + waiting_b * received[s] +
             (h.param_bytes + h.grad_temp_bytes if grads else 0), backward)
            for count, waiting_f, waiting_b, grads, backward in self._arms[key][s]))
            for s, h in enumerate(held)]

    def memory_over(self, stage_of: Sequence[int]) -> list[float]:
        """Per stage, the bytes its exact need exceeds its device's memory by (<= 0: it fits)."""
        if all(self.unbounded):
            return [-math.inf] * self.k
        return [c.memory_bytes - d.memory_bytes
                for c, d in zip(self.stage_costs(stage_of), self.devices)]

    def bottleneck_s(self, stage_of: Sequence[int],
                     spend: Callable[[int], None] | None = None) -> float:
        """The exact bottleneck of a partition (`spend`: see `stage_costs`); inf where a stage
        does not fit its device (the relaxed views may have priced its memory lower)."""
        costs = self.stage_costs(stage_of, spend)
        if any(c.memory_bytes > d.memory_bytes for c, d in zip(costs, self.devices)):
            return math.inf
        return max(c.time_s for c in costs)

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
