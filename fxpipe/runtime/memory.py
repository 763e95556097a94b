"""What each stage holds, measured as it runs: the counterpart of the cost model's `Memory`.

    from fxpipe.runtime.memory import track_memory

    with track_memory() as measured:
        pipe(x)                      # or pipe.train_step(...)
    measured.peak_bytes              # {stage: parameters and buffers + most live at once}

Off unless asked (`track_memory`): the runtime enters `stage_memory(stage)` around every
stage's row (`StageExecutor.computing`), which does nothing while no tracking is on.

While tracking is on, every ATen op a stage runs on its thread (its worker, or the caller's for
a pipeline of one stage; a backward's ops too: on a CPU autograd runs them on that thread, on a
GPU it carries the thread's modes to its own) is seen by a `TorchDispatchMode`, and each storage
an op makes that none of its inputs had is charged to that stage until it is freed (a weak
reference on the storage, whichever thread drops it). A stage that reads a storage another stage
made takes it over from its first use (a received value is the receiver's from its forward on,
what waits in a queue still the sender's: on a GPU the receiver copies it as it starts that
forward, the source staying the sender's until then). What the caller's thread makes outside
any stage (the join of the outputs) is charged to the stage whose storage its op read first,
else to nobody (`DRIVER`). A stage's parameters and buffers, made before, are counted once as it
first runs (`state_bytes`). Storages on a GPU count as the caching allocator rounds them
(`gpu_block_bytes`); `device_peak_bytes` is, per GPU, `torch.cuda.max_memory_allocated` over the
tracked run.

Costs a Python call per op: for measuring, not for timing.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxpipe.passes.cost_model import gpu_block_bytes
from fxpipe.passes.device import is_gpu, peak_bytes, reset_peak_bytes, started_devices
from fxpipe.passes.stage import Stage

DRIVER = -1     # the caller's thread outside any stage


@dataclass
class Measured:
    """One tracked run: per stage, its parameters and buffers (`state_bytes`), the most its
    storages took at once besides them (`live_peak_bytes`), and their sum (`peak_bytes`); per
    GPU, the allocator's own peak (`device_peak_bytes`)."""

    state_bytes: dict[int, int] = field(default_factory=dict)
    live_peak_bytes: dict[int, int] = field(default_factory=dict)
    device_peak_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> dict[int, int]:
        stages = sorted(set(self.state_bytes) | set(self.live_peak_bytes) - {DRIVER})
        return {s: self.state_bytes.get(s, 0) + self.live_peak_bytes.get(s, 0) for s in stages}


class _Tracking:
    """The counters of one tracked run, shared by every thread."""

    def __init__(self):
        self.measured = Measured()
        self.lock = threading.RLock()     # a collection may free a storage mid-update
        self.live: dict[int, int] = {}
        self.owned: dict[int, list] = {}       # storage pointer -> [owner, bytes, weakref]
        self.local = threading.local()         # per thread: the stage running, and its mode

    # --- per thread ------------------------------------------------------------------------

    @property
    def owner(self) -> int:
        return getattr(self.local, "stage", DRIVER)

    @contextlib.contextmanager
    def running(self, stage: int) -> Iterator[None]:
        """Charge what this thread makes to `stage` (DRIVER: to the owner of what it reads)."""
        before = self.owner
        self.local.stage = stage
        mode = None
        if not getattr(self.local, "counting", False):
            mode, self.local.counting = _Counting(self), True
            mode.__enter__()
        try:
            yield
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
                self.local.counting = False
            self.local.stage = before

    # --- what the ops make -----------------------------------------------------------------

    def saw(self, args: Any, out: Any) -> None:
        owner = self.owner
        inputs: dict[int, None] = {}
        for t in tree_leaves(args):
            if isinstance(t, torch.Tensor) and _dense(t):
                inputs[t.untyped_storage().data_ptr()] = None
        with self.lock:
            if owner == DRIVER:     # the caller's ops belong with what they read
                owner = next((self.owned[p][0] for p in inputs if p in self.owned), DRIVER)
            else:
                for p in inputs:
                    entry = self.owned.get(p)
                    if entry is not None and entry[0] != owner:
                        self._move(entry, owner)
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor) or not _dense(t):
                    continue
                storage = t.untyped_storage()
                pointer = storage.data_ptr()
                if pointer == 0 or pointer in inputs:
                    continue
                entry = self.owned.get(pointer)
                if entry is not None and entry[2]() is storage:
                    continue        # seen already (an op returning what it made before)
                nbytes = storage.nbytes()
                if is_gpu(t.device):
                    nbytes = gpu_block_bytes(nbytes)
                entry = [owner, nbytes, None]
                entry[2] = weakref.ref(storage, lambda _, e=entry, p=pointer: self._freed(p, e))
                self.owned[pointer] = entry
                self._add(owner, nbytes)

    def _add(self, owner: int, nbytes: int) -> None:
        live = self.live[owner] = self.live.get(owner, 0) + nbytes
        peaks = self.measured.live_peak_bytes
        if live > peaks.get(owner, 0):
            peaks[owner] = live

    def _move(self, entry: list, owner: int) -> None:
        self.live[entry[0]] -= entry[1]
        entry[0] = owner
        self._add(owner, entry[1])

    def _freed(self, pointer: int, entry: list) -> None:
        with self.lock:
            self.live[entry[0]] -= entry[1]
            if self.owned.get(pointer) is entry:
                del self.owned[pointer]


class _Counting(TorchDispatchMode):
    """Tells the tracking what every op on this thread makes and reads."""

    def __init__(self, tracking: _Tracking):
        super().__init__()
        self.tracking = tracking

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracking.saw((args, kwargs), out)
        return out


def _dense(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and t.device.type != "meta"


_ACTIVE: _Tracking | None = None


@contextlib.contextmanager
def track_memory() -> Iterator[Measured]:
    """Measure what each stage holds in the runs inside the block (one process; one tracking
    at a time). Yields the `Measured`, filled as the runs go."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("memory is being tracked already: one track_memory() at a time")
    tracking = _ACTIVE = _Tracking()
    gpus = started_devices()
    for gpu in gpus:
        reset_peak_bytes(gpu)
    try:
        with tracking.running(DRIVER):
            yield tracking.measured
    finally:
        _ACTIVE = None
        for gpu in gpus:
            tracking.measured.device_peak_bytes[str(gpu)] = peak_bytes(gpu)


@contextlib.contextmanager
def tracked(enabled: bool) -> Iterator[Measured | None]:
    """For a runtime recording each run's peaks (`Run`): a `track_memory` block around the run
    when `enabled` (or the caller's, already open), else nothing (None)."""
    if not enabled:
        yield None
    elif _ACTIVE is not None:
        yield _ACTIVE.measured
    else:
        with track_memory() as measured:
            yield measured


def stage_memory(stage: Stage) -> contextlib.AbstractContextManager:
    """What the runtime enters around a stage's work on a thread: nothing unless a
    `track_memory` block is open, else the stage's ops counted as its own."""
    tracking = _ACTIVE
    if tracking is None:
        return contextlib.nullcontext()
    with tracking.lock:
        if stage.index not in tracking.measured.state_bytes:
            tracking.measured.state_bytes[stage.index] = state_bytes(stage.module)
    return tracking.running(stage.index)


def state_bytes(module: torch.nn.Module) -> int:
    """The bytes of a module's parameters and buffers, each storage once (on a GPU as its
    allocator rounds them)."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if _dense(t):
            nbytes = t.untyped_storage().nbytes()
            seen[t.untyped_storage().data_ptr()] = gpu_block_bytes(nbytes) if is_gpu(t.device) \
                else nbytes
    return sum(seen.values())
