"""The transport: moves stages' outputs and gradients to their readers.

A message goes from a sender to a receiver in one phase, for one micro-batch: a forward message
carries values by name, a backward message the gradients of those values. `Transport` is all the
orchestrator asks of a transport, so one on `torch.distributed` can take the place of
`ThreadTransport`, which hands messages between threads of one process.

`ThreadTransport` keeps a FIFO queue per (phase, sender, receiver). A receiver takes one message
per micro-batch from each of its senders, in micro-batch order, so the queue's order is all the
synchronisation there is (each message names its micro-batch, and a receiver checks it).

On a GPU a message carries CUDA events recorded after the sender's work: on its current stream
(a stage's stream; on the caller's thread, the caller's stream) on its own device and on every GPU
its tensors live on. The receiver's stream waits on them before using the tensors, and no host
thread waits: a worker runs ahead of its GPU (see `_to` for how copies between devices are kept
safe). The caller's thread, which receives the graph outputs, makes its own current streams wait
and marks the tensors as used there, so the allocator gives their memory back to a stage only
after the caller's work on them; a message holding CPU tensors is waited for on the host.

`abort(reason)` puts an abort token carrying the reason in every queue, and every wait has a
timeout after which it looks at the run's abort flag: a waiting thread leaves within `POLL_S` of
an abort, by `Aborted` (saying the reason), and the caller's thread sees signals (Ctrl-C) while
it waits.

A new transport (another backend, say NCCL) is one module implementing `Transport`; the row
runner (`orchestrator.StageRow`) and the train-step contract (`step`) take it as it is.

A channel is one way messages go in a run, `(phase, sender, receiver)` (`Flow.channels()`,
`Channel`): a transport keeps a queue or a peer per channel. No host read per micro-batch either: a
`(loss_sum, count)` step's counts stay tensors and restored buffers are not compared (the first
train step's check of a mean loss reads two numbers, once, at the step's end); the host waits only
where a CPU stage or the caller reads a GPU's values on the CPU, as CPU ops must.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol

import torch
import torch.fx as fx

from fxpipe.passes.device import (Event, gpus_started, is_gpu, record_event, record_stream,
                                  same_memory, wait_event)
from fxpipe.passes.graph_values import tensors

from .schedules import Phase

POLL_S = 0.05     # how often a waiting thread looks for an abort or a signal

Channel = tuple[Phase, int, int]     # (phase, sender, receiver): one way messages go


class Aborted(Exception):
    """The run was aborted while this thread waited for a message; `str()` says why."""


@dataclass(frozen=True)
class _Abort:
    """The token an abort puts in every queue."""

    reason: str


class Transport(Protocol):
    """Moves one message per (phase, sender, receiver, micro-batch)."""

    def send(self, phase: Phase, sender: int, receiver: int, microbatch: int,
             values: dict[str, Any]) -> None:
        """Hand `values` to `receiver`, once the sender's work queued so far is done."""

    def receive(self, phase: Phase, sender: int, receiver: int,
                microbatch: int) -> dict[str, Any]:
        """The values `sender` sent, ready for use on the receiver's device; raises `Aborted`."""

    def abort(self, reason: str) -> None:
        """Tell every receiver the run failed, `reason` saying why: one waiting, or waiting
        later, for a message not sent before the abort raises `Aborted` (a subclass) saying it."""

    def finish_step(self) -> None:
        """End a step that went well: every participant sent and took its messages, and the
        step's tensors may change (an optimizer's step) without a message still reading them."""


@dataclass
class _Message:
    microbatch: int
    values: dict[str, Any]
    ready: list[Event]    # CUDA events the receiver waits on (none off the GPU)


class ThreadTransport:
    """Messages between threads of one process: a FIFO queue per channel.

    `devices[i]` is where participant i computes (None: the caller's thread, which moves nothing);
    `stopping` is the run's abort flag, which waits look at.
    """

    def __init__(self, channels: Iterable[Channel], devices: Mapping[int, torch.device | None],
                 stopping: threading.Event):
        self.queues: dict[Channel, queue.SimpleQueue] = {c: queue.SimpleQueue() for c in channels}
        self.devices = devices
        self.stopping = stopping

    def send(self, phase: Phase, sender: int, receiver: int, microbatch: int,
             values: dict[str, Any]) -> None:
        ready = []
        if gpus_started():      # before, no tensor can be on a GPU
            sender_device = self.devices[sender]
            gpus = {t.device for t in tensors(values) if is_gpu(t.device)}
            if sender_device is not None and is_gpu(sender_device):
                gpus.add(sender_device)
            ready = [record_event(gpu) for gpu in gpus]
        self.queues[phase, sender, receiver].put(_Message(microbatch, values, ready))

    def receive(self, phase: Phase, sender: int, receiver: int,
                microbatch: int) -> dict[str, Any]:
        message = self._get(self.queues[phase, sender, receiver])
        assert message.microbatch == microbatch, (
            f"{phase.name.lower()} message {sender} -> {receiver}: micro-batch "
            f"{message.microbatch} came where {microbatch} was expected")
        device = self.devices[receiver]
        if not message.ready and not gpus_started():
            return message.values            # host tensors, usable by any CPU stage as they are
        if device is None:
            return _handed_over(message)
        _wait(message, device)
        return {name: _to(value, device) for name, value in message.values.items()}

    def abort(self, reason: str = "the run was aborted") -> None:
        for channel in self.queues.values():
            channel.put(_Abort(reason))

    def finish_step(self) -> None:
        """Nothing to wait for: a message is taken by reference, once it was put in its queue."""

    def _get(self, channel: queue.SimpleQueue) -> _Message:
        """The next message; waits with timeouts, so the caller's thread sees signals and a
        worker sees the abort flag."""
        while not self.stopping.is_set():
            try:
                message = channel.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if isinstance(message, _Abort):
                raise Aborted(message.reason)
            return message
        raise Aborted("the run was stopped")


def _wait(message: _Message, device: torch.device) -> None:
    """Order the receiver's work after the sender's: on its stream, or on this thread."""
    for event in message.ready:
        wait_event(device, event)


def _handed_over(message: _Message) -> dict[str, Any]:
    """The values of a message to the caller's thread, ready for the caller's current streams.

    Tensors on GPUs: each of their GPUs' current stream waits for the sender, and each tensor is
    marked as used by it (its memory is the sender's stream's, which may run on). A CPU tensor
    is read by the host: the host waits."""
    found = tensors(message.values)
    if not all(is_gpu(t.device) for t in found):
        _wait(message, torch.device("cpu"))
        return message.values
    for gpu in {t.device for t in found}:
        _wait(message, gpu)
    for t in found:
        record_stream(t)
    return message.values


def _to(value: Any, device: torch.device) -> Any:
    """`value`'s tensors on `device`, safe to use on this thread's current stream.

    A tensor another stage made on this GPU is marked as used by this stream, so the allocator
    does not hand its memory back to the sender first. A copy to the GPU is queued on this stream.
    A copy from another GPU runs on this thread's current stream of the source GPU, after this
    stream's work and before its later work (torch orders both ways); its source is marked as
    used by that stream, so the sender's allocator keeps it until the copy is done, and nobody
    waits on the host. A copy to the CPU is synchronous, since CPU ops do not wait for streams."""
    def move(v):
        if not isinstance(v, torch.Tensor):
            return v
        if same_memory(v.device, device):
            if is_gpu(device):
                record_stream(v, device)
            return v
        moved = v.to(device, non_blocking=is_gpu(device))
        if is_gpu(device) and is_gpu(v.device):
            record_stream(v)
        return moved
    return fx.node.map_aggregate(value, move)
