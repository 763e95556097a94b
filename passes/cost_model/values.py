"""The cost model's plain values: what a node costs (`NodeCost`), a device (`DeviceSpec`), a link
between two (`Link`, `default_link`), a device kind's times (`KindTimes`), a stage's predicted
cost (`StageCost`), what a call costs its process besides its stages (`HostCosts`), and bytes
as a person reads them (`format_bytes`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

from ..device import is_cpu


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
    the runtime's own, measured: `fxpipe.planning.measure.priced_link`); `fxpipe.runtime.devices.measure_links`
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


@dataclass(frozen=True)
class HostCosts:
    """What a call through stages on threads of one process costs that process besides the
    stages' own work, measured on the machine (`fxpipe.measure.host_costs`; zeros: not priced).

    `start_s`: a call's own start and end (the runtime waking its workers and keeping its
    record, the batch's rows counted);
    `split_s` and `merge_s`: per micro-batch, slicing one input leaf off the batch and putting
    one output leaf back into the merged output. So a call's own work is `call_s` (drawn before
    the first action in the predicted timeline, `fxpipe.search.predict_slots`).

    `lock_s`: per node, the most of its forward a stage's thread spends holding the
    interpreter lock (Python, argument parsing, the dispatch up to the kernel, which releases
    it): one thread of the process holds it at a time, so a node that takes less holds it
    throughout. A forward action holds it `lock_share` of its time: `lock_s` per node (all of
    its forward compute where that is less) and its hand-offs (a queue's Python) wholly; a
    backward its hand-offs and `backward_lock_s` per node (autograd's engine runs without the
    lock, but not all that a backward runs does). The simulator lets actions running at once
    hold it one at a time, each waiting for the others' holds (`fxpipe.schedules.simulate`'s
    `lock`): stages of tiny nodes take turns where a model of large ones overlaps. The
    partitioner balances compute and transfers alone (its relaxed views cannot carry a shared
    resource); search's exact simulation of each candidate carries the lock, so the
    configuration chosen and the step predicted do. `wake_s`: how long a thread waiting for
    the lock takes to wake once it is let go; a node lets it go for its kernel, but no other
    thread has it before then, so a node keeps it `lock_s + wake_s` (a node quicker than
    that, all of its time). Measured on the graph itself (`fxpipe.planning.host.lock_held`),
    the wake-up is in `lock_s` and `wake_s` is 0.

    `train_action_s`: in a train step, what each action costs the runtime besides its
    stage's work and hand-offs (keeping what the backward needs, starting it, the loss of a
    micro-batch), all of it Python: added to each action's time, holding the lock.
    """

    start_s: float = 0.0
    split_s: float = 0.0
    merge_s: float = 0.0
    lock_s: float = 0.0
    wake_s: float = 0.0
    backward_lock_s: float = 0.0
    train_action_s: float = 0.0

    def call_s(self, chunks: int, inputs: int, outputs: int) -> float:
        """A call's own work: its start and end, `inputs` leaves split into `chunks`
        micro-batches and `outputs` leaves merged back."""
        return self.start_s + chunks * (inputs * self.split_s + outputs * self.merge_s)

    def lock_share(self, stage: StageCost, forward: bool) -> float:
        """The share of a `stage`'s forward (or backward) action spent holding the lock."""
        step_s = stage.forward_step_s if forward else stage.backward_step_s
        if step_s <= 0 or not self.holds_lock:
            return 0.0
        held = stage.comm_s + (min(stage.compute_s - stage.backward_s,
                                   stage.num_nodes * (self.lock_s + self.wake_s))
                               if forward else
                               min(stage.backward_s, stage.num_nodes * self.backward_lock_s))
        return min(1.0, held / step_s)

    @property
    def holds_lock(self) -> bool:
        """Whether the interpreter lock is priced."""
        return self.lock_s > 0 or self.backward_lock_s > 0


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
