"""The orchestrator: runs a timetable, one worker per stage, and records what ran when.

The caller's thread is the driver: it sends each stage the graph inputs it reads, one message per
micro-batch, and collects what comes back. Each stage's worker walks its row of the timetable: a
forward receives the micro-batch's values from every stage (or the driver) the stage reads from,
has the stage's `StageExecutor` compute, and sends each reader its values; a backward receives the
readers' gradients and sends the inputs' gradients back to their producers. Messages travel by a
`Transport` (here `ThreadTransport`, threads and queues); workers release the GIL inside torch
ops, so stages overlap. Walking one row is `StageRow`'s (`stage_row`), and driving a run
`Driver`'s (`driver`), which `fxpipe.distributed` shares: there each process drives its own
stage's row against a transport on `torch.distributed`. The workers are the runtime's own,
started at its first run and parked between runs (`workers.Workers`), so a stage's thread state
(intra-op threads, GPU, cuDNN's plans) lives across calls, steps and streams. One stage runs on
the caller's thread: no worker to hand over to, so a pipeline of one stage costs what the model
costs; the caller's intra-op thread count is restored afterwards.

Inference and training differ only in their timetable and their loss. Without `loss_of` the
graph outputs go back to the driver; with it they go to the last stage, which turns them into
the micro-batch's loss, and the timetable's backwards run the executors' backwards.

Each CPU stage may have its own intra-op thread count, set once on its worker as it starts, after
torch's per-thread initialisation (`set_thread_count`).

If a stage fails (whatever it raises), or the caller's thread is interrupted (Ctrl-C), the run is
aborted: a flag every worker checks between actions, and the transport's abort, which wakes every
waiting thread. All workers stop within one action, the run waits for each to park again
whatever happens, and the caller gets the first `StageError`, naming the stage, the micro-batch
and the statement that failed (or its own `KeyboardInterrupt`). The driver waits with timeouts,
so a signal reaches it while it waits. `Run` (`record`) records the actions that finished, for a
failed run too. A GPU stage's actions are recorded as the GPU ran them (CUDA events on its
stream), not as the host launched them; the events are read when the record is first read, so a
call returns as soon as its work is queued, as the model's own call does, and the host never
waits per micro-batch.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from fxpipe.passes.stage import Stage
from fxpipe.passes.device import (Event, Stream, is_cpu, is_gpu, set_device, stream_for,
                                  timing_event)
from fxpipe.passes.errors import PartitionError

from .schedules import Action, Phase, Timetable
from .wiring import DRIVER, Flow, Wiring
from .driver import Driver, item_error
from .executor import LossFn, StageExecutor
from .record import Run
from .stage_row import END, StageRow, receive_values, row_executor, send_inputs
from .state import StageState
from .transport import Aborted, ThreadTransport
from .workers import Workers


class Runtime:
    """Runs timetables on a pipeline's stages along their `Wiring`, any number of times; its
    workers' threads are `name`-0, `name`-1, ... (a pipeline's: "fxpipe-stage")."""

    def __init__(self, stages: Sequence[Stage], wiring: Wiring, *,
                 threads_per_stage: int | Sequence[int | None] | None = None,
                 recompute: bool | Sequence[bool] = False, name: str = "fxpipe-stage"):
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
        self.workers = Workers([_setup(s.device, t) for s, t in zip(self.stages, self.threads)],
                               name)
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


def endless_flow(runtime: Runtime, what: str) -> Flow:
    """The forward flow of items that come without end (a stream's, lanes' steps): each stage
    learns that `what` ended from what it reads, so a stage that reads nothing is refused."""
    flow = runtime.wiring.flow(training=False)
    silent = [s.index for s in runtime.stages if not flow.reads.get(s.index)]
    if silent:
        raise PartitionError(f"stage {silent[0]} reads no input nor other stage\nso it would "
                             f"never learn that {what} ended: plan on fewer devices")
    return flow


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
        super().__init__(runtime, endless_flow(runtime, "a stream"))
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
