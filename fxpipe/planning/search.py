"""Choosing a configuration: how many stages, micro-batches and which schedule.

For each configuration asked for (`"auto"` opens a dimension), the graph costed as that
configuration's stages would run it (their micro-batch size, their threads) is partitioned, and
the schedule simulator predicts one step (a call in inference, a `train_step` in training) with the
timetable the runtime would execute. The fastest configuration that fits in memory wins, the
smaller one (fewer stages, fewer micro-batches) among those within `TIE` of it; and none is chosen
that is predicted slower than the model run whole without a pipeline, which is itself a candidate:
one stage, one micro-batch, the caller's threads.

A node costing more than a stage's share of the graph bounds every partition's bottleneck from
below: each configuration is also partitioned with such nodes split along their output features
(`fxpipe.passes.split_wide`), and keeps the split where it lowers the predicted bottleneck. A
stage doing next to nothing (under `NEAR_EMPTY` of the bottleneck) is a device idling: with
`num_stages="auto"` fewer stages within `TIE` win anyway; the plan's reason names such a stage.

Everything here is plain data and pure functions of it; measuring is the caller's (`measure`).

`chunks` left out is 2 per stage, at most the rows (`default_chunks`, measuring nothing; 1 where
micro-batches compute something else, and the plan then warns that its stages take turns). "auto"
never weighs two stages on one GPU (`stage_counts`). Each configuration is also partitioned with
its too-costly nodes split into 2 to one-per-stage parts, and in inference 2 and 4 per stage
(`part_counts`: finer parts fill what the rest leaves of a stage; `wide_nodes` caps the parts), the
best kept where it lowers the bottleneck by over 2% (`Candidate.split`). A stage under `NEAR_EMPTY`
of the bottleneck stays only where fewer stages are predicted slower or `num_stages` was fixed,
named in the plan's reason and print (`notes`).

Never one measured slower either (`fxpipe.planning.build._raced`): the shortlist, the chosen and
up to two more predicted within 1.25x of it whose costs were measured (not fitted), each realized
from the prepared graph, raced with the model; the
fastest measured is kept where it beats the model by 2%, else the model as is, realized from it. On
CPUs a model's run that got under 85% of its threads' time means a busy machine: the model as is.
`PlanRecord.raced` keeps predicted and measured times, which `print(plan)` shows. The model as
is is a candidate only where its tensors are all on the first device (its one stage holds them
there, not copies), so a plan is never predicted slower than not pipelining there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.fx as fx

from fxpipe.passes.cost_model import (CostGraph, DeviceSpec, HostCosts, LinkFn, Memory,
                                      cost_graph, cublas_workspace_bytes)
from fxpipe.passes.device import gpu_capability, is_cpu, is_gpu
from fxpipe.passes.errors import PartitionError
from fxpipe.passes.partition import Partition, partition
from fxpipe.passes.split_wide import split_wide, wide_nodes

from ..plans.prediction import (NEAR_EMPTY, Candidate, Config, gpu_pools, held_after_first_backward,
                                in_flight, predict_slots)
from ..runtime.schedules import SCHEDULES, timetable_for

TIE = 0.02     # configurations within 2% of the fastest count as equally fast


@dataclass(frozen=True)
class Costed:
    """The graph costed for one micro-batch size and thread count: forward times alone, and
    forward plus backward (the same graph in inference), and what a call costs the process
    besides its stages on those threads (`HostCosts`; zeros: not priced)."""

    forward: CostGraph
    step: CostGraph
    host: HostCosts = HostCosts()


def gpu_overhead_bytes(devices: Sequence[DeviceSpec]) -> int:
    """What a stage on one of `devices`' GPUs holds besides its values: cuBLAS's workspace on
    its stream, by the GPU's architecture (0 without a GPU)."""
    gpus = [torch.device(d.name) for d in devices if is_gpu(d.name)]
    if not gpus:
        return 0
    return max(cublas_workspace_bytes(gpu_capability(g)) for g in gpus)


def as_is_config(schedule: str = "gpipe") -> Config:
    """The model as it is: one stage, the whole batch, the caller's threads."""
    return Config(1, 1, schedule, torch.get_num_threads())


def stage_counts(specs: Sequence[DeviceSpec], num_stages: int | str | None) -> list[int]:
    """The stage counts to consider: the one asked for (None: every device), or with "auto"
    each count whose stages (the first devices) put no two on one GPU. Stages on one GPU share
    its work (`gpu_pools`) and gain at most the overlap of their launches, which their threads
    contend for under the GIL; measured on an H100 (`benchmarks/gpu.py`), two stages on it ran
    at 0.09x to 0.6x of the model, so "auto" never weighs them; asked for, they run."""
    if num_stages != "auto":
        return [num_stages or len(specs)]
    return [k for k in range(1, len(specs) + 1) if not gpu_pools(specs[:k])]


def predict_step_s(costed: Costed, part: Partition, chunks: int, schedule: str,
                   training: bool, cores: float | None = None) -> float:
    """One step's predicted time (`predict_slots` with `costed.host`, its last action's end)."""
    stage_of = [part.stage_of.get(name, -1) for name in costed.forward.names]
    reads = reads_from(costed.forward, stage_of, part.num_stages, training)
    graph = costed.forward
    leaves = (sum(graph.is_input), sum(graph.to_output))
    return max((slot.end_s for slot in predict_slots(part, chunks, schedule, training, reads,
                                                     cores, costed.host, leaves)),
               default=0.0)


def reads_from(graph: CostGraph, stage_of: Sequence[int], num_stages: int,
               training: bool) -> dict[int, list[int]]:
    """Which stages each stage reads from; in training the last stage also reads every graph
    output, since it computes the loss."""
    reads: dict[int, set[int]] = {s: set() for s in range(num_stages)}
    for i in graph.compute_nodes:
        for p in graph.preds[i]:
            if not graph.is_input[p] and stage_of[p] != stage_of[i]:
                reads[stage_of[i]].add(stage_of[p])
        if training and graph.to_output[i] and stage_of[i] != num_stages - 1:
            reads[num_stages - 1].add(stage_of[i])
    return {s: sorted(r) for s, r in reads.items()}


def consider(config: Config, costed: Costed, devices: Sequence[DeviceSpec], link: LinkFn,
             training: bool, cores: float | None = None, memory: Memory = Memory(),
             graph: fx.GraphModule | None = None) -> Candidate:
    """Partition and predict one configuration (on `cores` CPU cores the CPU stages share); a
    candidate that does not fit says why. `memory`'s rules hold with this configuration's
    micro-batches in flight. With `graph` (costed as `costed`), where the configuration fits,
    nodes costing more than a stage's share are split (`split_wide`, on a copy) into each of
    `part_counts` parts, the best kept where it lowers the bottleneck by more than `TIE`: the
    candidate then names them (`Candidate.split`, what `split_chosen` does)."""
    best = plain = _consider(config, costed, devices, link, training, cores, memory)
    if graph is None or plain.partition is None:    # a graph too small or too big stays so
        return plain
    most = wide_nodes(graph, config.num_stages, training)
    for count in part_counts(config.num_stages, max(most.values(), default=0)):
        # The parts that balance best depend on what the rest of the graph leaves to them.
        parts = {name: min(count, top) for name, top in most.items()}
        nodes = fx.Graph()
        nodes.output(nodes.graph_copy(graph.graph, {}))    # the nodes keep their names and meta
        split = _consider(config, _costed(split_wide(fx.GraphModule(graph, nodes), parts),
                                          costed, training),
                          devices, link, training, cores, memory)
        if split.partition is not None and \
                split.partition.bottleneck_s < best.partition.bottleneck_s:
            best = replace(split, split=tuple(parts.items()))
    if best.partition.bottleneck_s > plain.partition.bottleneck_s * (1 - TIE):
        return plain        # a gain within TIE is within what the split's pricing leaves out
    return best


def part_counts(num_stages: int, most: int) -> list[int]:
    """The numbers of parts `consider` tries for nodes split on `num_stages` stages, up to
    `most`: 2 to one per stage, then 2 and 4 per stage. The bottleneck is not monotone in the
    count (on 2 stages a head of 1.5 shares gains nothing from 2 parts, and from 4 balances),
    and each count costs a partition: these few cover the coarse and the fine."""
    counts = {*range(2, num_stages + 1), 2 * num_stages, 4 * num_stages}
    return sorted(c for c in counts if c <= most)


def split_chosen(gm: fx.GraphModule, chosen: Candidate) -> None:
    """Split `gm`'s nodes, in place, as the chosen candidate was partitioned (`Candidate.split`)."""
    if chosen.split:
        split_wide(gm, dict(chosen.split))
        missing = set(chosen.partition.stage_of) - {n.name for n in gm.graph.nodes}
        assert not missing, f"the split graph lacks the partitioned nodes {sorted(missing)}"


def _costed(gm: fx.GraphModule, like: Costed, training: bool) -> Costed:
    """`gm` costed from its nodes' costs, with the device kinds and the host costs `like`
    carries (a split graph's call costs the process what the unsplit one's does)."""
    kinds = [kind for kind in like.forward.kinds if kind is not None]
    return Costed(cost_graph(gm, kinds=kinds), cost_graph(gm, training=training, kinds=kinds),
                  like.host)


def _consider(config: Config, costed: Costed, devices: Sequence[DeviceSpec], link: LinkFn,
              training: bool, cores: float | None, memory: Memory) -> Candidate:
    """The configuration partitioned and predicted on the graph as `costed` (see `consider`)."""
    specs = list(devices[:config.num_stages])
    factors = in_flight(training, config.schedule, config.chunks, config.num_stages)
    try:
        after = rows = None
        if training:
            after = tuple(held_after_first_backward(config.schedule, config.chunks,
                                                    config.num_stages))
            rows = tuple(tuple((a.phase.value, a.microbatch) for a in actions)
                         for actions in timetable_for(config.schedule, config.num_stages,
                                                      config.chunks, backward=True))
        part = partition(costed.step, specs, link,
                         memory=replace(memory, in_flight=tuple(factors), after_backward=after,
                                        rows=rows, microbatches=config.chunks,
                                        gpu_overhead_bytes=gpu_overhead_bytes(specs)))
    except PartitionError as e:
        # One line, for the table of configurations: the problem, then its details and fix.
        return Candidate(config, None, 0, None, "; ".join(
            line.strip() for line in str(e).splitlines() if line.strip()))
    predicted = predict_step_s(costed, part, config.chunks, config.schedule, training, cores)
    return Candidate(config, predicted, max(s.memory_bytes for s in part.stages), part)


def choose(candidates: Sequence[Candidate], unpipelined: Candidate | None) -> tuple[Candidate, str]:
    """The candidate to run and why: the fastest that fits, the smallest among those within
    `TIE` of it; the model as is (`unpipelined`) when nothing is predicted faster than it."""
    fitting = [c for c in candidates if c.predicted_s is not None]
    if not fitting and unpipelined is not None and unpipelined.predicted_s is not None:
        return unpipelined, "no pipeline is predicted faster than the model run whole (none fits)"
    if not fitting:
        raise PartitionError("no configuration fits\n" + "\n".join(
            f"{c}: {c.problem}" for c in candidates))
    best_s = min(c.predicted_s for c in fitting)
    close = [c for c in fitting if c.predicted_s <= best_s * (1 + TIE)]
    best = min(close, key=lambda c: (c.config.num_stages, c.config.chunks, c.predicted_s))
    if unpipelined is not None and unpipelined.predicted_s is not None and (
            best.predicted_s >= unpipelined.predicted_s * (1 - TIE)):
        return unpipelined, (f"no pipeline is predicted faster than the model run whole "
                             f"({best} predicted {best.predicted_s * 1e3:.3f} ms, the model "
                             f"{unpipelined.predicted_s * 1e3:.3f} ms measured)")
    if len(fitting) == 1:
        why = "the only configuration asked for"
    else:
        why = "fastest predicted" if best.predicted_s == best_s else (
            f"smallest within {TIE:.0%} of the fastest predicted")
    idle = best.near_empty()
    if idle:
        fixed = len({c.config.num_stages for c in candidates}) == 1
        times = ", ".join(f"{best.partition.stages[s].time_s * 1e3:.3f}" for s in idle)
        why += (f"; stage{'s' * (len(idle) > 1)} {', '.join(map(str, idle))} "
                f"{'do' if len(idle) > 1 else 'does'} next to nothing ({times} ms per "
                f"micro-batch, under {NEAR_EMPTY:.0%} of the bottleneck): " +
                (f"num_stages={best.config.num_stages} was asked for; num_stages='auto' uses "
                 f"the fewest stages within {TIE:.0%} of the fastest" if fixed else
                 f"fewer stages are predicted over {TIE:.0%} slower, or do not fit"))
    return best, why


def default_chunks(rows: int, stages: int) -> int:
    """The micro-batches of a call where `chunks` is not given: 2 per stage, so that every
    stage has one to work on while the next one's arrives (one alone runs the stages one at a
    time), at most the batch's rows; 1 on one stage. A rule measuring nothing."""
    return max(1, min(rows, 2 * stages)) if stages > 1 else 1


def chunk_options(rows: int, max_stages: int) -> list[int]:
    """Micro-batch counts worth trying: powers of two up to 4 per stage (a pipeline's bubble is
    then under a fifth), at most 32 and at most the batch's rows."""
    top = max(1, min(rows, 32, 4 * max_stages))
    return [2 ** i for i in range(int(math.log2(top)) + 1)]


def stage_threads(devices: Sequence[DeviceSpec], num_stages: int, cores: int,
                  fixed: int | None) -> int:
    """The intra-op threads of each CPU stage among the first `num_stages` devices: the cores
    left once each GPU stage has one for its launching thread, shared out."""
    if fixed is not None:
        return fixed
    cpu_stages = sum(is_cpu(d.name) for d in devices[:num_stages])
    gpu_stages = min(num_stages, len(devices)) - cpu_stages
    return max(1, (cores - gpu_stages) // max(1, cpu_stages))


Measure = Callable[[int, int], Costed]    # (chunks, threads) -> the graph costed so
