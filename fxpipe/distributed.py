"""Run a saved plan on `torch.distributed`: one process per stage and replica, started by torchrun.

    # run.py, launched with: torchrun --nproc-per-node 2 run.py   (or 4: two replicas)
    stage = fxpipe.distributed.load("plans/model-2")    # rank r runs stage r % 2, its weights only
    y = stage(x if stage.index == 0 else None)          # the model's output on the last stage
    loss = stage.train_step(x, target, loss_fn)         # x on stage 0, target on the last stage

Replicas: a world of `replicas x stages` ranks runs `replicas` copies of the pipeline; rank r
runs stage `r % stages` of replica `r // stages` (replica k is ranks k*stages .. k*stages +
stages - 1), each replica on the inputs given to its own stage 0 (its shard of the batch; shards
may differ in size). A `train_step` is the whole batch's: each replica weights its loss by its
share of the rows (with a mean loss; a sum is a sum), so that after the step each stage's
replicas add up their gradients (one all-reduce over a gloo group of that stage's ranks) and
every rank holds the whole batch's gradients, and every last stage returns the whole batch's
loss.

Placement: a plan's devices are those of the host it was planned on. Each rank loads its stage
on `load(path, device=...)`, by default (`rank_device`) a stage planned on a GPU on the rank's
own GPU, `cuda:LOCAL_RANK` under torchrun, made the current device, so that replicas on one host
do not share GPUs; a stage planned on the CPU stays there.

Tied weights: a parameter several stages hold (an embedding the output layer reads again) is
loaded by each of their ranks, and each one's backward gives it only its stage's part. The saved
plan's `shared` entries say which stages hold which; `load` makes a gloo group of the ranks
holding them in each replica (every rank makes every group, in one order), and after the
backward each holder's gradient is summed over its group, before the replicas add theirs up.
Each holder then has the model's gradient, and the same optimizer step keeps the copies equal.

The flow, in each replica: its stage-0 rank is also the driver: it splits the inputs into the
plan's micro-batches and sends each stage the graph inputs it reads. Every rank walks its own
stage's row of the timetable (the same `StageRow` the thread runtime walks, so messages follow
the same order; `schedules.message_orders` lists them per pair of ranks), GPipe for a call and
the plan's schedule for `train_step`. Graph outputs go to the last rank, which returns the model's
output (a call) or computes the loss (`train_step`); every other rank returns None. Gradients
are left in each rank's stage parameters' `.grad`, named as in the model. A graph input given to
`train_step` with `requires_grad` gets its gradient on stage 0's rank: the stages on other ranks
reading it send back its gradients once their backwards are done. A `loss_fn` returning
`(loss_sum, count)` gives the mean over every replica's counts (one all-reduce per step tells
every rank the whole count, by which this step's gradients are scaled). `stage.last_run` is
this rank's row of the latest step, timed on its own clock (a `Run`, as `pipe.last_run`).

Messages go by torch's own engine, over a gloo process group: a message's header (which phase,
sender, receiver and micro-batch, the values' structure, each tensor's shape and dtype), pickled
into one fixed-size byte tensor (one send where `send_object_list` takes two and 2.5x the time),
then each tensor. Gloo's `send` waits for the receiver's `recv`, so two stages sending to each
other at once (1F1B) would wait for ever: every send is posted (`isend`) on the rank's own
thread, in the order its stage produced the messages, and let go when the peer's next header
says it took it (each header counts the messages its sender took), or when the step ends. A
receiver takes a peer's messages in that order, keeping
those it needs later, and posts the receive of a peer's next header as soon as it took one.
Every wait ends after `timeout` seconds with a `DistributedError` naming the rank that went
silent. No thread is started.

Failures end every rank: a stage that raises gives its rank a `StageError` naming the rank and
stage, and it sends every peer an abort header behind what it sent before; a rank receiving one
raises `PeerFailedError` (a `DistributedError`) naming the rank that failed first, and tells
every peer in turn. A rank that finished its row still hears it: the step ends with a "done"
header from every peer to every peer, read in order behind their messages. A peer that dies is
met as a closed connection or a timeout, naming it. A rank that cannot load its stage
(`PlanFileError`) makes the others raise a `DistributedError` naming it. A failed step leaves
the stage unusable: close it (`with` does), which reads each peer's messages up to its news of
the failure, so every rank's sends are taken and every rank ends without waiting for a timeout,
and start again.

A plan balances and predicts with what it was told values cost: plan for a run here with
`link="gloo"` (`measure_link`), or `load` warns on rank 0.

Not in this slice: gradients across ranks in a call (`stage(x)`: each rank's autograd graph
ends at what it received; `train_step` is the way to gradients); CUDA stages go through CPU
copies (no NCCL).
"""

from __future__ import annotations

import collections
import datetime
import os
import pickle
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from fxpipe.passes.cost_model import DeviceSpec, Link
from fxpipe.passes.errors import FxpipeError, StageError
from fxpipe.passes.graph_values import tensors
from fxpipe.passes.randomness import microbatch_seeds

from . import microbatch
from .microbatch import on_device
from .pipeline import check_loss, step_inputs
from .devices import DeviceLike
from .report import LINKS
from .runtime.executor import StageExecutor
from .runtime.orchestrator import Run, StageRow, _stage_error
from .saved import load_stage_plan, planned_device, shared_tensors, stage_count
from .schedules import Phase, Slot, gpipe, timetable_for
from .wiring import DRIVER, Flow

__all__ = ["DistributedError", "DistributedStage", "DistributedTransport", "PeerFailedError",
           "WorldSizeError", "load"]


class DistributedError(FxpipeError):
    """A distributed run that cannot go on: a peer went silent or failed, or no process group."""


class WorldSizeError(DistributedError):
    """The number of processes differs from the plan's number of stages."""


def load(path: str | os.PathLike, *, device: DeviceLike | None = None,
         timeout: float = 60.0) -> "DistributedStage":
    """This process's stage of the plan saved at `path`, its weights only.

    The world is `replicas x stages` processes: rank r runs stage `r % stages` of replica
    `r // stages` (one process per stage is one replica). The stage runs on `device`; by default
    (see `rank_device`) a stage planned on a GPU runs on this process's own GPU, `cuda:LOCAL_RANK`
    under torchrun, and one planned on the CPU on the CPU. Joins the default process group,
    initialised here from torchrun's environment (env://, gloo) unless the caller did; `timeout`
    (seconds) bounds every wait for another rank. A rank that cannot load its stage makes every
    rank raise: itself its error, the others a `DistributedError` naming it.
    """
    group, owned = _process_group(timeout)
    try:
        return _load(path, device, timeout, group, owned)
    except BaseException:
        if owned:    # a process group left behind at exit can abort the process (SIGABRT)
            dist.destroy_process_group()
        raise


def measure_link(*, repeats: int = 20, timeout: float = 60.0) -> Link:
    """What one message between two ranks on this host costs, sent as `fxpipe.distributed`
    sends it (a `DistributedTransport`'s message: its header, then its tensor, over gloo): latency
    and bandwidth from ping-pongs of 64 KB and 16 MB messages between two processes started
    here (a few seconds). Plan with it so the plan prices values as they will travel:

        link = fxpipe.distributed.measure_link()
        fxpipe.plan(model, ["cpu"] * 4, (x,), link=lambda src, dst: link).save("plan/")
    """
    import tempfile

    import torch.multiprocessing as mp
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{os.path.join(folder, 'rendezvous')}"
        processes = [context.Process(target=_ping_pong, args=(rank, init, repeats, timeout,
                                                               results), daemon=True)
                     for rank in range(2)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout + 30)
        codes = [process.exitcode for process in processes]
        if codes != [0, 0] or results.empty():
            for process in processes:
                process.kill()
            raise DistributedError(f"measuring a gloo link between two processes failed (exit "
                                   f"codes {codes}): check that this host allows local gloo")
    one_way = results.get()
    small, large = sorted(one_way)
    bandwidth = (large - small) / max(one_way[large] - one_way[small], 1e-9)
    return Link(latency_s=max(one_way[small] - small / bandwidth, 0.0), bytes_per_s=bandwidth)


def _ping_pong(rank: int, init: str, repeats: int, timeout: float, results: Any) -> None:
    """One of `measure_link`'s two processes: the median one-way time of a message, by size,
    each going from one stage to the other through a `DistributedTransport`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout))
    transport = DistributedTransport(rank, torch.device("cpu"), timeout=timeout, peers=[0, 1])
    try:
        one_way = {}
        for nbytes in (64 << 10, 16 << 20):
            x = torch.zeros(nbytes // 4)
            times = []
            for m in range(repeats + 1):        # the first one warms up
                start = time.perf_counter()
                for phase, sender in ((Phase.FORWARD, 0), (Phase.BACKWARD, 1)):
                    if rank == sender:
                        transport.send(phase, sender, 1 - sender, m, {"x": x})
                    else:
                        transport.receive(phase, sender, 1 - sender, m)
                times.append((time.perf_counter() - start) / 2)
            transport.finish_step()
            one_way[nbytes] = statistics.median(times[1:])
        if rank == 0:
            results.put(one_way)
    finally:
        dist.destroy_process_group()


def rank_device(planned: torch.device, device: DeviceLike | None = None) -> DeviceLike:
    """Where this process runs a stage planned for `planned`: `device` when given; otherwise,
    for a stage planned on a GPU, this process's own GPU under torchrun (`cuda:LOCAL_RANK`: a
    plan's devices are those of the host it was planned on, and replicas on one host must not
    share a GPU), else `planned`. A CUDA device chosen becomes the current one
    (`torch.cuda.set_device`), so that what runs without naming a device runs there too."""
    if device is None:
        local = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local)) if (
            planned.type == "cuda" and local is not None) else planned
    chosen = torch.device(device.name if isinstance(device, DeviceSpec) else device)
    if chosen.type == "cuda" and chosen.index is not None:
        torch.cuda.set_device(chosen)
    return device


def _load(path: str | os.PathLike, device: DeviceLike | None, timeout: float, group: Any,
          owned: bool) -> "DistributedStage":
    rank, world = dist.get_rank(), dist.get_world_size()
    stages = stage_count(path)
    if world % stages:
        raise WorldSizeError(
            f"the plan at {str(path)!r} has {stages} stages but {world} processes run it (rank "
            f"{rank}): start a multiple of the stages, one process per stage and replica: "
            f"torchrun --nproc-per-node {stages} (or {2 * stages} for two replicas)")
    replica, index = divmod(rank, stages)
    loaded, error = None, None
    try:
        here = rank_device(planned_device(path, index), device)
        loaded = load_stage_plan(path, index, device=here), shared_tensors(path)
    except Exception as e:
        error = e
    _agree_loaded(rank, error, group, timeout)
    pipeline, gradients = _replica_groups(world // stages, stages, replica, index, timeout)
    (plan, stage), shared = loaded
    if rank == 0 and stages > 1 and plan.link != "gloo":
        warnings.warn(f"the plan at {str(path)!r} priced the values its stages exchange as "
                      f"{LINKS[plan.link]}, not as messages between processes, so it balanced "
                      f"and predicted with transfers too cheap: plan with "
                      f"fxpipe.plan(..., link='gloo') for a run under torchrun", stacklevel=3)
    tied = _tied_groups(_tied_parameters(plan, shared), stage, stages, world // stages,
                        replica, timeout)
    return DistributedStage(plan, stage, rank, group, timeout, owned, replica=replica,
                            replicas=world // stages, pipeline_group=pipeline,
                            gradient_group=gradients, tied=tied)


def _agree_loaded(rank: int, error: BaseException | None, group: Any, timeout: float) -> None:
    """Raise `error` here, and on every other rank a `DistributedError` naming the first rank
    that could not load its stage, so that no rank waits for a stage that never started."""
    states: list[Any] = [None] * dist.get_world_size()
    note = None if error is None else f"{type(error).__name__}: {error}"
    try:
        dist.all_gather_object(states, note, group=group)
    except RuntimeError as e:
        raise DistributedError(f"rank {rank} could not hear from every rank within {timeout:g} s "
                               f"after loading ({e}): see the other ranks' output") from None
    if error is not None:
        raise error
    failed = [(r, n) for r, n in enumerate(states) if n is not None]
    if failed:
        raise DistributedError(f"rank {failed[0][0]} could not load its stage "
                               f"({failed[0][1]}), so rank {rank} stops too: fix the plan "
                               f"files and start every rank again")


def _replica_groups(replicas: int, stages: int, replica: int, index: int,
                    timeout: float) -> tuple[Any, Any]:
    """This rank's pipeline group (its replica's ranks) and gradient group (its stage's
    replicas); None for both with one replica. Every rank creates every group, in one order,
    as `dist.new_group` requires."""
    if replicas == 1:
        return None, None
    wait = datetime.timedelta(seconds=timeout)
    pipelines = [dist.new_group(list(range(k * stages, (k + 1) * stages)), timeout=wait,
                                backend="gloo") for k in range(replicas)]
    gradients = [dist.new_group([k * stages + i for k in range(replicas)], timeout=wait,
                                backend="gloo") for i in range(stages)]
    return pipelines[replica], gradients[index]


def _tied_parameters(plan: Any, shared: dict[tuple[int, str], dict[int, str]]
                     ) -> dict[tuple[int, ...], list[dict[int, str]]]:
    """The parameters needing a gradient that several stages hold (tied weights), by the
    stages holding them: each one's name in each of those stages. Read off the saved plan's
    `shared` entries (`saved.shared_tensors`), the same on every rank; buffers are left out."""
    tied: dict[tuple[int, ...], list[dict[int, str]]] = {}
    for (first, name), held in sorted(shared.items()):
        try:       # the plan's skeleton tells parameters from buffers, on any rank
            parameter = plan.stages[first].module.get_parameter(name)
        except AttributeError:
            continue
        if parameter.requires_grad:
            tied.setdefault(tuple(sorted(held)), []).append(held)
    return tied


def _tied_groups(tied: dict[tuple[int, ...], list[dict[int, str]]], stage: Any, stages: int,
                 replicas: int, replica: int, timeout: float
                 ) -> list[tuple[Any, list[torch.nn.Parameter]]]:
    """For each set of stages sharing parameters, in one order on every rank, a gloo group of
    the ranks holding them in each replica (`dist.new_group` is collective); this rank's groups
    with its parameters in each, in that order."""
    wait = datetime.timedelta(seconds=timeout)
    mine = []
    for holders, parameters in sorted(tied.items()):
        for k in range(replicas):
            group = dist.new_group([k * stages + s for s in holders],
                                   timeout=wait, backend="gloo")
            if k == replica and stage.index in holders:
                mine.append((group, [stage.module.get_parameter(held[stage.index])
                                     for held in parameters]))
    return mine


def _process_group(timeout: float) -> tuple[Any, bool]:
    """The group messages travel in, and whether this call initialised the default one.

    The default group when it is gloo; a gloo group of every rank beside another backend."""
    if not dist.is_available():
        raise DistributedError("this torch has no torch.distributed: install a build with it")
    wait = datetime.timedelta(seconds=timeout)
    if dist.is_initialized():
        return (None if dist.get_backend() == "gloo" else
                dist.new_group(backend="gloo", timeout=wait)), False
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
               if v not in os.environ]
    if missing:
        raise DistributedError(
            f"no process group, and {', '.join(missing)} not set: start the script with "
            f"torchrun --nproc-per-node <stages> script.py, or call "
            f"torch.distributed.init_process_group first")
    dist.init_process_group("gloo", init_method="env://", timeout=wait)
    return None, True


# ---- the transport --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _TensorMeta:
    """What a receiver needs to receive a tensor into: in a header, in the tensor's place."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


Key = tuple[Phase, int, int, int]     # (phase, sender, receiver, micro-batch)


class PeerFailedError(DistributedError):
    """Another rank of the pipeline failed and told this one: `origin` is the rank that failed
    first, `note` says why."""

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
                 timeout: float = 60.0, base: int = 0, peers: list[int] | None = None):
        self.rank = rank
        self.device = device
        self.group = group
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
        structure = {name: fx.node.map_aggregate(v, lambda t: _meta(t, payload))
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
                                       f"of micro-batch {microbatch} was never sent")
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
        header (the kind, the messages taken from `peer` so far, `body`), then `payload`."""
        sends = []
        for t in (*_header_tensors((kind, self.taken[peer], body)), *payload):
            try:
                sends.append((dist.isend(t, dst=peer, group=self.group), t))
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
        """The receive of one tensor of `meta`'s shape from `peer`, posted."""
        t = torch.empty(meta.shape, dtype=meta.dtype)
        return (dist.irecv(t, src=peer, group=self.group) if t.numel() > 0 else None), t

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
            f"rank {self.rank} waited for rank {peer} and lost it: rank {peer} went silent for "
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


def _meta(v: Any, payload: list[torch.Tensor]) -> Any:
    """A tensor's `_TensorMeta`, its data (a CPU copy where needed) added to `payload`."""
    if not isinstance(v, torch.Tensor):
        return v
    if v.numel() > 0:
        payload.append(v.detach().to("cpu").contiguous())
    return _TensorMeta(tuple(v.shape), v.dtype, v.requires_grad)


def _metas(values: Any) -> list[_TensorMeta]:
    """The `_TensorMeta`s in `values`, in the order `_meta` met their tensors."""
    found: list[_TensorMeta] = []
    for v in values:
        fx.node.map_aggregate(v, lambda x: found.append(x) if isinstance(x, _TensorMeta) else x)
    return found


# ---- the stage ------------------------------------------------------------------------------------

class DistributedStage:
    """This process's stage of a plan; every rank calls it alike (see the module docstring).

    `module` is the stage's GraphModule: its parameters, named as in the model, are what this
    rank's optimizer steps.
    """

    def __init__(self, plan: Any, stage: Any, rank: int, group: Any, timeout: float,
                 owns_group: bool = False, *, replica: int = 0, replicas: int = 1,
                 pipeline_group: Any = None, gradient_group: Any = None,
                 tied: list[tuple[Any, list[torch.nn.Parameter]]] | None = None):
        self.plan = plan
        self.stage = stage
        self.rank = rank
        self.group = group
        self.timeout = timeout
        self.owns_group = owns_group
        self.num_stages = len(plan.stages)
        self.last = self.num_stages - 1
        self.replica = replica
        self.replicas = replicas
        self.pipeline_group = group if pipeline_group is None else pipeline_group
        self.gradient_group = gradient_group
        self.tied = tied or []      # (group of the ranks holding them, parameters) per holders
        self.base = replica * self.num_stages       # the rank of this replica's stage 0
        self.flow = _flow(plan)
        self.transport = DistributedTransport(
            rank, stage.device, group=group, timeout=timeout, base=self.base,
            peers=list(range(self.base, self.base + self.num_stages)))
        # This rank's actions in the latest call or train_step, seconds from its own start
        # (each rank's clock: compare a stage's times with the plan's, not ranks' starts).
        self.last_run: Run | None = None

    @property
    def index(self) -> int:
        """This rank's stage: `rank % stages`."""
        return self.stage.index

    @property
    def module(self) -> fx.GraphModule:
        return self.stage.module

    def parameters(self):
        return self.stage.module.parameters()

    def named_parameters(self):
        return self.stage.module.named_parameters()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output (on stage `last`; None elsewhere) for the inputs given on stage 0
        (those given elsewhere are not read), in the plan's micro-batches, GPipe order; each
        replica runs its own inputs."""
        chunks: list[dict[str, Any]] = []

        def prepare() -> None:
            values = dict(zip(self.plan.signature.placeholders,
                              self.plan.signature.flatten_inputs(args, kwargs)))
            chunks.extend(microbatch.split(values, self.plan.chunks, self._batch_dims))

        seeds, _ = self._start(prepare)
        outputs: dict[int, Any] = {}

        def collect(m: int, received: dict[str, Any], out: dict[str, Any]) -> None:
            outputs[m] = self.plan.signature.rebuild_outputs({**received, **out})

        self._run(gpipe(self.num_stages, self.plan.chunks), chunks, seeds, None,
                  collect if self.index == self.last else None)
        if self.index != self.last:
            return None
        return microbatch.merge([outputs[m] for m in range(self.plan.chunks)],
                                self.plan.output_dims)

    def train_step(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], Any], *,
                   reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor | None:
        """Forward and backward of every micro-batch in the plan's schedule, as
        `Pipeline.train_step` does: `inputs` on stage 0, `target` on stage `last` (each not read
        elsewhere, and moved to its stage's device), each replica its own shard of the batch
        (shards may differ in size).

        Returns, on stage `last` of every replica (None elsewhere), the loss of the whole batch,
        every replica's shard together: with `reduction="mean"` the replicas' shard losses
        weighted by their shares of the rows, with `"sum"` their sum. This step's gradients are
        those of that loss: a parameter several stages share (a tied weight) gets the sum over
        the ranks of its replica holding it, and each stage's replicas add theirs up, each
        replica's weighted by its share of the rows (`"mean"`); then they are added to what
        `.grad` held. An input given with `requires_grad` on stage 0 gets its gradient there too
        (its rows' share of the whole batch's loss), from every stage reading it. The optimizer
        step is the caller's, on each rank.

        A `loss_fn` returning `(loss_sum, count)` (a loss averaged over something other than
        rows, as for `Pipeline.train_step`) makes the step's loss `sum(loss_sums) / sum(counts)`
        over every micro-batch of every replica, and the gradients (parameters and inputs)
        those of that mean; `reduction` is then not used. Every rank learns the whole count in
        one all-reduce at the end of each step.
        """
        if reduction not in ("mean", "sum"):
            raise FxpipeError(f"reduction={reduction!r}: use 'mean' or 'sum', as loss_fn reduces")
        chunks: list[dict[str, Any]] = []
        leaves: list[torch.Tensor] = []      # the caller's inputs that take a gradient

        def prepare() -> int:
            values = step_inputs(self.plan.signature, inputs)
            leaves.extend(t for t in tensors(values) if t.requires_grad and t.is_leaf)
            chunks.extend(microbatch.split(values, self.plan.chunks, self._batch_dims))
            return microbatch.batch_size(values, self._batch_dims)

        seeds, rows_in = self._start(prepare)
        # This replica's share of the whole batch's loss, so that every gradient (parameters and
        # inputs alike) is already its part of the whole batch's, and replicas add theirs up.
        share = 1.0
        if self.replicas > 1 and reduction == "mean":
            rows = torch.tensor([float(rows_in)], dtype=torch.float64)
            self._all_reduce([rows], self.gradient_group, "count the rows with its replicas")
            share = rows_in / rows.item()
        targets: list[Any] = []
        weights: list[float] = []

        def prepare_targets() -> None:
            targets.extend(on_device(t, self.stage.device)
                           for t in microbatch.split(target, self.plan.chunks))
            rows = [microbatch.batch_size(t) for t in targets]
            if sum(rows) != rows_in:
                raise FxpipeError(f"the target has {sum(rows)} rows but the inputs have "
                                  f"{rows_in}: pass one target row per sample")
            weights.extend(share * r / sum(rows) if reduction == "mean" else 1.0 for r in rows)

        self._agree(self.last, prepare_targets)

        counts: dict[int, torch.Tensor] = {}    # kept on their device: no sync per micro-batch

        def loss_of(m: int, values: dict[str, Any]) -> torch.Tensor:
            output = self.plan.signature.rebuild_outputs(values)
            loss = loss_fn(output, targets[m])
            if isinstance(loss, tuple) and len(loss) == 2:
                loss, counts[m] = loss[0], torch.as_tensor(loss[1]).detach()
            elif counts:
                raise FxpipeError("loss_fn returned (loss_sum, count) for one micro-batch but not "
                                  "for another: return the same for every micro-batch")
            check_loss(loss, output, "a 0-d tensor (or a (loss_sum, count) pair)")
            return loss if counts else loss * weights[m]

        timetable = timetable_for(self.plan.schedule, self.num_stages, self.plan.chunks,
                                  backward=True)
        held = self._hold_gradients(leaves)
        executor = self._run(timetable, chunks, seeds, loss_of, None, training=True)
        # The whole count, when the losses were (loss_sum, count) pairs: every gradient of this
        # step is scaled by one over it, known only now, on every rank.
        whole = torch.tensor([float(sum(c.to("cpu", torch.float64) for c in counts.values())),
                              float(bool(counts))], dtype=torch.float64)
        self._all_reduce([whole], None, "learn the whole batch's count from the last stages")
        scale = 1 / whole[0].item() if whole[1] > 0 and whole[0] > 0 else 1.0
        self._reduce_gradients(held, scale)
        if self.index != self.last:
            return None
        loss = torch.stack([executor.losses[m] for m in range(self.plan.chunks)]).sum()
        if self.replicas > 1:
            total = loss.detach().to("cpu", torch.float64).reshape(1)
            self._all_reduce([total], self.gradient_group, "add up the loss with its replicas")
            loss = total[0].to(loss.device, loss.dtype)
        return loss * scale

    def close(self) -> None:
        """After a failed step, take the other ranks' news of it (see `DistributedTransport.close`);
        then end the process group if `load` started it."""
        self.transport.close()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> "DistributedStage":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- one step

    def _hold_gradients(self, leaves: Sequence[torch.Tensor] = ()
                        ) -> dict[torch.Tensor, torch.Tensor | None]:
        """This stage's parameters' `.grad`, and the caller's inputs' (`leaves`), taken aside
        (left None), so that only this step's gradients are added up across ranks and scaled;
        `_reduce_gradients` adds them back."""
        held = {p: p.grad for p in [*self.parameters(), *leaves]}
        for p in held:
            p.grad = None
        return held

    def _reduce_gradients(self, held: dict[torch.Tensor, torch.Tensor | None],
                          scale: float = 1.0) -> None:
        """Add this step's gradients up across ranks, then add back what `.grad` held: first
        each tied parameter's over the ranks of this replica holding it (a stage that held it
        but got no gradient adds zeros), then each parameter's over this stage's replicas (their
        losses were weighted by their shares, so the sum is the whole batch's); this step's
        gradients are then multiplied by `scale` (one over the whole count of a step whose
        losses were `(loss_sum, count)` pairs)."""
        for group, parameters in self.tied:
            for p in parameters:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._all_reduce([p.grad for p in parameters], group,
                             "add up the gradients of weights it shares with other stages")
        if self.replicas > 1:
            grads = [p.grad for _, p in sorted(self.named_parameters()) if p.grad is not None]
            self._all_reduce(grads, self.gradient_group,
                             f"add up stage {self.index}'s gradients with its "
                             f"{self.replicas - 1} other replicas")
        for p, before in held.items():
            if scale != 1.0 and p.grad is not None:
                p.grad.mul_(scale)
            if before is not None:
                p.grad = before if p.grad is None else before.add_(p.grad)

    def _all_reduce(self, tensors: list[torch.Tensor], group: Any, what: str) -> None:
        """Sum `tensors` in place over `group`'s ranks: one all-reduce of them all, flattened
        on the CPU as gloo needs."""
        if not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).to("cpu") for t in tensors])
        try:
            dist.all_reduce(flat, group=group)
        except RuntimeError as e:
            raise DistributedError(
                f"rank {self.rank} could not {what} within {self.timeout:g} s ({e}): a rank "
                f"went silent or failed; see the other ranks' output") from None
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    @property
    def _batch_dims(self) -> dict[str, Any]:
        return {p: self.plan.batch_dims.get(p, 0) for p in self.plan.signature.placeholders}

    def _start(self, prepare: Callable[[], Any]) -> tuple[list[int], Any]:
        """Rank 0 prepares the step's inputs (`prepare()`) and draws the micro-batch seeds; every
        rank gets the seeds and what `prepare` returned, or raises if it failed on rank 0."""
        return self._agree(0, lambda: (microbatch_seeds(self.plan.chunks), prepare()))

    def _agree(self, source: int, prepare: Callable[[], Any]) -> Any:
        """`prepare()` on stage `source` of this replica, its result on every rank of the
        replica; its error raised on each (on the others as a `DistributedError` naming it), so
        none waits for a step that will not start."""
        box: list[Any] = [None]
        error: BaseException | None = None
        source = self.base + source
        if self.rank == source:
            try:
                box[0] = ("ok", prepare())
            except Exception as e:
                error = e
                box[0] = ("error", f"{type(e).__name__}: {e}")
        try:
            dist.broadcast_object_list(box, src=source, group=self.pipeline_group)
        except RuntimeError as e:
            raise DistributedError(
                f"rank {self.rank} could not start the step with the ranks of replica "
                f"{self.replica} within {self.timeout:g} s ({e}): one went silent or failed; "
                f"see their output") from None
        if error is not None:
            raise error
        status, value = box[0]
        if status == "error":
            raise DistributedError(f"rank {source} could not start the step: {value}")
        return value

    def _run(self, timetable: list, chunks: list[dict[str, Any]], seeds: list[int],
             loss_of: Callable[[int, dict[str, Any]], torch.Tensor] | None,
             forwarded: Callable[[int, dict[str, Any], dict[str, Any]], None] | None, *,
             training: bool = False) -> StageExecutor:
        """Feed the graph inputs (stage 0), walk this stage's row, in `training` return the
        gradients of the graph inputs to stage 0, then finish the step with the pipeline's
        peers. A failure of the stage is raised as a `StageError` naming this rank; a failure
        here or a peer's is told to every peer (`DistributedTransport.abort`)."""
        index = self.index
        executor = StageExecutor(
            self.stage,
            from_stages=[n for src, names in self.flow.reads.get(index, {}).items()
                         if src != DRIVER for n in names],
            backward_for={a.microbatch for a in timetable[index]
                          if a.phase is Phase.BACKWARD},
            loss_of=loss_of if index == self.last else None,
            seeds=seeds, recompute=self.plan.stage_recompute[index])
        if index == 0:
            for m, values in enumerate(chunks):
                for dst, names in self.flow.sends.get(DRIVER, {}).items():
                    self.transport.send(Phase.FORWARD, DRIVER, dst, m,
                                        {n: values[n] for n in names})
        inputs: dict[int, dict[str, Any]] = {}      # micro-batch -> graph inputs received

        def received(m: int, values: dict[str, Any], out: dict[str, Any]) -> None:
            if training:
                inputs[m] = {n: values[n] for n in self.flow.reads.get(index, {}).get(DRIVER, [])}
            if forwarded is not None:
                forwarded(m, values, out)

        row = StageRow(executor, timetable[index], self.flow, self.transport)
        record = self.last_run = Run(num_stages=self.num_stages)
        start = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - start

        def done(action: Any, began: float) -> None:
            record.slots.append(Slot(action, began, clock()))
        try:
            with executor.computing():
                row.walk(forwarded=received, clock=clock, done=done)
            if training and index != 0:
                self._send_input_grads(inputs)
            if training and index == 0:
                self._take_input_grads(chunks)
            self.transport.finish_step()
        except PeerFailedError as e:
            record.error = str(e)
            self.transport.abort(e.note, origin=e.origin)
            raise
        except DistributedError as e:
            record.error = str(e)
            self.transport.abort(f"rank {self.rank} stopped: {e}")
            raise
        except Exception as e:
            error = self._stage_error(row.action, e)
            record.error = str(error)
            self.transport.abort(f"rank {self.rank} failed: {error}")
            raise error from e
        finally:
            record.wall_s = clock()
        return executor

    # The graph inputs a stage on another rank reads arrive there as leaves of its autograd
    # graph; after its backwards, their gradients go back to stage 0's rank, which passes them
    # on to the caller's tensors. A stage reading only inputs that need no gradient sends
    # nothing, and stage 0's rank, knowing what it sent, expects nothing.

    def _send_input_grads(self, inputs: dict[int, dict[str, Any]]) -> None:
        """Send stage 0's rank the gradients of the graph inputs this stage received, per
        micro-batch, where any of them needs one."""
        for m, values in sorted(inputs.items()):
            if any(t.requires_grad for t in tensors(values)):
                self.transport.send(Phase.BACKWARD, self.index, DRIVER, m,
                                    {n: [t.grad for t in tensors(v)] for n, v in values.items()})

    def _take_input_grads(self, chunks: list[dict[str, Any]]) -> None:
        """Receive the gradients of the graph inputs sent to stages on other ranks and
        backpropagate them into the caller's inputs (stage 0's own reached them already)."""
        for dst, names in self.flow.sends.get(DRIVER, {}).items():
            if self.transport.rank_of(dst) == self.rank:
                continue
            for m, values in enumerate(chunks):
                sent = {n: values[n] for n in names}
                if not any(t.requires_grad for t in tensors(sent)):
                    continue
                grads = self.transport.receive(Phase.BACKWARD, dst, DRIVER, m)
                pairs = [(t, g.to(t.device)) for n in names
                         for t, g in zip(tensors(sent[n]), grads[n])
                         if g is not None and t.requires_grad]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def _stage_error(self, action: Any, error: BaseException) -> StageError:
        """The runtime's `StageError` for `error`, naming this rank and replica too."""
        if isinstance(error, StageError):
            return error
        inner = _stage_error(self.stage, action, error)
        where = f"rank {self.rank}" + (f" (replica {self.replica})" if self.replicas > 1 else "")
        return StageError(f"{where}: {inner}", stage=inner.stage, microbatch=inner.microbatch)


def _flow(plan: Any) -> Flow:
    """Who sends what to whom across ranks: the training wiring (graph outputs go to the last
    stage) in both modes, and the last stage also reads from the driver the graph inputs the
    model returns as they are (the model's output is rebuilt there)."""
    last = len(plan.stages) - 1
    reads = {receiver: {sender: list(names) for sender, names in senders.items()}
             for receiver, senders in plan.wiring.training.reads.items()}
    placeholders = set(plan.signature.placeholders)
    returned = [leaf for leaf in plan.signature.out_leaves
                if isinstance(leaf, str) and leaf in placeholders]
    if returned:
        from_driver = reads.setdefault(last, {}).setdefault(DRIVER, [])
        from_driver.extend(n for n in dict.fromkeys(returned) if n not in from_driver)
    return Flow.of_reads(reads)
