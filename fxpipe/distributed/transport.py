"""`DistributedTransport`: the runtime's `Transport` between processes, over gloo (and NCCL).

Messages go by torch's own engine, over two process groups (one, by default): a message's
header (which phase, sender, receiver and micro-batch, the values' structure, each tensor's
shape and dtype), pickled into one fixed-size byte tensor (one send where `send_object_list`
takes two and 2.5x the time), over a gloo group; then each tensor, over the tensor group: the
same gloo group, another one, or an NCCL group, over which CUDA stages send their device
tensors as they are (no copy through the CPU) while the headers, host data, stay on gloo. Gloo's `send` waits for the receiver's `recv`, so two stages sending to each
other at once (1F1B) would wait for ever: every send is posted (`isend`) on the rank's own
thread, in the order its stage produced the messages, and let go when the peer's next header
says it took it (each header counts the messages its sender took), or when the step ends. A
receiver takes a peer's messages in that order, keeping
those it needs later, and posts the receive of a peer's next header as soon as it took one.
Every wait ends after `timeout` seconds with a `DistributedError` naming the rank that went
silent. No thread is started.
"""

from __future__ import annotations

import collections
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from fxpipe.passes.errors import FxpipeError

from ..runtime.microbatch import on_device
from ..runtime.transport import Aborted
from ..runtime.schedules import Phase
from ..runtime.wiring import DRIVER


class DistributedError(FxpipeError):
    """A distributed run that cannot go on: a peer went silent or failed, or no process group."""


@dataclass(frozen=True)
class _TensorMeta:
    """What a receiver needs to receive a tensor into: in a header, in the tensor's place."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


Key = tuple[Phase, int, int, int]     # (phase, sender, receiver, micro-batch)


class PeerFailedError(DistributedError, Aborted):
    """Another rank of the pipeline failed and told this one: `origin` is the rank that failed
    first, `note` says why. (The runtime's `Aborted`: a receiver told of an abort.)"""

    def __init__(self, message: str, note: str, origin: int):
        super().__init__(message)
        self.note = note
        self.origin = origin


class DistributedTransport:
    """The `Transport` between processes: participant i (stage i) is rank `base + i`, and the
    driver (`DRIVER`, which sends the graph inputs) is rank `base`, the replica's first.

    A message between participants on one rank stays in this process. One to another rank is
    posted at once, its header and its tensors by `isend`, on the caller's thread: gloo's `send`
    waits for the receiver's `recv`, so two stages sending to each other (1F1B) would each wait
    for ever, where posted sends do not wait at all. Gloo tells a send done only when waited
    for, so a rank keeps what it posted until the peer says it took it: every header carries
    how many messages its sender has taken from its receiver (`acked`), and the messages it
    counts are let go (in 1F1B, a forward's outputs when its backward's gradients come back);
    the rest when the step ends. `receive` takes a peer's messages in the order they were
    posted, keeping those not asked for yet; having taken one, it posts the receive of that
    peer's next header at once (after its tensors' receives: gloo matches receives in the order
    they are posted), so the next header is in when the next message is asked for.
    `finish_step` tells every peer of the pipeline that this rank is done, waits until each
    peer said the same, then until each took what this rank sent; `abort` tells them it failed
    instead, behind what it sent before, so a peer waiting for this rank ends at once with a
    `PeerFailedError`, and tells every other peer in turn. Closing after a failure reads every
    peer's messages up to its own news of the failure, so that every rank's sends are taken and
    no rank waits for a timeout; nothing is left running (no thread is started) but what a lost
    peer never took.
    """

    def __init__(self, rank: int, device: torch.device, *, group: Any = None,
                 tensor_group: Any = None, timeout: float = 60.0, base: int = 0,
                 peers: list[int] | None = None):
        self.rank = rank
        self.device = device
        self.group = group          # headers (gloo)
        self.tensor_group = group if tensor_group is None else tensor_group
        # Where tensors travel from and to: the stage's own device over NCCL, else the CPU.
        self.carrier = (torch.device(device) if dist.get_backend(self.tensor_group) == "nccl"
                        else torch.device("cpu"))
        self.timeout = timeout
        self.base = base
        self.peers = [p for p in (peers or []) if p != rank]
        self.kept: dict[Key, dict[str, Any]] = {}     # received (or local), not asked for yet
        self.done: set[int] = set()                   # peers that finished this step
        self.lost: set[int] = set()                   # peers met as gone or silent
        self.told: set[int] = set()                   # peers whose news of a failure came
        # Per peer: the messages posted to it and not let go yet, each its sends and tensors;
        # how many were let go; how many this rank took from it (what its headers ack).
        self.posted: dict[int, collections.deque[list[tuple[Any, torch.Tensor]]]] = {}
        self.released: collections.Counter[int] = collections.Counter()
        self.taken: collections.Counter[int] = collections.Counter()
        self.headers: dict[int, tuple[Any, torch.Tensor]] = {}        # peer -> its next header
        self.abort_note: tuple[int, str] | None = None

    def rank_of(self, participant: int) -> int:
        return self.base + (0 if participant == DRIVER else participant)

    def send(self, phase: Phase, sender: int, receiver: int, microbatch: int,
             values: dict[str, Any]) -> None:
        key = (phase, sender, receiver, microbatch)
        peer = self.rank_of(receiver)
        if peer == self.rank:     # the driver's inputs to stage 0, moved onto its device
            self.kept[key] = {name: on_device(v, self.device)
                              for name, v in values.items()}
            return
        payload: list[torch.Tensor] = []
        structure = {name: fx.node.map_aggregate(v, lambda t: _meta(t, payload, self.carrier))
                     for name, v in values.items()}
        self._post(peer, "data", ((phase.value, sender, receiver, microbatch), structure),
                   payload)

    def receive(self, phase: Phase, sender: int, receiver: int,
                microbatch: int) -> dict[str, Any]:
        key = (phase, sender, receiver, microbatch)
        peer = self.rank_of(sender)
        while key not in self.kept:
            if peer == self.rank or peer in self.done:
                raise DistributedError(f"{phase.name.lower()} message {sender} -> {receiver} "
                                       f"was never sent\n(of micro-batch {microbatch})")
            self._take(peer)
        return self.kept.pop(key)

    def finish_step(self) -> None:
        """Tell every peer this rank is done, wait until each peer is done (or failed: raised),
        then until every peer took what this rank sent (a step's tensors may change after it,
        by the optimizer)."""
        for peer in self.peers:
            self._post(peer, "done")
        for peer in self.peers:
            while peer not in self.done:
                self._take(peer)
        self.done.clear()
        self.finish_sends()

    def abort(self, note: str, origin: int | None = None) -> None:
        """Tell every peer still there that this step failed (`note` says why, `origin` which
        rank failed first: this one unless given), behind what this rank sent it before."""
        if self.abort_note is not None:
            return
        self.abort_note = (self.rank if origin is None else origin, note)
        for peer in self.peers:
            if peer not in self.lost:
                try:
                    self._post(peer, "abort", self.abort_note)
                except DistributedError:     # the peer is gone: nothing more to tell it
                    pass

    def close(self) -> None:
        """After `abort`: take every peer's messages up to its news of the failure (each peer
        tells every other), then wait until each took what this rank sent, so no rank is left
        waiting; a lost peer is skipped, and every wait ends at the timeout."""
        if self.abort_note is None:
            return
        for peer in self.peers:
            while peer not in self.lost | self.told:
                try:
                    self._take(peer)
                except DistributedError:     # its news (PeerFailedError), or lost
                    pass
        self.kept.clear()
        self.finish_sends(failed=True)

    def release(self) -> None:
        """Let go of everything this transport holds of its process groups: the messages and
        header receives posted (a lost peer's, never taken) and the groups themselves, so that
        destroying the groups ends their threads (see `stage.release_groups`). The transport
        cannot send or receive after it."""
        self.posted.clear()
        self.headers.clear()
        self.kept.clear()
        self.group = self.tensor_group = None

    def finish_sends(self, *, failed: bool = False) -> None:
        """Wait until each peer took what this rank posted to it; after a failure, each peer
        still there, and a peer lost now is let go."""
        for peer in self.posted:
            if failed and peer in self.lost:
                continue
            try:
                self._release(peer, self.released[peer] + len(self.posted[peer]))
            except DistributedError:
                if not failed:
                    raise
        self.posted.clear()

    # ---- sending

    def _post(self, peer: int, kind: str, body: Any = (),
              payload: Sequence[torch.Tensor] = ()) -> None:
        """Post the sends of a `kind` message ("data", "done" or "abort") to `peer`: its
        header (the kind, the messages taken from `peer` so far, `body`) over the header group,
        then `payload` over the tensor group."""
        sends = []
        messages = [(t, self.group) for t in _header_tensors((kind, self.taken[peer], body))]
        for t, group in [*messages, *((t, self.tensor_group) for t in payload)]:
            try:
                sends.append((dist.isend(t, dst=peer, group=group), t))
            except RuntimeError as e:
                raise self._lost(peer, e) from None
        self.posted.setdefault(peer, collections.deque()).append(sends)

    def _release(self, peer: int, acked: int) -> None:
        """Let go of the messages to `peer` up to the `acked`-th, which it took: their sends
        are done (a wait returns at once) and their tensors free."""
        posted = self.posted.get(peer, ())
        while posted and self.released[peer] < acked:
            for work, _ in posted.popleft():
                self._wait(work, peer)
            self.released[peer] += 1

    # ---- receiving

    def _take(self, peer: int) -> None:
        """Receive `peer`'s next message and keep it; raise if it is a failure."""
        try:
            kind, acked, body = self._header(peer)
            if kind == "data":
                (phase, sender, receiver, m), structure = body
                received = [self._post_recv(meta, peer) for meta in _metas(structure.values())]
                self.headers[peer] = _post_header_recv(peer, self.group)   # a header follows
                for work, _ in received:
                    self._wait(work, peer)
        except (RuntimeError, OSError) as e:
            raise self._lost(peer, e) from None
        self.taken[peer] += 1
        self._release(peer, acked)
        if kind == "done":
            self.done.add(peer)
            return
        if kind == "abort":
            origin, note = body
            self.told.add(peer)
            raise PeerFailedError(f"{note}\n  so rank {self.rank} stopped its step too (told by "
                                  f"rank {peer})", note, origin)
        tensors_in = iter(self._arrived(meta, t) for (_, t), meta
                          in zip(received, _metas(structure.values())))

        def fill(v):
            return next(tensors_in) if isinstance(v, _TensorMeta) else v
        self.kept[Phase(phase), sender, receiver, m] = {
            name: fx.node.map_aggregate(v, fill) for name, v in structure.items()}

    def _header(self, peer: int) -> Any:
        """`peer`'s next header: its receive posted already, or now."""
        work, first = self.headers.pop(peer, None) or _post_header_recv(peer, self.group)
        self._wait(work, peer)
        return _header_of(first, peer, self.group)

    def _post_recv(self, meta: _TensorMeta, peer: int) -> tuple[Any, torch.Tensor]:
        """The receive of one tensor of `meta`'s shape from `peer`, posted, over the tensor
        group, into a tensor on the carrier device."""
        t = torch.empty(meta.shape, dtype=meta.dtype, device=self.carrier)
        return (dist.irecv(t, src=peer, group=self.tensor_group) if t.numel() > 0 else None), t

    def _arrived(self, meta: _TensorMeta, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        return t.requires_grad_(True) if meta.requires_grad else t

    def _wait(self, work: Any, peer: int) -> None:
        if work is None:
            return
        try:
            work.wait()
        except RuntimeError as e:
            raise self._lost(peer, e) from None

    def _lost(self, peer: int, error: BaseException) -> DistributedError:
        self.lost.add(peer)
        return DistributedError(
            f"rank {self.rank} waited for rank {peer} and lost it\nrank {peer} went silent for "
            f"{self.timeout:g} s or failed ({type(error).__name__}: {error}); see its output")


HEADER_BYTES = 1024    # a header's first message: its length (8 bytes) and, when it fits, itself


def _header_tensors(header: Any) -> list[torch.Tensor]:
    """What `header`, pickled, goes as: one tensor of `HEADER_BYTES` holding its length and
    the pickle, or, for a longer pickle, the length alone and then the pickle in a second.
    (`send_object_list` sends the length and the pickle apart every time: 2.5x the time of one
    fixed-size send here, on messages of 64 KB.)"""
    data = pickle.dumps(header)
    first = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    first[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    if len(data) <= HEADER_BYTES - 8:
        first[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return [first]
    return [first, torch.frombuffer(bytearray(data), dtype=torch.uint8)]


def _post_header_recv(peer: int, group: Any) -> tuple[Any, torch.Tensor]:
    """The receive of `peer`'s next header's first tensor, posted."""
    first = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    return dist.irecv(first, src=peer, group=group), first


def _header_of(first: torch.Tensor, peer: int, group: Any) -> Any:
    """The header whose first tensor is `first`, receiving the rest of a long one from `peer`."""
    length = int.from_bytes(first[:8].numpy().tobytes(), "little")
    if length <= HEADER_BYTES - 8:
        return pickle.loads(first[8:8 + length].numpy().tobytes())
    rest = torch.empty(length, dtype=torch.uint8)
    dist.recv(rest, src=peer, group=group)
    return pickle.loads(rest.numpy().tobytes())


def _meta(v: Any, payload: list[torch.Tensor], carrier: torch.device) -> Any:
    """A tensor's `_TensorMeta`, its data (a copy on the `carrier` device where needed) added
    to `payload`."""
    if not isinstance(v, torch.Tensor):
        return v
    if v.numel() > 0:
        payload.append(v.detach().to(carrier).contiguous())
    return _TensorMeta(tuple(v.shape), v.dtype, v.requires_grad)


def _metas(values: Any) -> list[_TensorMeta]:
    """The `_TensorMeta`s in `values`, in the order `_meta` met their tensors."""
    found: list[_TensorMeta] = []
    for v in values:
        fx.node.map_aggregate(v, lambda x: found.append(x) if isinstance(x, _TensorMeta) else x)
    return found

