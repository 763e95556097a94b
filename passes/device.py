"""What fxpipe asks of a device, in one place: is it the host's CPU or a GPU, which devices
share memory, a GPU stage's stream, waiting for a device's work and timing it, the GPUs whose
generators exist, their allocators' statistics.

A device comes as a name ("cpu", "cuda:1", a DeviceSpec's `name`) or a `torch.device`; every
test of its kind goes through `is_cpu` / `is_gpu`. A CUDA call here names its device, never
the current one. A pass-level module (passes never import fxpipe): `fxpipe.runtime.devices` builds on it.

This is the one module that names `torch.cuda` (tests/test_layers.py holds it): the rest of
fxpipe asks it. Streams follow torchgpipe's: the CPU's stream is None, one that does nothing, so
`use_stream`, `wait_stream` and the events are no-ops (or the host's wait) off the GPU and a
caller need not ask a device's kind. A new device kind (XPU, MPS) is this module's business:
its streams, events, `set_device`, generators and allocator statistics beside CUDA's here.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch

DeviceName = str | torch.device
Stream = torch.cuda.Stream     # a GPU stage's stream; None stands for the CPU's, which does nothing
Event = torch.cuda.Event       # a point in a GPU stream's work


def _type(device: DeviceName) -> str:
    return device.type if isinstance(device, torch.device) else device.split(":")[0]


def is_cpu(device: DeviceName) -> bool:
    """Whether `device` is the host's CPU."""
    return _type(device) == "cpu"


def is_gpu(device: DeviceName) -> bool:
    """Whether `device` is a CUDA GPU."""
    return _type(device) == "cuda"


def same_memory(a: DeviceName, b: DeviceName) -> bool:
    """Whether a tensor on `a` is usable on `b` as it is: one device, or the host's CPU under two
    names (`cpu:0`, `cpu:1`: stages with thread pools of their own, in one memory), where a copy
    would cost time and memory and buy nothing."""
    a, b = torch.device(a), torch.device(b)
    return a == b or (is_cpu(a) and is_cpu(b))


def stream_for(device: torch.device) -> Stream | None:
    """A new CUDA stream on `device` for a stage's work; None off the GPU."""
    return torch.cuda.Stream(device) if is_gpu(device) else None


def initialized_gpus() -> list[int]:
    """The indices of the GPUs whose generators a seeded run must fork (every GPU, once CUDA
    has started in this process; none before, so that asking starts nothing)."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


def synchronize(*devices: torch.device) -> None:
    """Wait for the work queued on each GPU among `devices` (each the one named, not the
    current one)."""
    for device in devices:
        if is_gpu(device):
            torch.cuda.synchronize(device)


def start_timer(device: torch.device, *, wall: bool = False) -> Callable[[], float]:
    """Start timing the work done on `device` from now on; the function returned waits for that
    work and says its seconds. On a GPU, CUDA events on the device's current stream time the
    GPU's own work, not the host's launches (which run ahead of it); elsewhere, the host's clock.
    With `wall`, a GPU too is timed by the host's clock, from the device idle to its work done:
    launches and kernels together, what a run takes where launching costs more than computing.
    """
    if wall and is_gpu(device):
        synchronize(device)
        start = time.perf_counter()

        def waited_s() -> float:
            synchronize(device)
            return time.perf_counter() - start
        return waited_s
    if not is_gpu(device):
        start = time.perf_counter()
        return lambda: time.perf_counter() - start
    stream = torch.cuda.current_stream(device)
    begin = torch.cuda.Event(enable_timing=True)
    begin.record(stream)

    def elapsed_s() -> float:
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        end.synchronize()
        return begin.elapsed_time(end) / 1e3
    return elapsed_s


# ---- streams and events: the CPU's stream is None, and does nothing --------------------------

def current_stream(device: DeviceName) -> Stream | None:
    """The calling thread's current stream on `device`; None off the GPU."""
    return torch.cuda.current_stream(device) if is_gpu(device) else None


@contextlib.contextmanager
def use_stream(stream: Stream | None) -> Iterator[None]:
    """Inside, `stream` is current on its GPU, that GPU current first: leaving restores only
    that GPU's stream, where restoring the thread's previous device (GPU 0 on a new thread)
    would start a context on a GPU the plan may not use. Nothing for None (the CPU)."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


def wait_stream(waiting: Stream | None, waited: Stream | None) -> None:
    """Queue `waiting`'s later work after the work queued on `waited` so far (no-op where either
    is the CPU's)."""
    if waiting is not None and waited is not None:
        waiting.wait_stream(waited)


def synchronize_stream(device: DeviceName) -> None:
    """Wait on the host for the work queued on `device`'s current stream (no-op off the GPU)."""
    if is_gpu(device):
        torch.cuda.current_stream(device).synchronize()


def record_event(device: DeviceName) -> Event:
    """An event marking the work queued so far on `device`'s (a GPU's) current stream."""
    return torch.cuda.current_stream(device).record_event()


def timing_event(stream: Stream) -> Event:
    """A timing event recorded on `stream` now."""
    return stream.record_event(torch.cuda.Event(enable_timing=True))


def wait_event(device: DeviceName, event: Event) -> None:
    """Order the work that follows on `device` after `event`: on a GPU, its current stream
    waits; elsewhere the host waits."""
    if is_gpu(device):
        torch.cuda.current_stream(device).wait_event(event)
    else:
        event.synchronize()


def record_stream(tensor: torch.Tensor, device: DeviceName | None = None) -> None:
    """Mark a GPU tensor as used by the current stream of `device` (default: its own), so that
    its allocator keeps its memory until that stream's work queued so far is done."""
    tensor.record_stream(torch.cuda.current_stream(tensor.device if device is None else device))


def gpus_started() -> bool:
    """Whether CUDA has started in this process (before, no tensor can be on a GPU; asking
    starts nothing)."""
    return torch.cuda.is_initialized()


# ---- which GPU -------------------------------------------------------------------------------

def gpu_count() -> int:
    """The GPUs this process may use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_index(device: DeviceName) -> int:
    """The index of the GPU `device` names: its own, or the current GPU's for a bare "cuda"."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def set_device(device: DeviceName) -> None:
    """Make `device` the calling thread's current GPU (no-op off the GPU), so that what runs
    without naming a device runs there."""
    if is_gpu(device):
        torch.cuda.set_device(device)


def gpu_capability(device: DeviceName) -> tuple[int, int] | None:
    """The GPU's compute capability (None without CUDA)."""
    return torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None


# ---- generators ------------------------------------------------------------------------------

def seed_gpu(index: int, seed: int) -> None:
    """Seed GPU `index`'s default generator."""
    torch.cuda.default_generators[index].manual_seed(seed)


def gpu_rng_state(index: int) -> torch.Tensor:
    """GPU `index`'s default generator's state."""
    return torch.cuda.get_rng_state(index)


def set_gpu_rng_state(state: torch.Tensor, index: int) -> None:
    """Set GPU `index`'s default generator's state."""
    torch.cuda.set_rng_state(state, index)


# ---- the caching allocator's statistics -------------------------------------------------------

def free_memory_bytes(device: DeviceName) -> int:
    """The GPU's free memory, as its driver says (`mem_get_info`)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free


def cached_bytes(device: DeviceName) -> int:
    """What the GPU's caching allocator holds reserved and is not using."""
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def reset_peak_bytes(device: DeviceName) -> None:
    """Start the GPU's allocated high-water mark anew."""
    torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: DeviceName) -> int:
    """The GPU's allocated high-water mark since `reset_peak_bytes`."""
    return torch.cuda.max_memory_allocated(device)
