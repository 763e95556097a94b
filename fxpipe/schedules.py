"""Pipeline schedules as pure timetables.

A schedule says, for every stage, in which order it runs which micro-batch's forward (`F`) or
backward (`B`). It is plain data: the runtime executes it, the simulator predicts it, tests read
it. `str(Action(1, 3, Phase.FORWARD))` is `1F3`: stage 1, forward, micro-batch 3.

GPipe with 3 stages and 4 micro-batches, forward only (one row per stage):

    stage 0: 0F0 0F1 0F2 0F3
    stage 1: 1F0 1F1 1F2 1F3
    stage 2: 2F0 2F1 2F2 2F3
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class Phase(Enum):
    FORWARD = "F"
    BACKWARD = "B"


class Action(NamedTuple):
    stage: int
    microbatch: int
    phase: Phase

    def __str__(self) -> str:
        return f"{self.stage}{self.phase.value}{self.microbatch}"


Timetable = list[list[Action]]   # timetable[stage] is that stage's actions, in order


def gpipe(num_stages: int, chunks: int, *, backward: bool = False) -> Timetable:
    """Every stage runs all forwards in micro-batch order, then (if `backward`) all backwards."""
    return [[Action(s, m, Phase.FORWARD) for m in range(chunks)] +
            ([Action(s, m, Phase.BACKWARD) for m in range(chunks)] if backward else [])
            for s in range(num_stages)]


def format_timetable(timetable: Timetable) -> str:
    return "\n".join(f"stage {s}: " + " ".join(map(str, actions))
                     for s, actions in enumerate(timetable))
