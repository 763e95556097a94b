"""Random costed graphs, and the brute-force partitioner that is `fxpipe.passes.partition`'s oracle.

    from hypothesis import given
    from fxpipe.testing import dags, brute_force_partition

    @given(dags(max_nodes=10))
    def test_my_partitioner(case):
        best = brute_force_partition(case.graph, case.devices)
        assert my_partition(case.graph, case.devices).bottleneck_s >= best.bottleneck_s

`dags` draws a `DagCase`: a `CostGraph` (graph inputs first, random edges, costs and sizes) and
the devices to split it over (random names, hence links and kinds, speeds and memory). With
`kinds`, the cuda devices may have their own times per node, like a GPU's against a CPU's. Graphs stay small
enough for `brute_force_partition`, which tries every valid assignment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from hypothesis import strategies as st

from fxpipe.passes.cost_model import (CostGraph, DeviceSpec, Held, KindTimes, LinkFn, Memory,
                                      Pricing, default_link, stage_costs, stage_memory,
                                      stage_nodes)
from fxpipe.passes.device import is_gpu
from fxpipe.passes.errors import PartitionError
from fxpipe.passes.partition import Method, Partition, evaluate

# Names choose the links (cpu-cpu hand-offs, host copies, peer copies) through `default_link`.
DEVICE_NAMES = ("cpu", "cuda:0", "cuda:1")
SPEEDS = (0.5, 1.0, 2.0)


@dataclass(frozen=True)
class DagCase:
    """A costed graph and the devices to partition it over (stage `s` on `devices[s]`)."""

    graph: CostGraph
    devices: tuple[DeviceSpec, ...]
    memory: Memory = Memory()      # what a stage holds (training: `dags(training=True)`)


@st.composite
def dags(draw: st.DrawFn, max_nodes: int = 12, *, min_stages: int = 2, max_stages: int = 4,
         max_inputs: int = 2, max_assignments: int = 50_000, memory: bool = True,
         kinds: bool = True, training: bool = False) -> DagCase:
    """A random `DagCase` of at most `max_nodes` nodes (inputs included) and 2..4 devices.

    The number of computing nodes `m` is kept to `stages ** m <= max_assignments`, which bounds
    `brute_force_partition`'s work. Times are multiples of 0.1 ms (ties happen, on purpose),
    values up to 16 MB (transfers as slow as compute), parameters up to 4 MB. Sinks are graph
    outputs, and so is any other node with probability 1/4. With `memory`, a device's memory may
    be a fraction of what the whole graph needs, so that some cases cannot fit. With `kinds`, half
    the cases give the cuda kinds a GPU-like column: 20x faster than the reference on nodes of
    1 ms or more, barely faster (0.9x) on smaller ones, split 1:2 into forward and backward.
    With `training`, nodes keep up to 16 MB for their backward (their output among it, or not),
    some may be recomputed alone, stages hold 1 to 4 micro-batches in flight (or as a GPipe or
    1F1B timetable of 1 to 4 micro-batches has them: `Memory.rows`) and the optimizer's state,
    and recompute "never", "always" or "auto"; without, a call runs 1 to 4 micro-batches. A node's output may be a view of a value it reads (no new memory: its base
    lives as long as it does).
    """
    k = draw(st.integers(min_stages, max_stages), label="stages")
    inputs = draw(st.integers(0, max_inputs), label="inputs")
    most = min(max_nodes - inputs, int(math.log(max_assignments) / math.log(k)))
    computing = draw(st.integers(k, max(k, most)), label="computing nodes")
    n = inputs + computing
    preds = [()] * inputs
    for i in range(inputs, n):
        chosen = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        preds.append(tuple(sorted(chosen)))
    has_succ = {p for ps in preds for p in ps}
    views = tuple((draw(st.sampled_from(ps)),) if ps and draw(st.integers(0, 3)) == 0 else ()
                  for ps in preds)
    time_s = [0.0] * inputs + [draw(st.integers(0, 20)) * 1e-4 for _ in range(computing)]
    out_bytes = [draw(st.integers(0, 8)) * 2_000_000 for _ in range(n)]
    param_bytes = [0] * inputs + [draw(st.integers(0, 4)) * 1_000_000 for _ in range(computing)]
    to_output = [i >= inputs and (i not in has_succ or draw(st.integers(0, 3)) == 0)
                 for i in range(n)]
    columns = {}
    if kinds and draw(st.booleans(), label="gpu-like kinds"):
        gpu = [t / 20 if t >= 1e-3 else t * 0.9 for t in time_s]
        column = KindTimes(tuple(t / 3 for t in gpu), tuple(2 * t / 3 for t in gpu))
        columns = {name: column for name in DEVICE_NAMES if is_gpu(name)}
    graph = CostGraph(names=tuple(f"x{i}" if i < inputs else f"n{i}" for i in range(n)),
                      time_s=tuple(time_s), out_bytes=tuple(out_bytes),
                      param_bytes=tuple(param_bytes), preds=tuple(preds),
                      is_input=tuple(i < inputs for i in range(n)), to_output=tuple(to_output),
                      kinds=columns, saved_bytes=tuple(
                          draw(st.integers(0, 8)) * 2_000_000 if training and i >= inputs else 0
                          for i in range(n)),
                      output_kept=tuple(training and i >= inputs and draw(st.booleans())
                                        for i in range(n)),
                      recomputable=tuple(training and i >= inputs and draw(st.booleans())
                                         for i in range(n)),
                      new_bytes=tuple(0 if v else b for v, b in zip(views, out_bytes)),
                      views=views)
    rules = Memory(microbatches=draw(st.integers(1, 4), label="micro-batches"))
    if training:
        rules = Memory(in_flight=tuple(draw(st.integers(1, 4)) for _ in range(k)), training=True,
                       optimizer_state=draw(st.sampled_from((0.0, 2.0))),
                       recompute=draw(st.sampled_from(("never", "always", "auto"))))
        schedule = draw(st.sampled_from((None, "gpipe", "1f1b")), label="timetable")
        if schedule is not None:     # what stages hold read off a timetable, as planning does
            from fxpipe.plans.prediction import held_after_first_backward, in_flight
            from fxpipe.runtime.schedules import timetable_for
            m = rules.microbatches
            rules = replace(rules, in_flight=tuple(in_flight(True, schedule, m, k)),
                            after_backward=tuple(held_after_first_backward(schedule, m, k)),
                            rows=tuple(tuple((a.phase.value, a.microbatch) for a in actions)
                                       for actions in timetable_for(schedule, k, m,
                                                                    backward=True)))
    need = (sum(param_bytes) + 2 * sum(out_bytes) if not training else
            rules.need(0, Held(sum(param_bytes), 0, sum(graph.saved_bytes), sum(out_bytes),
                               sum(out_bytes))))
    devices = []
    for _ in range(k):
        fraction = draw(st.sampled_from((None, None, 0.3, 0.5, 0.8))) if memory else None
        devices.append(DeviceSpec(name=draw(st.sampled_from(DEVICE_NAMES)),
                                  speed=draw(st.sampled_from(SPEEDS)),
                                  memory_bytes=math.inf if fraction is None else need * fraction))
    return DagCase(graph, tuple(devices), rules)


@st.composite
def assignments(draw: st.DrawFn, graph: CostGraph, num_stages: int) -> list[int]:
    """A valid stage for every computing node of `graph` (-1 for inputs): never before a stage
    it reads from; stages may be empty."""
    stage_of = [-1] * len(graph)
    for i in graph.compute_nodes:
        earliest = max((stage_of[p] for p in graph.preds[i] if not graph.is_input[p]), default=0)
        stage_of[i] = draw(st.integers(earliest, num_stages - 1))
    return stage_of


@st.composite
def recomputing_dags(draw: st.DrawFn, **kwargs) -> tuple[DagCase, list[int]]:
    """A `dags(training=True, **kwargs)` case where recomputing pays (nodes save four times as
    much, four micro-batches in flight, recompute "auto"), and an assignment of it
    (`assignments`) whose every stage must recompute to fit: each device's memory is drawn
    between the most of what its stage needs recomputing whole and recomputing every node it
    may (`cost_model.stage_memory`), and what it needs keeping its activations. Recomputing
    part of a stage then decides which partitions fit and what they cost."""
    case = draw(dags(training=True, **kwargs))
    graph = replace(case.graph, saved_bytes=tuple(4 * b for b in case.graph.saved_bytes))
    memory = replace(case.memory, recompute="auto", in_flight=4)
    stage_of = draw(assignments(graph, len(case.devices)))
    devices = []
    for s, (d, t) in enumerate(zip(case.devices, Pricing(graph, case.devices, memory=memory)
                                   .tally(stage_of))):
        members = [i for i in graph.compute_nodes if stage_of[i] == s]
        every = stage_memory(stage_nodes(graph, members, graph.time_s),
                             [graph.names[i] for i in members if graph.recomputable[i]])
        least = max(memory.need(s, t.held, True),
                    memory.need_partial(s, t.held, every.kept_bytes, every.transient_bytes))
        room = draw(st.floats(0, 1)) * max(0, memory.need(s, t.held) - least)
        devices.append(replace(d, memory_bytes=least + room))
    return DagCase(graph, tuple(devices), memory), stage_of


def brute_force_partition(graph: CostGraph, devices: Sequence[DeviceSpec],
                          link: LinkFn = default_link, *,
                          memory: Memory = Memory()) -> Partition:
    """The optimal partition, by trying every valid assignment: the oracle for `partition`.

    Valid: every computing node in one of `len(devices)` stages, no value flowing backwards, no
    stage empty, every stage within its device's memory. Each is priced by
    `cost_model.stage_costs`; the first with the least bottleneck (in the order tried: nodes in
    graph order, stages in increasing order) wins. O(k^n) for n computing nodes: small graphs only.
    Raises PartitionError when no assignment is valid.
    """
    devices = tuple(devices)
    k = len(devices)
    computing = graph.compute_nodes
    if not 1 <= k <= len(computing):
        raise PartitionError(f"cannot split {len(computing)} computing nodes into {k} stages")
    stage_of = [-1] * len(graph)
    used = [0] * k
    best: list = [math.inf, None, 0]     # bottleneck, assignment, assignments tried

    def assign(position: int) -> None:
        if position == len(computing):
            if 0 in used:
                return
            best[2] += 1
            costs = stage_costs(graph, stage_of, devices, link, memory=memory)
            if all(c.memory_bytes <= d.memory_bytes for c, d in zip(costs, devices)):
                bottleneck = max(c.time_s for c in costs)
                if bottleneck < best[0]:
                    best[0], best[1] = bottleneck, list(stage_of)
            return
        if sum(u == 0 for u in used) > len(computing) - position:
            return                       # too few nodes left to fill every stage
        i = computing[position]
        first = max((stage_of[p] for p in graph.preds[i] if not graph.is_input[p]), default=0)
        for s in range(first, k):
            stage_of[i] = s
            used[s] += 1
            assign(position + 1)
            used[s] -= 1
        stage_of[i] = -1

    assign(0)
    if best[1] is None:
        raise PartitionError(f"none of the {best[2]} valid assignments fits the devices' memory")
    return evaluate(graph, best[1], devices, link, optimal=True,
                    method=Method(found_by="brute force",
                                  proof=f"all {best[2]} valid assignments tried", optimal=True),
                    lower_bound=best[0], memory=memory)


def synthetic_graph(num_nodes: int, *, seed: int = 0) -> CostGraph:
    """A DNN-shaped costed graph of `num_nodes` nodes (one graph input), the same for a seed.

    Built from blocks drawn at random: plain chains, residual blocks (a branch of 2-5 nodes and an
    add), inception blocks (2-4 parallel branches of 1-4 nodes and a concat) and U-Net skips (a
    value kept and read again many blocks later). Times are log-uniform in 10 us .. 1 ms,
    values 10 kB .. 1 MB, parameters 0 .. 1 MB.
    """
    import random

    rng = random.Random(seed)
    preds: list[tuple[int, ...]] = [()]
    kept: list[int] = []

    def add(*inputs: int) -> int:
        preds.append(tuple(sorted(set(inputs))))
        return len(preds) - 1

    current = 0
    while len(preds) < num_nodes:
        kind = rng.choice(("chain", "residual", "inception", "skip"))
        if kind == "chain":
            for _ in range(rng.randint(1, 6)):
                current = add(current)
        elif kind == "residual":
            branch = current
            for _ in range(rng.randint(2, 5)):
                branch = add(branch)
            current = add(current, branch)
        elif kind == "inception":
            ends = []
            for _ in range(rng.randint(2, 4)):
                end = current
                for _ in range(rng.randint(1, 4)):
                    end = add(end)
                ends.append(end)
            current = add(*ends)
        elif kept and rng.random() < 0.5:
            current = add(current, kept.pop())
        else:
            kept.append(current)
            current = add(current)
    preds = preds[:num_nodes]
    n = len(preds)
    read = {p for ps in preds for p in ps}
    return CostGraph(
        names=("x",) + tuple(f"n{i}" for i in range(1, n)),
        time_s=(0.0,) + tuple(10 ** rng.uniform(-5, -3) for _ in range(1, n)),
        out_bytes=tuple(int(10 ** rng.uniform(4, 6)) for _ in range(n)),
        param_bytes=(0,) + tuple(rng.choice((0, 0, rng.randint(0, 10 ** 6))) for _ in range(1, n)),
        preds=tuple(preds), is_input=(True,) + (False,) * (n - 1),
        to_output=tuple(i > 0 and i not in read for i in range(n)))
