"""`Pricing`: the cost rules of one device order, exact and relaxed; `stage_costs` prices one
partition."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from ..device import is_gpu, same_memory
from .graph import CostGraph
from .memory import WAIT_SLACK, Held, Memory, _timeline_arms, forward_peak
from .recompute import Choice, choose_recomputed, stage_nodes
from .tally import StageTally, _least
from .values import DRIVER_DEVICE, DeviceSpec, Link, LinkFn, StageCost, default_link


def stage_costs(graph: CostGraph, stage_of: Sequence[int], devices: Sequence[DeviceSpec],
                link: LinkFn = default_link, *, memory: Memory = Memory()) -> list[StageCost]:
    """The cost of every stage, given `stage_of[i]` for every compute node (ignored for inputs).

    A value is sent once per (producer, receiving stage), however many nodes there read it; graph
    inputs come from the driver and graph outputs go back to it, and both ends of a transfer pay
    for it. Memory follows `memory` (`Memory.need`); a stage recomputes as `Memory.recomputes`
    says (a stage that fits neither way is priced over its device). See `Pricing`.
    """
    return Pricing(graph, devices, link, memory).stage_costs(stage_of)


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
