"""What fxpipe asks of a device, in one place: is it the host's CPU or a GPU, which devices
share memory, a GPU stage's stream, waiting for a device's work and timing it, the GPUs whose
generators exist.

A device comes as a name ("cpu", "cuda:1", a DeviceSpec's `name`) or a `torch.device`; every
test of its kind goes through `is_cpu` / `is_gpu`. A CUDA call here names its device, never
the current one. A pass-level module (passes never import fxpipe): `fxpipe.devices` builds on it.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

DeviceName = str | torch.device


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


def stream_for(device: torch.device) -> torch.cuda.Stream | None:
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
