"""Choosing a configuration: how many stages, micro-batches and which schedule.

For each configuration asked for (`"auto"` opens a dimension), the graph costed as that
configuration's stages would run it (their micro-batch size, their threads) is partitioned, and
the schedule simulator predicts one step (a call in inference, a `train_step` in training) with the
timetable the runtime would execute. The fastest configuration that fits in memory wins, the
smaller one (fewer stages, fewer micro-batches) among those within `TIE` of it; and none is chosen
that is predicted slower than the model run whole without a pipeline, which is itself a candidate:
one stage, one micro-batch, the caller's threads.

Everything here is plain data and pure functions of it; measuring is the caller's (`measure`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from fxpipe.passes.cost_model import CostGraph, DeviceSpec, LinkFn, Memory
from fxpipe.passes.device import is_cpu
from fxpipe.passes.errors import PartitionError
from fxpipe.passes.partition import Partition, partition

from .schedules import SCHEDULES, Phase, Slot, gpipe, simulate, timetable_for

TIE = 0.02     # configurations within 2% of the fastest count as equally fast


@dataclass(frozen=True)
class Config:
    """One configuration: stages on the first `num_stages` devices, `chunks` micro-batches,
    `schedule` in training, `threads` intra-op threads on each CPU stage."""

    num_stages: int
    chunks: int
    schedule: str
    threads: int


@dataclass(frozen=True)
class Candidate:
    """A configuration and what the plan predicts for it (None: it does not fit)."""

    config: Config
    predicted_s: float | None       # one step, whole batch
    memory_bytes: int               # the fullest stage's memory
    partition: Partition | None = None
    problem: str = ""               # why it cannot run, when it cannot

    def __str__(self) -> str:
        c = self.config
        return (f"{c.num_stages} stage{'s' * (c.num_stages > 1)} x {c.chunks} "
                f"micro-batch{'es' * (c.chunks > 1)} ({c.schedule}, {c.threads} "
                f"thread{'s' * (c.threads > 1)})")


@dataclass(frozen=True)
class Costed:
    """The graph costed for one micro-batch size and thread count: forward times alone, and
    forward plus backward (the same graph in inference)."""

    forward: CostGraph
    step: CostGraph


def in_flight(training: bool, schedule: str, chunks: int, num_stages: int) -> list[int]:
    """Micro-batches of activations each stage holds at once, read off the timetable itself."""
    if not training:
        return [1] * num_stages
    timetable = timetable_for(schedule, num_stages, chunks, backward=True)
    peaks = []
    for actions in timetable:
        held = peak = 0
        for action in actions:
            held += 1 if action.phase is Phase.FORWARD else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def predict_slots(part: Partition, chunks: int, schedule: str, training: bool,
                  reads_from: Mapping[int, Sequence[int]], cores: float | None = None) -> list[Slot]:
    """The timeline the cost model predicts for one step (a call, or a `train_step`): the
    timetable the runtime would execute, each forward action taking its stage's
    `forward_step_s` and each backward action its `backward_step_s`. With `cores`, CPU stages
    whose threads add up to more share them while they run at once (`simulate`)."""
    k = part.num_stages
    timetable = (timetable_for(schedule, k, chunks, backward=True) if training
                 else gpipe(k, chunks))
    return simulate(timetable, lambda a: (part.stages[a.stage].forward_step_s
                                          if a.phase is Phase.FORWARD
                                          else part.stages[a.stage].backward_step_s),
                    reads_from, cores=cores, demand=cpu_demand(part.devices))


def cpu_demand(devices: Sequence[DeviceSpec]) -> list[int]:
    """The cores each stage's device asks for: a CPU stage's intra-op threads; a GPU stage one,
    for the thread that launches its kernels (starved of a core, it leaves its GPU idle)."""
    return [(d.threads or 1) if is_cpu(d.name) else 1 for d in devices]


def predict_step_s(costed: Costed, part: Partition, chunks: int, schedule: str,
                   training: bool, cores: float | None = None) -> float:
    """One step's predicted time (`predict_slots`, its last action's end)."""
    stage_of = [part.stage_of.get(name, -1) for name in costed.forward.names]
    reads = reads_from(costed.forward, stage_of, part.num_stages, training)
    return max((slot.end_s for slot in predict_slots(part, chunks, schedule, training, reads,
                                                     cores)), default=0.0)


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
             training: bool, cores: float | None = None, memory: Memory = Memory()) -> Candidate:
    """Partition and predict one configuration (on `cores` CPU cores the CPU stages share); a
    candidate that does not fit says why. `memory`'s rules hold with this configuration's
    micro-batches in flight."""
    specs = list(devices[:config.num_stages])
    factors = in_flight(training, config.schedule, config.chunks, config.num_stages)
    try:
        part = partition(costed.step, specs, link,
                         memory=replace(memory, in_flight=tuple(factors)))
    except PartitionError as e:
        return Candidate(config, None, 0, None, str(e).split("\n")[0])
    predicted = predict_step_s(costed, part, config.chunks, config.schedule, training, cores)
    return Candidate(config, predicted, max(s.memory_bytes for s in part.stages), part)


def choose(candidates: Sequence[Candidate], unpipelined: Candidate | None) -> tuple[Candidate, str]:
    """The candidate to run and why: the fastest that fits, the smallest among those within
    `TIE` of it; the model as is (`unpipelined`) when nothing is predicted faster than it."""
    fitting = [c for c in candidates if c.predicted_s is not None]
    if not fitting and unpipelined is not None and unpipelined.predicted_s is not None:
        return unpipelined, "no pipeline is predicted faster than the model run whole (none fits)"
    if not fitting:
        raise PartitionError("no configuration fits: " + "; ".join(
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
        return best, "the only configuration asked for"
    why = "fastest predicted" if best.predicted_s == best_s else (
        f"smallest within {TIE:.0%} of the fastest predicted")
    return best, why


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
