"""Measuring a CPU run's peak memory, to check the plan's memory model against (Linux only).

A CUDA device counts its own allocations (`torch.cuda.max_memory_allocated`); the CPU allocator
does not, so the measure here is the process's resident memory: its high-water mark (`VmHWM`),
reset before the run through `/proc/self/clear_refs`, above what was resident before. For that
to follow the tensors alive, freed memory must go back to the system at once:
`return_freed_memory()` makes glibc serve every block above 64 KB with its own mapping and trim
the heap at each free. It affects the whole process, and slows allocation: call it in a process
of its own that measures, not in one that times.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Callable

from fxpipe.runtime.devices import set_malloc_thresholds

_STATUS = Path("/proc/self/status")


def return_freed_memory() -> bool:
    """Make glibc return freed blocks to the system at once; False where that is not glibc."""
    return set_malloc_thresholds(mmap_bytes=64 << 10, trim_bytes=0)


def can_measure() -> bool:
    """Whether this system has the counters `peak_bytes` reads."""
    return _STATUS.exists() and Path("/proc/self/clear_refs").exists() and "VmHWM" in \
        _STATUS.read_text()


def peak_bytes(fn: Callable[[], Any]) -> int:
    """The resident memory `fn()` added at its peak: the high-water mark while it ran, above
    what was resident when it started."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")     # the high-water mark starts here
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def _status(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{key} is not in {_STATUS}")
