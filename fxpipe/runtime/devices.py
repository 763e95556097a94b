"""Device lists: parse and check what the user passed, before anything runs; CPU tuning;
links measured between devices here.

"cuda" means the current GPU. A GPU's budget is its free memory less a margin; stages on one device
share its budget evenly, the rule the partitioner enforces per stage. Links measured: the hand-off
between threads and copies between devices (a message between two gloo processes is
`fxpipe.distributed.measure_link`'s). `tune_cpu_allocator` tunes the
host's allocator. A device's kind, streams and timers are `fxpipe.passes.device`'s: this module
never tests a kind itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import queue
import statistics
import threading
import time
from dataclasses import replace
from typing import Sequence

import torch

from fxpipe.passes.cost_model import DeviceSpec, Link, LinkFn
from fxpipe.passes.device import (cached_bytes, device_count, exists, free_memory_bytes, indexed,
                                  is_cpu, is_gpu, kind_of, same_memory, synchronize, to_torch)
from fxpipe.passes.errors import DeviceError

DeviceLike = str | torch.device | DeviceSpec


def parse_devices(devices: Sequence[DeviceLike] | DeviceLike) -> list[DeviceSpec]:
    """One DeviceSpec per stage. `"cpu"` may repeat (each entry is its own stage and worker)."""
    if isinstance(devices, (str, torch.device, DeviceSpec)):
        devices = [devices]
    try:
        devices = list(devices)
    except TypeError:
        raise DeviceError(f"devices={devices!r} is not a list of devices\n"
                          f"pass one device per stage, e.g. "
                          f"devices=['cpu', 'cpu'] or ['cuda:0', 'cuda:1']") from None
    if not devices:
        raise DeviceError("no devices given\npass one device per stage, e.g. "
                          "devices=['cpu', 'cpu']")
    return [_parse(d) for d in devices]


def _parse(device: DeviceLike) -> DeviceSpec:
    """A DeviceSpec named `cpu` or `cuda:N` ("cuda" is the current GPU); a GPU's memory is
    what it has free (`gpu_memory_bytes`) unless the DeviceSpec gives `memory_bytes`."""
    spec = device if isinstance(device, DeviceSpec) else None
    name = spec.name if spec is not None else device
    try:
        parsed = to_torch(name)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"{name!r} is not a device\nuse 'cpu', 'cuda' or 'cuda:N'") from e
    _check(name if isinstance(name, str) else str(parsed))
    if is_gpu(parsed):
        parsed = indexed(parsed)
    spec = replace(spec, name=str(parsed)) if spec is not None else DeviceSpec(str(parsed))
    _check_spec(spec)
    if is_gpu(parsed) and spec.memory_bytes == math.inf:
        spec = replace(spec, memory_bytes=gpu_memory_bytes(parsed))
    return spec


GPU_MARGIN = 0.1    # of a GPU's free memory, left for CUDA's workspaces and fragmentation


def gpu_memory_bytes(device: torch.device) -> float:
    """What a GPU can hold for stages: its free memory (`torch.cuda.mem_get_info`, plus what
    this process's allocator keeps cached unused), less a margin (`GPU_MARGIN`)."""
    return (free_memory_bytes(device) + cached_bytes(device)) * (1 - GPU_MARGIN)


def shared_memory(devices: Sequence[DeviceSpec]) -> list[DeviceSpec]:
    """`devices` with each device's memory shared evenly among the stages placed on it (by
    name; the least `memory_bytes` given for it), so that the partitioner, which keeps each
    stage within its own device's memory, keeps the stages on one device within that device's."""
    budget: dict[str, float] = {}
    count: dict[str, int] = {}
    for d in devices:
        budget[d.name] = min(budget.get(d.name, math.inf), d.memory_bytes)
        count[d.name] = count.get(d.name, 0) + 1
    return [replace(d, memory_bytes=budget[d.name] / count[d.name]) for d in devices]


def _check(name: str) -> None:
    try:
        device = to_torch(name)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"{name!r} is not a device\nuse 'cpu', 'cuda' or 'cuda:N'") from e
    if is_cpu(device):
        return
    if not is_gpu(device):
        raise DeviceError(f"device {name!r} is not supported\nfxpipe runs stages on 'cpu' and "
                          f"'cuda:N' devices")
    count, kind = device_count(device), kind_of(device).name
    if not exists(device):
        have = (f"{count} {kind.upper()} device{'s' * (count > 1)}: {kind}:0..{kind}:{count - 1}"
                if count else f"no {kind.upper()} device")
        use = (f"use one of {kind}:0..{kind}:{count - 1}, or 'cpu'" if count else
               "use 'cpu', or plan for GPUs without them: a DeviceSpec gives a device's memory "
               "and speed, and a saved plan runs where its devices exist")
        raise DeviceError(f"device {name!r} does not exist on this machine ({have})\n{use}")


def _check_spec(spec: DeviceSpec) -> None:
    for option, value, example in (("speed", spec.speed, "2.0"),
                                   ("memory_bytes", spec.memory_bytes, "8e9 or 8 << 30")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise DeviceError(f"{spec}: {option}={value!r} must be a number > 0\n"
                              f"e.g. {example}; memory_bytes=math.inf, the default, for no limit "
                              f"on a CPU and a GPU's free memory on a GPU")
    if spec.threads is not None and (not isinstance(spec.threads, int)
                                     or isinstance(spec.threads, bool) or spec.threads < 1):
        raise DeviceError(f"{spec}: threads={spec.threads!r} must be a number of threads >= 1\n"
                          f"give a number of intra-op threads >= 1, or None to share the cores "
                          f"evenly among the CPU stages")
    if spec.threads is not None and not is_cpu(spec.name):
        raise DeviceError(f"{spec}: threads= applies to CPU stages only\n"
                          f"a GPU stage's threads are the GPU's own: leave threads=None")


def tune_cpu_allocator(*, keep_bytes: int = 1 << 30) -> bool:
    """Make glibc keep freed activation memory for reuse, instead of returning it to the system.

    By default glibc hands large freed blocks back to the OS, so every micro-batch's activations
    are page-faulted in anew, and worker threads' arenas are trimmed after each use; a CPU pipeline
    of a conv net with 12 MB activations ran 2x slower for it here. This caps the size of blocks
    served by mmap at 32 MB and keeps up to `keep_bytes` of free memory. It affects the whole
    process (the same as setting MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_), so fxpipe
    never calls it by itself. Returns False where the C library is not glibc.
    """
    return set_malloc_thresholds(mmap_bytes=32 << 20, trim_bytes=keep_bytes)


def set_malloc_thresholds(*, mmap_bytes: int, trim_bytes: int) -> bool:
    """glibc's `mallopt`: blocks above `mmap_bytes` get a mapping of their own (returned to the
    system when freed), and free memory above `trim_bytes` at the heap's top is returned.
    False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, mmap_bytes)) and bool(mallopt(m_trim_threshold,
                                                                          trim_bytes))


def measure_links(devices: Sequence[DeviceSpec], *, repeats: int = 20) -> LinkFn:
    """A link function measured on this machine, for the cost model.

    Between two stages on one device, or on the CPU under two names (`same_memory`), nothing is
    copied: the link is the hand-off itself, a queue put and a thread wake-up, timed as half a
    ping-pong between two threads. Between devices, copies of 64 KB and 16 MB give the latency
    and the bandwidth. Pairs are measured once each.
    """
    handoff = Link(latency_s=_handoff_s(repeats))
    links: dict[tuple[str, str], Link] = {}

    def link(src: DeviceSpec, dst: DeviceSpec) -> Link:
        if (src.name, dst.name) not in links:
            links[src.name, dst.name] = (
                handoff if same_memory(src.name, dst.name) else
                _copy_link(torch.device(src.name), torch.device(dst.name), repeats))
        return links[src.name, dst.name]
    names = sorted({d.name for d in devices})
    for src in names:
        for dst in names:
            link(DeviceSpec(src), DeviceSpec(dst))
    return link


def _handoff_s(repeats: int) -> float:
    ping, pong = queue.SimpleQueue(), queue.SimpleQueue()

    def echo():
        for _ in range(repeats + 1):
            pong.put(ping.get())
    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        ping.put(None)
        pong.get()
        times.append(time.perf_counter() - start)
    thread.join()
    return statistics.median(times[1:]) / 2


def _copy_link(src: torch.device, dst: torch.device, repeats: int) -> Link:
    def copy_s(nbytes: int) -> float:
        x = torch.empty(nbytes // 4, device=src)
        times = []
        for _ in range(repeats):
            synchronize(src, dst)
            start = time.perf_counter()
            x.to(dst)
            synchronize(src, dst)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    return fitted_link({nbytes: copy_s(nbytes) for nbytes in (64 << 10, 16 << 20)})


def fitted_link(seconds: dict[int, float]) -> Link:
    """The link whose latency and bandwidth give the times measured for two message sizes
    (`seconds[nbytes]`)."""
    small, large = sorted(seconds)
    bandwidth = (large - small) / max(seconds[large] - seconds[small], 1e-9)
    return Link(latency_s=max(seconds[small] - small / bandwidth, 0.0), bytes_per_s=bandwidth)
