"""What fxpipe asks of a device, in one place: a registry of device kinds.

A device comes as a name ("cpu", "cuda:1", a DeviceSpec's `name`) or a `torch.device`;
`kind_of` finds its `DeviceKind`, and every decision that depends on a device's kind is that
kind's answer: is it the host's CPU (`is_cpu`) or an accelerator (`is_gpu`), its streams and
events, `set_device`, waiting for its work and timing it, its generators, its allocator's
statistics, how many there are. No other module tests `device.type == "cuda"`
(tests/test_layers.py holds it), and this is the one module that names `torch.cuda`.

Streams follow torchgpipe's: the CPU's stream is None, one that does nothing, so `use_stream`,
`wait_stream` and the events are no-ops (or the host's wait) off a device with streams, and a
caller need not ask a device's kind. A kind's methods on a stream are found by the stream's
`device`. A pass-level module (passes never import fxpipe): `fxpipe.runtime.devices` builds
on it.

Adding a device kind (XPU, MPS) is one file: subclass `DeviceKind`, answer what it has (the base
answers as a device with no streams, no generators of its own and no allocator statistics), and
`register` an instance. tests/test_device_kinds.py adds a fake CPU-backed kind that way and
runs a pipeline on it:

>>> from fxpipe.passes import device
>>> device.kind_of("cuda:1").name, device.kind_of(torch.device("cpu")).host
('cuda', True)
>>> device.is_gpu("cpu"), device.stream_for(torch.device("cpu")) is None
(False, True)
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterable, Iterator

import torch

DeviceName = str | torch.device
Stream = Any      # a stage's stream on a device with streams (a `torch.cuda.Stream`); None: the CPU's
Event = Any       # a point in a stream's work (a `torch.cuda.Event`)


class DeviceKind:
    """One kind of device, and every answer fxpipe asks of it. The base answers as a device
    without streams (its stream is None), generators of its own, or allocator statistics, its
    work done when the host's call returns; a kind overrides what it has.

    `name` is the prefix of its devices' names ("cuda" in "cuda:1"); `host` says its memory and
    cores are the host's (CPU stages share them: threads, no copies between them); `streams`
    says it runs a stage's work on a stream of its own."""

    name = ""
    host = False
    streams = False
    own_generators = False
    autocast = None   # the device type `torch.autocast` takes for it, where it has one

    def claims(self, device: torch.device) -> bool:
        """Whether `device` (a parsed name) is of this kind."""
        return device.type == self.name

    def torch_device(self, name: str) -> torch.device:
        """The `torch.device` that tensors of the device `name` live on."""
        return torch.device(name)

    def indexed(self, device: torch.device) -> torch.device:
        """`device` with its index (a bare name means the current one)."""
        return device

    def count(self) -> int:
        """How many devices of this kind this process may use."""
        return 0

    def number(self, device: torch.device) -> int:
        """`device`'s number among the `count` of its kind."""
        return device.index or 0

    def started(self) -> bool:
        """Whether a tensor may be on this kind yet (asking starts nothing)."""
        return False

    # streams and events; the base has none: its stream is None, its events the host's
    def new_stream(self, device: torch.device) -> Stream | None:
        return None

    def current_stream(self, device: torch.device) -> Stream | None:
        return None

    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def wait_stream(self, waiting: Stream, waited: Stream) -> None:
        waiting.wait_stream(waited)

    def record_event(self, device: torch.device) -> Event | None:
        return None

    def timing_event(self, stream: Stream) -> Event:
        return stream.record_event()

    def wait_event(self, device: torch.device, event: Event) -> None:
        event.synchronize()

    def record_stream(self, tensor: torch.Tensor, device: torch.device) -> None:
        pass

    def synchronize(self, device: torch.device) -> None:
        pass

    def synchronize_stream(self, device: torch.device) -> None:
        pass

    def set_device(self, device: torch.device) -> None:
        pass

    def start_timer(self, device: torch.device, wall: bool) -> Callable[[], float]:
        start = time.perf_counter()
        return lambda: time.perf_counter() - start

    def started_devices(self) -> list[torch.device]:
        """The devices of this kind started in this process (none before the kind started)."""
        return []

    # generators of its own, beside the CPU's (where `own_generators`)

    def rng_state(self, device: torch.device) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} devices have no generators of their own")

    def set_rng_state(self, device: torch.device, state: torch.Tensor) -> None:
        raise NotImplementedError(f"{self.name} devices have no generators of their own")

    def seed(self, device: torch.device, seed: int) -> None:
        raise NotImplementedError(f"{self.name} devices have no generators of their own")

    def seeded_state(self, device: torch.device, seed: int) -> torch.Tensor:
        """A generator's state on `device` after `manual_seed(seed)`."""
        return torch.Generator(device).manual_seed(seed).get_state()

    # the allocator
    def free_memory_bytes(self, device: torch.device) -> float:
        return float("inf")

    def cached_bytes(self, device: torch.device) -> int:
        return 0

    def reset_peak_bytes(self, device: torch.device) -> None:
        pass

    def peak_bytes(self, device: torch.device) -> int:
        return 0

    def capability(self, device: torch.device) -> tuple[int, int] | None:
        return None

    def reduces_float32(self) -> bool:
        """Whether float32 matrix products and convolutions may run at reduced precision."""
        return False

    def __repr__(self) -> str:
        return f"<device kind {self.name!r}>"


class Cpu(DeviceKind):
    """The host's CPU: one memory under every name ("cpu", "cpu:1": stages with thread pools
    of their own), no streams; its work is done when the call returns."""

    name, host, autocast = "cpu", True, "cpu"

    def count(self) -> int:
        return 1

    def started(self) -> bool:
        return True


class Cuda(DeviceKind):
    """CUDA GPUs: a stage's stream, events, the caching allocator's statistics, a generator per
    GPU. A call here names its device, never the current one."""

    name, streams, own_generators, autocast = "cuda", True, True, "cuda"

    def indexed(self, device: torch.device) -> torch.device:
        return device if device.index is not None else \
            torch.device("cuda", torch.cuda.current_device())

    def count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def started(self) -> bool:
        return torch.cuda.is_initialized()

    def new_stream(self, device: torch.device) -> Stream:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Stream:
        return torch.cuda.current_stream(device)

    @contextlib.contextmanager
    def use_stream(self, stream: Stream) -> Iterator[None]:
        # its GPU current first: leaving restores only that GPU's stream, where restoring the
        # thread's previous device (GPU 0 on a new thread) would start a context on a GPU the
        # plan may not use
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            yield

    def record_event(self, device: torch.device) -> Event:
        return torch.cuda.current_stream(device).record_event()

    def timing_event(self, stream: Stream) -> Event:
        return stream.record_event(torch.cuda.Event(enable_timing=True))

    def wait_event(self, device: torch.device, event: Event) -> None:
        torch.cuda.current_stream(device).wait_event(event)

    def record_stream(self, tensor: torch.Tensor, device: torch.device) -> None:
        tensor.record_stream(torch.cuda.current_stream(device))

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def synchronize_stream(self, device: torch.device) -> None:
        torch.cuda.current_stream(device).synchronize()

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def start_timer(self, device: torch.device, wall: bool) -> Callable[[], float]:
        if wall:
            self.synchronize(device)
            start = time.perf_counter()

            def waited_s() -> float:
                self.synchronize(device)
                return time.perf_counter() - start
            return waited_s
        stream = torch.cuda.current_stream(device)
        begin = torch.cuda.Event(enable_timing=True)
        begin.record(stream)

        def elapsed_s() -> float:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            end.synchronize()
            return begin.elapsed_time(end) / 1e3
        return elapsed_s

    def started_devices(self) -> list[torch.device]:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())] \
            if torch.cuda.is_initialized() else []

    def rng_state(self, device: torch.device) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.indexed(device).index)

    def set_rng_state(self, device: torch.device, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state, self.indexed(device).index)

    def seed(self, device: torch.device, seed: int) -> None:
        torch.cuda.default_generators[self.indexed(device).index].manual_seed(seed)

    def free_memory_bytes(self, device: torch.device) -> float:
        free, _ = torch.cuda.mem_get_info(device)
        return free

    def cached_bytes(self, device: torch.device) -> int:
        return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

    def reset_peak_bytes(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def peak_bytes(self, device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device)

    def capability(self, device: torch.device) -> tuple[int, int] | None:
        return torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None

    def reduces_float32(self) -> bool:
        return torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32


class _Unknown(DeviceKind):
    """What `kind_of` answers for a device no kind claims (`meta`): neither host nor
    accelerator."""


_KINDS: dict[str, DeviceKind] = {}
_UNKNOWN = _Unknown()


def register(kind: DeviceKind) -> DeviceKind:
    """Add `kind` to the registry (a kind of the same name is replaced); returns it."""
    _KINDS[kind.name] = kind
    _kind_by_key.cache_clear()
    return kind


def unregister(name: str) -> None:
    """Remove the kind named `name` (the CPU and CUDA stay)."""
    if name not in ("cpu", "cuda"):
        _KINDS.pop(name, None)
        _kind_by_key.cache_clear()


def kinds() -> list[DeviceKind]:
    """The registered kinds, in the order they were registered."""
    return list(_KINDS.values())


def kind_of(device: DeviceName) -> DeviceKind:
    """The kind of `device`: the latest registered kind that claims it."""
    return _kind_by_key(device)


@functools.lru_cache(maxsize=256)
def _kind_by_key(device: DeviceName) -> DeviceKind:
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            return _KINDS.get(device.split(":")[0], _UNKNOWN)
    return next((k for k in reversed(_KINDS.values()) if k.claims(device)), _UNKNOWN)


def to_torch(device: DeviceName) -> torch.device:
    """The `torch.device` of a device's name, as its kind says (a kind may back its devices by
    another's tensors); a `torch.device` as it is. Raises what `torch.device` raises for a name
    no kind knows."""
    if isinstance(device, str):
        kind = _KINDS.get(device.split(":")[0])
        if kind is not None:
            return kind.torch_device(device)
    return device if isinstance(device, torch.device) else torch.device(device)


register(Cpu())
register(Cuda())


def is_cpu(device: DeviceName) -> bool:
    """Whether `device` is the host's CPU."""
    return kind_of(device).host


def is_gpu(device: DeviceName) -> bool:
    """Whether `device` is an accelerator: a device of a registered kind other than the host's
    (a CUDA GPU, or a kind added as one)."""
    kind = kind_of(device)
    return not kind.host and kind is not _UNKNOWN


def same_memory(a: DeviceName, b: DeviceName) -> bool:
    """Whether a tensor on `a` is usable on `b` as it is: one device, or the host's CPU under two
    names (`cpu:0`, `cpu:1`: stages with thread pools of their own, in one memory), where a copy
    would cost time and memory and buy nothing."""
    a, b = to_torch(a), to_torch(b)
    return a == b or (is_cpu(a) and is_cpu(b))


def indexed(device: DeviceName) -> torch.device:
    """`device` with its index: a bare "cuda" is the current GPU."""
    device = to_torch(device)
    return kind_of(device).indexed(device)


def device_count(device: DeviceName) -> int:
    """How many devices of `device`'s kind this process may use."""
    return kind_of(device).count()


def exists(device: DeviceName) -> bool:
    """Whether `device` is one this process may use (a bare name: its kind's first)."""
    kind = kind_of(device)
    return kind.number(to_torch(device)) < kind.count()


def autocast_types() -> list[str]:
    """The device types `torch.autocast` may be on for: each registered kind's."""
    return list(dict.fromkeys(k.autocast for k in _KINDS.values() if k.autocast))


def reduces_float32(device: DeviceName) -> bool:
    """Whether float32 matrix products and convolutions on `device` may run at reduced precision
    (TF32 on a CUDA GPU where torch allows it)."""
    return kind_of(device).reduces_float32()


def stream_for(device: torch.device) -> Stream | None:
    """A new stream on `device` for a stage's work; None where its kind has no streams."""
    return kind_of(device).new_stream(device) if kind_of(device).streams else None


def synchronize(*devices: torch.device) -> None:
    """Wait for the work queued on each of `devices` (each the one named, not the current one)."""
    for device in devices:
        kind_of(device).synchronize(device)


def start_timer(device: torch.device, *, wall: bool = False) -> Callable[[], float]:
    """Start timing the work done on `device` from now on; the function returned waits for that
    work and says its seconds. On a GPU, CUDA events on the device's current stream time the
    GPU's own work, not the host's launches (which run ahead of it); elsewhere, the host's clock.
    With `wall`, a GPU too is timed by the host's clock, from the device idle to its work done:
    launches and kernels together, what a run takes where launching costs more than computing.
    """
    return kind_of(device).start_timer(device, wall)


# ---- streams and events: the CPU's stream is None, and does nothing --------------------------

def current_stream(device: DeviceName) -> Stream | None:
    """The calling thread's current stream on `device`; None where its kind has no streams."""
    kind = kind_of(device)
    return kind.current_stream(to_torch(device)) if kind.streams else None


def use_stream(stream: Stream | None) -> contextlib.AbstractContextManager:
    """Inside, `stream` is current on its device (its device current first). Nothing for None
    (the CPU)."""
    return contextlib.nullcontext() if stream is None else \
        kind_of(stream.device).use_stream(stream)


def wait_stream(waiting: Stream | None, waited: Stream | None) -> None:
    """Queue `waiting`'s later work after the work queued on `waited` so far (no-op where either
    is the CPU's)."""
    if waiting is not None and waited is not None:
        kind_of(waiting.device).wait_stream(waiting, waited)


def synchronize_stream(device: DeviceName) -> None:
    """Wait on the host for the work queued on `device`'s current stream (no-op off streams)."""
    kind_of(device).synchronize_stream(to_torch(device))


def record_event(device: DeviceName) -> Event | None:
    """An event marking the work queued so far on `device`'s current stream (None where its
    kind has no events: its work is done already)."""
    return kind_of(device).record_event(to_torch(device))


def timing_event(stream: Stream) -> Event:
    """A timing event recorded on `stream` now."""
    return kind_of(stream.device).timing_event(stream)


def wait_event(device: DeviceName, event: Event) -> None:
    """Order the work that follows on `device` after `event`: on a device with streams, its
    current stream waits; elsewhere the host waits. Nothing for None (no event: nothing to
    wait for)."""
    if event is not None:
        kind_of(device).wait_event(to_torch(device), event)


def record_stream(tensor: torch.Tensor, device: DeviceName | None = None) -> None:
    """Mark a tensor as used by the current stream of `device` (default: its own), so that
    its allocator keeps its memory until that stream's work queued so far is done."""
    device = tensor.device if device is None else to_torch(device)
    kind_of(tensor.device).record_stream(tensor, device)


def gpus_started() -> bool:
    """Whether any accelerator kind has started in this process (before, no tensor can be on
    one; asking starts nothing)."""
    return any(k.started() for k in _KINDS.values() if not k.host)


def set_device(device: DeviceName) -> None:
    """Make `device` the calling thread's current device of its kind (no-op on the CPU), so
    that what runs without naming a device runs there."""
    kind_of(device).set_device(to_torch(device))


def gpu_capability(device: DeviceName) -> tuple[int, int] | None:
    """The GPU's compute capability (None where its kind has none)."""
    return kind_of(device).capability(to_torch(device))


# ---- generators ------------------------------------------------------------------------------

def started_devices() -> list[torch.device]:
    """The accelerators started in this process (every GPU, once CUDA has started; none
    before, so that asking starts nothing)."""
    return [d for k in _KINDS.values() if not k.host for d in k.started_devices()]


def started_generators() -> list[torch.device]:
    """The accelerators whose generators a seeded run must fork: the started ones whose kind
    has generators of its own."""
    return [d for d in started_devices() if kind_of(d).own_generators]


def generators_of(devices: Iterable[DeviceName]) -> list[torch.device]:
    """The devices among `devices` with generators of their own, each once with its index
    (the CPU's generator is the host's, not among them)."""
    found = {indexed(d) for d in devices if kind_of(d).own_generators}
    return sorted(found, key=str)


def rng_state(device: DeviceName) -> torch.Tensor:
    """`device`'s default generator's state."""
    return kind_of(device).rng_state(to_torch(device))


def set_rng_state(device: DeviceName, state: torch.Tensor) -> None:
    """Set `device`'s default generator's state."""
    kind_of(device).set_rng_state(to_torch(device), state)


def seeded_state(device: DeviceName, seed: int) -> torch.Tensor:
    """What `device`'s generator's state is after `manual_seed(seed)`."""
    return kind_of(device).seeded_state(to_torch(device), seed)


def seed_generators(seed: int, devices: Iterable[DeviceName]) -> None:
    """Seed each of `devices`' default generators with `seed`."""
    for device in devices:
        kind_of(device).seed(to_torch(device), seed)


@contextlib.contextmanager
def forked_generators(devices: Iterable[DeviceName] | None = None) -> Iterator[None]:
    """The CPU's generator and those of `devices` (default: `started_generators()`) are
    restored after the block (`torch.random.fork_rng`, for every kind)."""
    devices = started_generators() if devices is None else list(devices)
    cpu = torch.get_rng_state()
    states = [(d, rng_state(d)) for d in devices]
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        for d, state in states:
            set_rng_state(d, state)


# ---- the allocator's statistics ---------------------------------------------------------------

def free_memory_bytes(device: DeviceName) -> float:
    """The device's free memory, as its driver says (a GPU's `mem_get_info`)."""
    return kind_of(device).free_memory_bytes(to_torch(device))


def cached_bytes(device: DeviceName) -> int:
    """What the device's caching allocator holds reserved and is not using."""
    return kind_of(device).cached_bytes(to_torch(device))


def reset_peak_bytes(device: DeviceName) -> None:
    """Start the device's allocated high-water mark anew."""
    kind_of(device).reset_peak_bytes(to_torch(device))


def peak_bytes(device: DeviceName) -> int:
    """The device's allocated high-water mark since `reset_peak_bytes`."""
    return kind_of(device).peak_bytes(to_torch(device))
