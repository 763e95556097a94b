"""What a stage holds and what that needs: `Held` (the bytes), `Memory` (the rules pricing them,
inference and training, whole recomputation), one forward's live set (`forward_peak`), a stage
priced alone (`standalone_held`), how late a reader may take what a stage sent (`WAIT_SLACK`),
and what a training stage holds as each action of the timetable starts (`_timeline_arms`)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from .graph import CostGraph


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
