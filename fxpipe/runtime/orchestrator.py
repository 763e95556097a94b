"""The orchestrator: runs a timetable, one worker per stage, and records what ran when.

The caller's thread is the driver: it sends each stage the graph inputs it reads, one message per
micro-batch, and collects what comes back. Each stage's worker walks its row of the timetable: a
forward receives the micro-batch's values from every stage (or the driver) the stage reads from,
has the stage's `StageExecutor` compute, and sends each reader its values; a backward receives the
readers' gradients and sends the inputs' gradients back to their producers. Messages travel by a
`Transport` (here `ThreadTransport`, threads and queues); workers release the GIL inside torch
ops, so stages overlap. Walking one row is `StageRow`'s, and driving a run `Driver`'s, which
`fxpipe.distributed` shares: there each process drives its own stage's row against a transport
on `torch.distributed`. The workers
are the runtime's own, started at its first run and parked between runs (`workers.Workers`),
so a stage's thread state (intra-op threads, GPU, cuDNN's plans) lives across calls, steps and
streams. One stage runs on the caller's thread: no worker to hand over to, so a pipeline of one
stage costs what the model costs; the caller's intra-op thread count is restored afterwards.

Inference and training differ only in their timetable and their loss. Without `loss_of` the
graph outputs go back to the driver; with it they go to the last stage, which turns them into
the micro-batch's loss, and the timetable's backwards run the executors' backwards.

Each CPU stage may have its own intra-op thread count, set once on its worker as it starts, after
torch's per-thread initialisation (`set_thread_count`).

If a stage fails (whatever it raises), or the caller's thread is interrupted (Ctrl-C), the run is
aborted: a flag every worker checks between actions, and the transport's abort, which wakes every
waiting thread. All workers stop within one action, the run waits for each to park again
whatever happens, and
the caller gets the first `StageError`, naming the stage, the micro-batch and the statement that
failed (or its own `KeyboardInterrupt`). The driver waits with timeouts, so a signal reaches it
while it waits. `Run` records the actions that finished, for a failed run too. A GPU stage's
actions are recorded as the GPU ran them (CUDA events on its stream), not as the host launched
them; the events are read when the record is first read, so a call returns as soon as its work is
queued, as the model's own call does, and the host never waits per micro-batch.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import re
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from fxpipe.passes.stage import Stage
from fxpipe.passes.device import (Event, Stream, is_cpu, is_gpu, set_device, stream_for,
                                  timing_event)
from fxpipe.passes.errors import PartitionError, StageError

from ..schedules import Action, Phase, Slot, Timetable
from ..wiring import DRIVER, Flow, Wiring
from .executor import LossFn, StageExecutor
from .state import StageState
from .transport import Aborted, ThreadTransport, Transport
from .workers import Workers



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


class Runtime:
    """Runs timetables on a pipeline's stages along their `Wiring`, any number of times."""

    def __init__(self, stages: Sequence[Stage], wiring: Wiring, *,
                 threads_per_stage: int | Sequence[int | None] | None = None,
                 recompute: bool | Sequence[bool] = False):
        self.stages = list(stages)
        self.wiring = wiring
        # Per stage: its training forwards keep only their inputs (see the executor).
        self.recompute = (list(recompute) if isinstance(recompute, Sequence)
                          else [recompute] * len(self.stages))
        # Each CPU stage's intra-op threads (None: as the thread starts).
        self.threads = (list(threads_per_stage) if isinstance(threads_per_stage, Sequence)
                        else [threads_per_stage] * len(self.stages))
        self.streams = [stream_for(s.device) for s in stages]
        self.last_run: Run | None = None    # the latest run's record, failed or not
        self._in_order = False
        self.workers = Workers([_setup(s.device, t) for s, t in zip(self.stages, self.threads)])
        # What each stage keeps across runs (`runtime.state`): empty until a use allocates it.
        self.state = [StageState(s.index, s.device) for s in self.stages]
        # Dropped without `close()`: the workers end as the runtime is collected (they hold no
        # reference to it).
        weakref.finalize(self, self.workers.close, wait=False)

    def close(self) -> None:
        """End the stage workers and free each stage's state; a later run raises
        `PipelineClosedError`."""
        self.workers.close()
        for state in self.state:
            state.free()

    @property
    def closed(self) -> bool:
        return self.workers.closed

    @contextlib.contextmanager
    def in_order(self) -> Iterator[None]:
        """Inside, a forward-only run takes its stages one after another on the caller's
        thread, each stage's micro-batches in order (no worker threads: a message waits in its
        queue until its reader's turn): how compile checks a pipeline's stages."""
        self._in_order = True
        try:
            yield
        finally:
            self._in_order = False

    def run(self, timetable: Timetable, inputs: Sequence[dict[str, Any]], *,
            loss_of: LossFn | None = None,
            seeds: Sequence[int] | None = None) -> tuple[list[Any], Run]:
        """Run `timetable` on per-micro-batch graph inputs, micro-batch m drawing from `seeds[m]`.

        Returns per-micro-batch graph outputs (inference) or per-micro-batch losses, detached
        (training), and the record of the run (also `self.last_run`, kept when the run fails).
        """
        return _Execution(self, timetable, inputs, loss_of, seeds).run()


    def stream(self, inputs: Iterable[dict[str, Any]], *, max_in_flight: int,
               seed: Callable[[], int | None] = lambda: None
               ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """Each item's graph inputs through the stages as it comes, yielding (its inputs, its
        graph outputs) in order; see `_Stream`."""
        return _Stream(self, max_in_flight, seed).run(iter(inputs))


class Driver:
    """One run's driving, written once for every way of running stages: a call, a step, a
    stream, asynchronous learning (`_Rows`, on the runtime's workers) and a torchrun rank's
    stage (`fxpipe.distributed`, on the caller's thread against its peers): the record made
    the latest run's, the stages' GPU work ordered after the caller's, each row walked with its
    failures kept as `StageError`s, the abort, and after the run the first failure raised.

    A subclass gives the `transport`, its `executors` and, to hand rows to threads, `workers`;
    `recorded(record)` is told the run's record, `abort()` tells whoever waits that the run
    stopped, and `caller_failed(error, record)` is what the caller's own exception does."""

    executors: list[StageExecutor]
    workers: Workers | None = None
    # What the transport raises that is no stage's failure (a lost peer): raised as it is.
    transport_errors: tuple[type[BaseException], ...] = ()

    def __init__(self, transport: Transport):
        self.transport = transport
        self.stopping = threading.Event()
        self.errors: list[StageError] = []

    def recorded(self, record: "Run") -> None:
        """`record` is the run's from now on."""

    def abort(self) -> None:
        self.stopping.set()
        self.transport.abort(_reason(self.errors))

    def caller_failed(self, error: BaseException, record: "Run") -> None:
        """The caller's thread raised `error` (Ctrl-C, a failing source, a stage's abort):
        recorded at once, before the workers are waited for, and the run aborted."""
        if not (isinstance(error, GeneratorExit) or self.errors and isinstance(error, Aborted)):
            record.error = f"{type(error).__name__} in the caller's thread"
        self.abort()

    @contextlib.contextmanager
    def driving(self, record: Run, work: Callable[[int], None] | None,
                failure: Callable[[StageError], StageError] = lambda e: e) -> Iterator[Any]:
        """One run's set-up, hand-off, failure handling and record: `record` made the latest
        run's; the stages' GPU work ordered after the caller's; `work(i)` handed to every
        worker i for the block (yielding its `Jobs`; with `work` None the block runs the stages
        itself); what the caller's thread raises recorded, and its later GPU work queued after
        the stages'. After the block, the first stage failure is raised (as `failure` renames
        it), also in place of the `Aborted` it made the caller's thread raise."""
        self.recorded(record)
        record.started = time.perf_counter()
        for executor in self.executors:    # the caller's latest work on inputs and parameters
            executor.wait_for_caller()
        self.started(record)
        try:
            with contextlib.nullcontext() if work is None else \
                    self.workers.run(work, lambda e: self.caller_failed(e, record)) as jobs:
                yield jobs
        except GeneratorExit:      # a stream's consumer stopped early: the workers are at rest
            raise
        except BaseException as e:     # Ctrl-C, or anything else raised in the caller's thread
            if not (self.errors and isinstance(e, Aborted)):
                if work is None or record.error is None:    # (else the hand-off told it)
                    self.caller_failed(e, record)
                raise
        finally:
            for executor in self.executors:
                executor.make_caller_wait()
            record.wall_s = record.clock()
            record._slots.sort(key=lambda slot: (slot.start_s, slot.action.stage))
        if self.errors:
            error = failure(self.errors[0])
            record.error = str(error)
            raise error from error.__cause__

    def started(self, record: Run) -> None:
        """Called once the stages' work is ordered after the caller's, before any is handed."""

    def walk(self, row: "StageRow", **timing: Any) -> None:
        """Walk `row` on this thread, with its stage's intra-op threads; a failure is kept as a
        `StageError` and aborts the run (but the caller's own Ctrl-C, on the caller's thread,
        and the transport's own errors). An abort this run did not make (a peer's, under
        torchrun) is raised."""
        executor = row.executor
        try:
            with executor.computing():
                row.walk(stopping=self.stopping.is_set, **timing)
        except Aborted:
            if self.errors or self.stopping.is_set():
                return
            raise
        except self.transport_errors:
            raise
        except BaseException as e:   # whatever it is, the run must end
            if isinstance(e, KeyboardInterrupt) and threading.current_thread() is \
                    threading.main_thread():
                raise                # the caller's own Ctrl-C, on the caller's thread
            try:
                self.errors.append(stage_error(executor.stage, row.action, e))
            finally:
                self.abort()


class _Rows(Driver):
    """What a call and a stream share: the rows of one run (or stream) of the runtime's stages,
    walked on its workers against one `ThreadTransport` along `flow`."""

    def __init__(self, runtime: Runtime, flow: Flow):
        self.rt = runtime
        self.flow = flow
        self.workers = runtime.workers
        super().__init__(None)
        self.transport = ThreadTransport(
            flow.channels(), {DRIVER: None, **{s.index: s.device for s in runtime.stages}},
            self.stopping)

    def recorded(self, record: Run) -> None:
        self.rt.last_run = record


class _Stream(_Rows):
    """A stream: workers stay up for the whole stream, each stage takes the next item as soon as
    it is free, and the driver (the caller's thread, in the generator) feeds items while fewer
    than `max_in_flight` are inside, yields outputs in order, and ends the stream with an `END`
    message that each stage passes on before it stops. Closing the generator early (the
    consumer stopped), an item that fails to come (the iterable raised) or a stage that fails
    aborts the stream; every worker is back at rest before the generator returns.

    On GPUs the stream orders against the caller's streams as a call does: the stages start
    after the caller's queued work, each item's inputs are read after the caller's stream made
    them (the transport's events, recorded as it is fed), each output is handed back with the
    caller's stream waiting for it and marked as used there, and the caller's later work waits
    for the stages when the stream ends."""

    def __init__(self, runtime: Runtime, max_in_flight: int, seed: Callable[[], int | None]):
        flow = runtime.wiring.flow(training=False)
        silent = [s.index for s in runtime.stages if not flow.reads.get(s.index)]
        if silent:
            raise PartitionError(f"stage {silent[0]} reads no input nor other stage\nso it would "
                                 f"never learn that a stream ended: plan on fewer devices")
        super().__init__(runtime, flow)
        self.limit = max_in_flight
        self.seed = seed
        self.seeds: dict[int, int | None] = {}      # item -> its seed, drawn as it is fed
        self.executors = [StageExecutor(stage, from_stages=(), seeds=self.seeds,
                                        stream=runtime.streams[stage.index])
                          for stage in runtime.stages]

    def run(self, items: Iterator[dict[str, Any]]
            ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        inside: collections.deque[dict[str, Any]] = collections.deque()
        fed = 0
        with self.driving(Run(num_stages=len(self.rt.stages)), self.work, item_error):
            ended = False
            while True:
                while not ended and len(inside) < self.limit:
                    item = next(items, _NO_MORE)
                    ended = item is _NO_MORE
                    self.feed(fed, {END: None} if ended else item)
                    if not ended:
                        inside.append(item)
                        fed += 1
                if not inside:
                    break
                m = fed - len(inside)
                out = receive_values(self.flow, self.transport, DRIVER, m)
                # A stage is never that far behind the outputs: its seed will not be read.
                self.seeds.pop(m - 16 * self.limit, None)
                yield inside.popleft(), out

    def feed(self, m: int, values: dict[str, Any]) -> None:
        """Item m's graph inputs (or the stream's end) to every stage that reads them."""
        if END not in values:
            self.seeds[m] = self.seed()
        send_inputs(self.flow, self.transport, m, values)

    def work(self, index: int) -> None:
        """Stage `index` forwards items until the stream ends; a failure aborts the stream."""
        self.walk(StageRow(self.executors[index],
                           (Action(index, m, Phase.FORWARD) for m in itertools.count()),
                           self.flow, self.transport))


_NO_MORE = object()


class _Execution(_Rows):
    """One run: its executors, its transport, the first errors and its record."""

    def __init__(self, runtime: Runtime, timetable: Timetable, inputs: Sequence[dict[str, Any]],
                 loss_of: LossFn | None, seeds: Sequence[int] | None):
        super().__init__(runtime, runtime.wiring.flow(training=loss_of is not None))
        self.timetable = timetable
        self.inputs = list(inputs)
        self.loss_of = loss_of
        self.seeds = list(seeds) if seeds is not None else None
        self.executors = [self.executor(stage) for stage in runtime.stages]
        self.record = Run(num_stages=len(runtime.stages), microbatches=len(self.inputs))
        # A GPU stage's actions are timed by CUDA events on its stream, from an event recorded
        # there as the run starts: (seconds at that start, its event) per stage.
        self.origins: dict[int, tuple[float, Event]] = {}

    def executor(self, stage: Stage) -> StageExecutor:
        """`stage`'s executor for this run, made on the caller's thread to capture its modes."""
        last = stage.index == len(self.rt.stages) - 1
        return row_executor(
            stage, self.flow, self.timetable[stage.index],
            loss_of=self.graph_loss if self.loss_of is not None and last else None,
            seeds=self.seeds,
            stream=self.rt.streams[stage.index],
            recompute=self.rt.recompute[stage.index])

    def started(self, record: Run) -> None:
        """A GPU stage's actions are timed from an event recorded on its stream now."""
        for executor in self.executors:
            if executor.stream is not None:
                self.origins[executor.stage.index] = (record.clock(), _event(executor.stream))

    def graph_loss(self, m: int, values: dict[str, Any]) -> torch.Tensor:
        """The caller's loss of micro-batch m, given the graph inputs too."""
        return self.loss_of(m, {**self.inputs[m], **values})

    def run(self) -> tuple[list[Any], Run]:
        """Drive the run on the caller's thread; its outputs or losses, or the first error."""
        # One stage runs on the caller's thread (see the module's docstring), and every stage
        # does in order (`Runtime.in_order`: no backward waits for a later stage there).
        here = len(self.rt.stages) == 1 or self.rt._in_order
        assert not (self.rt._in_order and self.loss_of is not None), "in order: forwards only"
        with self.driving(self.record, None if here else self.work) as jobs:
            self.feed()
            if here:
                with _kept_thread_count():
                    for stage in self.rt.stages:
                        threads = self.rt.threads[stage.index]
                        if threads and is_cpu(stage.device):
                            set_thread_count(threads)
                        self.work(stage.index)
            outputs = self.collect()
            if jobs is not None:   # a signal must reach this thread while it waits
                jobs.wait()
        if self.loss_of is not None:
            losses = self.executors[-1].losses
            return [losses[m] for m in range(len(self.inputs))], self.record
        return outputs, self.record

    # --- the driver ----------------------------------------------------------------------------

    def feed(self) -> None:
        """Send every micro-batch's graph inputs to the stages that read them."""
        for m, values in enumerate(self.inputs):
            send_inputs(self.flow, self.transport, m, values)

    def collect(self) -> list[dict[str, Any]]:
        """The graph outputs sent to the driver, per micro-batch; fewer once the run aborted."""
        outputs = []
        try:
            for m in range(len(self.inputs)):
                outputs.append(receive_values(self.flow, self.transport, DRIVER, m))
        except Aborted:
            pass
        return outputs

    # --- the worker ----------------------------------------------------------------------------

    def work(self, index: int) -> None:
        """Run stage `index`'s row of the timetable; a failure is kept and aborts the run."""
        executor = self.executors[index]
        stream = executor.stream
        clock, done = (self.record.clock, self.record.done) if stream is None else (
            lambda: _event(stream),
            lambda action, began: self.record.gpu_done(action, *self.origins[index], began,
                                                       _event(stream)))
        self.walk(StageRow(executor, self.timetable[index], self.flow, self.transport),
                  clock=clock, done=done)



class StageRow:
    """One stage's row of a timetable, walked against a `Transport` on the calling thread.

    A forward receives the micro-batch's values from every sender the `Flow` names (stages or
    the driver), has the executor compute, and sends each reader its values; a backward receives
    the readers' gradients and sends the inputs' gradients back to the stages that sent them.
    The thread runtime walks one row per worker thread; `fxpipe.distributed` walks one per
    process, so both follow the same order of messages.
    """

    def __init__(self, executor: StageExecutor, actions: Iterable[Action], flow: Flow,
                 transport: Transport):
        self.executor = executor
        self.actions = actions         # any iterable: a stream's row has no end
        self.flow = flow
        self.transport = transport
        self.index = executor.stage.index
        self.action = Action(self.index, 0, Phase.FORWARD)   # the one running (for errors)

    def walk(self, *, stopping: Callable[[], bool] = lambda: False,
             clock: Callable[[], float] = time.perf_counter,
             done: Callable[[Action, float], None] | None = None,
             forwarded: Callable[[int, dict[str, Any], dict[str, Any]], None] | None = None,
             drain: bool = False) -> None:
        """Run every action in order, until `stopping()`. After each, `done(action, began)`
        (`began`: the `clock()` when its inputs had arrived); after each forward,
        `forwarded(m, received, outputs)`. A stream's end stops the row, or with `drain` (a
        stream that learns) skips the forwards after it and stops at the first backward of an
        item that never came."""
        end: int | None = None
        for action in self.actions:
            if stopping():
                return
            self.action = action
            m = action.microbatch
            if end is not None and m >= end:
                if action.phase is Phase.BACKWARD:
                    return
                continue
            if action.phase is Phase.FORWARD:
                values = receive_values(self.flow, self.transport, self.index, m)
                if END in values:      # a stream ended: pass it on, and stop (or drain)
                    for dst in self.flow.sends.get(self.index, {}):
                        self.transport.send(Phase.FORWARD, self.index, dst, m, {END: None})
                    if not drain:
                        return
                    end = m
                    continue
                began = clock()
                out = self.forward(m, values)
                if forwarded is not None:
                    forwarded(m, values, out)
            else:
                grads = [self.transport.receive(Phase.BACKWARD, dst, self.index, m)
                         for dst in self.flow.sends.get(self.index, {})]
                began = clock()
                self.backward(m, grads)
            if done is not None:
                done(action, began)

    def forward(self, m: int, values: dict[str, Any]) -> dict[str, Any]:
        """Micro-batch m's forward; each reader is sent the outputs it reads."""
        out = self.executor.forward(m, values)
        for dst, names in self.flow.sends.get(self.index, {}).items():
            self.transport.send(Phase.FORWARD, self.index, dst, m, {n: out[n] for n in names})
        return out

    def backward(self, m: int, grads: list[dict[str, Any]]) -> None:
        """Micro-batch m's backward; each stage this one read from is sent its gradients."""
        input_grads = self.executor.backward(m, grads)
        for src, names in self.flow.reads.get(self.index, {}).items():
            if src != DRIVER:
                self.transport.send(Phase.BACKWARD, self.index, src, m,
                                    {n: input_grads[n] for n in names})


END = "fxpipe:end"    # the key of a forward message that ends a stream (no node has this name)


def send_inputs(flow: Flow, transport: Transport, m: int, values: dict[str, Any]) -> None:
    """The driver's part: micro-batch (or item) m's graph inputs to every stage that reads
    them; a stream's `END` to every such stage."""
    for dst, names in flow.sends.get(DRIVER, {}).items():
        transport.send(Phase.FORWARD, DRIVER, dst, m,
                       values if END in values else {n: values[n] for n in names})


def row_executor(stage: Stage, flow: Flow, row: Sequence[Action], *, loss_of: LossFn | None,
                 seeds: Any, stream: Stream | None = None,
                 recompute: bool = False) -> StageExecutor:
    """`stage`'s executor for walking `row` along `flow`: autograd cut at what other stages
    send, a backward kept for the micro-batches the row takes back, the loss (`loss_of`, on
    the last stage). Made on the caller's thread, to capture its modes."""
    return StageExecutor(
        stage,
        from_stages=[n for src, names in flow.reads.get(stage.index, {}).items()
                     if src != DRIVER for n in names],
        backward_for={a.microbatch for a in row if a.phase is Phase.BACKWARD},
        loss_of=loss_of, seeds=seeds, stream=stream, recompute=recompute)


def receive_values(flow: Flow, transport: Transport, receiver: int, m: int) -> dict[str, Any]:
    """Micro-batch m's forward values from every sender of `receiver`, in the flow's order."""
    values: dict[str, Any] = {}
    for sender in flow.reads.get(receiver, {}):
        values.update(transport.receive(Phase.FORWARD, sender, receiver, m))
    return values


def set_thread_count(threads: int) -> None:
    """Give this thread `threads` intra-op threads, whatever other threads set.

    With OpenMP the count is per thread, but torch sets a new thread's count, on its first
    parallel op, from the latest `torch.set_num_threads` of any thread: asking for it first
    makes that happen now, so that the count set next stays this thread's."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def _setup(device: torch.device, threads: int | None) -> Callable[[], None]:
    """What a stage's worker sets once, as it starts: its intra-op threads (a CPU stage), its
    GPU (a GPU stage)."""
    def setup() -> None:
        if threads and is_cpu(device):
            set_thread_count(threads)
        elif is_gpu(device):
            set_device(device)
    return setup


@contextlib.contextmanager
def _kept_thread_count():
    """The caller's intra-op thread count, restored after a stage ran on its thread."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _event(stream: Stream) -> Event:
    """A timing event recorded on `stream` now."""
    return timing_event(stream)


def _reason(errors: Sequence[StageError]) -> str:
    """Why a run is aborted: its first stage's failure, or the caller's thread stopping it."""
    return str(errors[0]) if errors else "the caller's thread stopped the run"


def stage_error(stage: Stage, action: Action, error: BaseException) -> StageError:
    """A StageError naming the stage, micro-batch and the generated statement that raised."""
    statement = ""
    for frame in traceback.extract_tb(error.__traceback__):
        if frame.filename.startswith("<eval_with_key>") and frame.line:
            statement = f"\n  at: {frame.line.strip()}"
    message = (f"stage {stage.index} failed on micro-batch {action.microbatch} "
               f"({action.phase.name.lower()})\non {stage.device}: {_describe(error)}{statement}\n"
               f"  print(pipe.stages[{stage.index}].code) shows the stage's code")
    result = StageError(message, stage=stage.index, microbatch=action.microbatch)
    result.__cause__ = error
    return result


def item_error(error: StageError, first: int = 0) -> StageError:
    """`error` (a stage's, on a run's micro-batch m) as the failure of a stream's item
    `first + m`: a stream runs each item as one micro-batch, numbered from `first`."""
    item = (error.microbatch or 0) + first
    message = re.sub(r"on micro-batch \d+", f"on item {item}", str(error), count=1)
    result = StageError(message, stage=error.stage, microbatch=item)
    result.__cause__ = error.__cause__
    return result


def _describe(error: BaseException) -> str:
    """`Type: message`, even for an exception whose `str` (or `repr`) raises."""
    name = type(error).__name__
    for text in (str, repr):
        try:
            return f"{name}: {text(error)}"
        except BaseException:
            pass
    return f"{name} (its message could not be printed)"
