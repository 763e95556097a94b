"""The record of a run (`Run`): what the latest run did, action by action, for reports and
traces; a failed run's too. A GPU stage's actions are recorded by their CUDA events, read when
the record is first read, so a call never waits for its GPU work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fxpipe.passes.device import Event

from .schedules import Action, Slot


@dataclass
class Run:
    """What the latest run did, action by action (seconds from its start), for reports and traces.

    A run that stopped early keeps the actions that finished, and `error` says what stopped it.
    A GPU stage's actions are read off their CUDA events when `slots` is first read, which waits
    for that work (`gpu_done`).
    """

    wall_s: float = 0.0
    num_stages: int = 0
    microbatches: int = 0   # a call's or train step's (fewer than chunks for a smaller batch)
    error: str | None = None
    # An asynchronous `stream_train`'s items, in order: the optimizer steps taken before each
    # item's forward (the weights it used), and the steps between those and its own update.
    versions: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    # Measured when the pipeline tracks memory (`Pipeline.measure_memory`; None otherwise): each
    # stage's peak, its parameters and buffers included (`runtime.memory.Measured`), and each
    # GPU's allocator peak over the run.
    peak_bytes: dict[int, int] | None = None
    device_peak_bytes: dict[str, int] = field(default_factory=dict)
    # A Pipeline's call or train step: the batch's rows, the whole call's time (splitting and
    # merging included), and where it ran the example's rows in the plan's mode, after its
    # first call: the speed-up measured so far (the model's time at compile over the median of
    # the latest calls, `Plan.observed`) beside the one the plan claims (None: none claimed).
    rows: int | None = None
    call_s: float | None = None
    speedup: float | None = None
    predicted_speedup: float | None = None
    started: float = field(default_factory=time.perf_counter, repr=False, compare=False)
    _slots: list[Slot] = field(default_factory=list, repr=False)
    # GPU actions not read yet: (action, seconds at its stream's origin event, that event,
    # the events before and after the action), all on one stream per stage.
    _gpu: list[tuple] = field(default_factory=list, repr=False, compare=False)

    @property
    def slots(self) -> list[Slot]:
        """Every action that finished, by start time."""
        if self._gpu:
            pending, self._gpu = self._gpu, []
            last = {id(origin): ended for _, _, origin, _, ended in pending}
            for ended in last.values():     # a stream's events complete in order
                ended.synchronize()
            self._slots += [Slot(action, start_s + origin.elapsed_time(began) / 1e3,
                                 start_s + origin.elapsed_time(ended) / 1e3)
                            for action, start_s, origin, began, ended in pending]
            self._slots.sort(key=lambda slot: (slot.start_s, slot.action.stage))
        return self._slots

    def gpu_done(self, action: Action, start_s: float, origin: Event,
                 began: Event, ended: Event) -> None:
        """Record a GPU action by its events, read later (see `slots`)."""
        self._gpu.append((action, start_s, origin, began, ended))

    @property
    def failed(self) -> bool:
        return self.error is not None

    def clock(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.started

    def done(self, action: Action, began: float) -> None:
        """Record `action`, which began at `began` (its inputs arrived) and just finished."""
        self._slots.append(Slot(action, began, self.clock()))
