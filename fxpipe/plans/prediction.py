"""What a configuration is, and what the cost model predicts a partition of it does.

`Config` and `Candidate` are what a plan records of each configuration weighed
(`PlanRecord.considered`, `PlanRecord.chosen`); `predict_slots` is the timeline of one step (the
timetable the runtime would run, each action taking its stage's measured time), `in_flight` the
activations each stage holds at once, and `notes` what `print(plan)` says of the chosen
candidate. Planning (`fxpipe.planning.
search`) weighs configurations with them; plans read them without the planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from fxpipe.passes.cost_model import DeviceSpec, HostCosts
from fxpipe.passes.device import is_cpu, is_gpu
from fxpipe.passes.partition import Partition

from ..runtime.schedules import Phase, Slot, gpipe, simulate, timetable_for

NEAR_EMPTY = 0.05   # a stage under 5% of the bottleneck does next to nothing


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
    split: tuple[tuple[str, int], ...] = ()    # nodes split along their features: (name, parts)

    def __str__(self) -> str:
        c = self.config
        return (f"{c.num_stages} stage{'s' * (c.num_stages > 1)} x {c.chunks} "
                f"micro-batch{'es' * (c.chunks > 1)} ({c.schedule}, {c.threads} "
                f"thread{'s' * (c.threads > 1)})")

    def near_empty(self) -> list[int]:
        """The stages doing next to nothing: under `NEAR_EMPTY` of the bottleneck."""
        part = self.partition
        return [] if part is None or part.num_stages < 2 else [
            s for s, cost in enumerate(part.stages)
            if cost.time_s < NEAR_EMPTY * part.bottleneck_s]


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


def held_after_first_backward(schedule: str, chunks: int, num_stages: int) -> list[int]:
    """Per stage, the most micro-batches of activations held as a backward after its first
    starts (the one it runs among them; 0 where no backward follows the first), read off the
    timetable: by then every gradient exists (`cost_model.Memory.after_backward`)."""
    timetable = timetable_for(schedule, num_stages, chunks, backward=True)
    peaks = []
    for actions in timetable:
        held = peak = 0
        backwards = 0
        for action in actions:
            if action.phase is Phase.FORWARD:
                held += 1
                continue
            if backwards:
                peak = max(peak, held)
            backwards += 1
            held -= 1
        peaks.append(peak)
    return peaks


def predict_slots(part: Partition, chunks: int, schedule: str, training: bool,
                  reads_from: Mapping[int, Sequence[int]], cores: float | None = None,
                  host: HostCosts = HostCosts(), leaves: tuple[int, int] = (0, 0)
                  ) -> list[Slot]:
    """The timeline the cost model predicts for one step (a call, or a `train_step`): the
    timetable the runtime would execute, each forward action taking its stage's
    `forward_step_s` and each backward action its `backward_step_s`. With `cores`, CPU stages
    whose threads add up to more share them while they run at once; stages on one GPU always
    share it (`simulate`). With `host`, the stages' actions hold the interpreter lock their
    `HostCosts.lock_share` of their time, and in training each takes the runtime's own
    `HostCosts.train_action_s` more, holding it throughout; the timeline starts after the
    call's own work (`HostCosts.call_s`, for `leaves`: the call's input and output leaves), so
    that its last action ends when the call returns."""
    k = part.num_stages
    timetable = (timetable_for(schedule, k, chunks, backward=True) if training
                 else gpipe(k, chunks))
    extra_s = host.train_action_s if training else 0.0     # the runtime's own, all held
    step_s, held = {}, {}
    for s, stage in enumerate(part.stages):
        for forward in (True, False):
            own_s = stage.forward_step_s if forward else stage.backward_step_s
            step_s[s, forward] = own_s + extra_s
            held[s, forward] = ((host.lock_share(stage, forward) * own_s + extra_s) /
                                step_s[s, forward] if step_s[s, forward] > 0 else 0.0)
    slots = simulate(timetable, lambda a: step_s[a.stage, a.phase is Phase.FORWARD],
                     reads_from, cores=cores, demand=cpu_demand(part.devices),
                     pools=gpu_pools(part.devices),
                     lock=(lambda a: held[a.stage, a.phase is Phase.FORWARD])
                     if host.holds_lock or extra_s > 0 else None)
    before = host.call_s(chunks, *leaves)
    return [Slot(slot.action, slot.start_s + before, slot.end_s + before) for slot in slots]


def cpu_demand(devices: Sequence[DeviceSpec]) -> list[int]:
    """The cores each stage's device asks for: a CPU stage's intra-op threads; a GPU stage one,
    for the thread that launches its kernels (starved of a core, it leaves its GPU idle)."""
    return [(d.threads or 1) if is_cpu(d.name) else 1 for d in devices]


def gpu_pools(devices: Sequence[DeviceSpec]) -> list[tuple[float, list[int]]]:
    """Each GPU that several stages run on, as a pool they share (`simulate`): their kernels
    queue on one device, so two stages there overlap their launches but not their work."""
    names = [torch.device(d.name) for d in devices]
    return [(1.0, [int(n == gpu) for n in names])
            for gpu in dict.fromkeys(n for n in names if is_gpu(n))
            if names.count(gpu) > 1]


def notes(chosen: Candidate | None) -> list[str]:
    """What `print(plan)` says of the chosen candidate beyond its table: the nodes split to
    balance the stages, and the stages doing next to nothing."""
    if chosen is None:
        return []
    lines = [("split to balance the stages, along output features: " + ", ".join(
        f"{name} into {parts} parts" for name, parts in chosen.split))] if chosen.split else []
    return lines + [f"stage {s} does next to nothing: under {NEAR_EMPTY:.0%} of the bottleneck"
                    for s in chosen.near_empty()]
