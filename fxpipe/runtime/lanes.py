"""Lanes that advance on their own: steps fed to the stages from several threads as they come.

A `Runtime.run` takes a whole batch's micro-batches at once, and its caller waits for all of
them: a loop that calls it once per token (Hugging Face's generation loop over the batch)
drains the pipeline at every token. Here each lane (a group of sequences) is run by a loop of
its own, on a thread of its own, and `LaneSteps.step(values)` hands the stages one step of that
lane and waits for its outputs only: while stage 1 runs lane 0's step, stage 0 runs lane 1's.

- `LaneSteps` (a driver, as `_Stream`): the runtime's kept workers walk an endless row of
  forwards, item after item in the order the steps were fed; the item's values are all it reads
  (a lane's cache rows are among its inputs: the stages' state is the runtime's, per stage,
  `runtime.state`). Each step is numbered as it is fed; a waiting lane receives the next
  outputs (in order, one message at a time) and hands another's over, so no thread of its
  own collects, and no lane's outputs wait behind another's step.
  A stage that fails aborts the steps: every waiting lane raises `Aborted`, and the driver's
  block raises the `StageError` naming the stage (and the step, as a stream's item).
- `run_lanes(loops)`: each loop on a thread of its own, all joined whatever happens (no
  thread outlives the call); the first failure raised, a stage's before the `Aborted` it caused.
- `LaneRandom`: one generator state per lane. The loops sample from the global (CPU)
  generator, so a lane holds a lock with its own state swapped in from when its step returns
  until it feeds the next: its samples do not depend on the order the threads ran in.
- `Gathered`: each lane gives its part and waits; the last to come runs them all at once (a
  prefill of every lane, itself pipelined over the lanes), and each gets its own back.
- `bubble(run)`: the share of the stages' time between the first step's start and the last
  step's end in which a stage computed nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Callable, Iterator, Sequence

import torch

from .driver import item_error
from .executor import StageExecutor
from .orchestrator import Runtime, _Rows, endless_flow
from .record import Run
from .schedules import Action, Phase
from .stage_row import END, StageRow, receive_values, send_inputs
from .transport import POLL_S, Aborted
from .wiring import DRIVER


class LaneSteps(_Rows):
    """Steps of several lanes through `runtime`'s stages, fed from any thread (see the module).
    Use as a context manager: the workers walk from its start to its end."""

    def __init__(self, runtime: Runtime):
        super().__init__(runtime, endless_flow(runtime, "the lanes"))
        # Made here, on the caller's thread: they capture its grad mode.
        self.executors = [StageExecutor(stage, stream=runtime.streams[stage.index])
                          for stage in runtime.stages]
        self.record = Run(num_stages=len(runtime.stages))
        self._feeding, self._arrived = threading.Lock(), threading.Condition()
        self._fed = self._received = 0
        self._receiving = False            # a lane is taking the next outputs now
        self._outputs: dict[int, dict[str, Any]] = {}
        self._driving: contextlib.ExitStack | None = None

    def __enter__(self) -> "LaneSteps":
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.driving(self.record, self.work, item_error))
            stack.callback(self._end)
            self._driving = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> bool:
        return self._driving.__exit__(*exc)

    def _end(self) -> None:
        """Every stage told that no step is coming (after the last one fed)."""
        with self._feeding:
            send_inputs(self.flow, self.transport, self._fed, {END: None})

    def step(self, values: dict[str, Any]) -> dict[str, Any]:
        """One step's graph outputs from its graph inputs (`values`, by placeholder)."""
        return self.outputs(self.feed(values))

    def feed(self, values: dict[str, Any]) -> int:
        """One step fed (its graph inputs `values`, by placeholder): its number, for `outputs`.
        The stages take steps in the order fed, so steps fed one after another without
        waiting (a prompt's chunks) overlap: stage 1 runs one while stage 0 runs the next."""
        with self._feeding:
            m = self._fed
            self._fed += 1
            send_inputs(self.flow, self.transport, m, values)
        return m

    def outputs(self, m: int) -> dict[str, Any]:
        """Step `m`'s graph outputs, once they came (each taken once)."""
        with self._arrived:
            while m not in self._outputs:
                if self._receiving:
                    self._arrived.wait(POLL_S)
                else:
                    self._take_next()
            return self._outputs.pop(m)

    def _take_next(self) -> None:
        """Receive the next step's outputs (they come in the order fed), with `_arrived` let go
        meanwhile, and wake the lane they are for: one message at a time, so that no lane's
        outputs wait behind another's."""
        self._receiving, n = True, self._received
        self._arrived.release()
        try:
            out = receive_values(self.flow, self.transport, DRIVER, n)
        finally:
            self._arrived.acquire()
            self._receiving = False
            self._arrived.notify_all()
        self._outputs[n] = out
        self._received += 1

    def work(self, index: int) -> None:
        """Stage `index` runs the steps in the order fed, until told none is coming."""
        self.walk(StageRow(self.executors[index],
                           (Action(index, m, Phase.FORWARD) for m in itertools.count()),
                           self.flow, self.transport),
                  clock=self.record.clock, done=self.record.done)


def run_lanes(loops: Sequence[Callable[[], Any]], stop: Callable[[], None],
              name: str = "fxpipe-lane") -> list[Any]:
    """Each of `loops` on a thread of its own; their results in order, once every thread has
    ended. The first failure is raised (one that is no `Aborted` first: an abort is what a
    stage's failure does to the lanes waiting on it, and the driver names that failure). If
    the caller's thread is interrupted while it waits (Ctrl-C), `stop()` wakes every lane, and
    it still waits for each to end."""
    results: list[Any] = [None] * len(loops)
    errors: list[BaseException] = []

    def run(lane: int) -> None:
        try:
            results[lane] = loops[lane]()
        except BaseException as e:       # kept, raised on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(lane,), name=f"{name}-{lane}", daemon=True)
               for lane in range(len(loops))]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():    # with timeouts: a signal reaches the caller meanwhile
                thread.join(POLL_S)
    except BaseException:
        stop()
        for thread in threads:
            thread.join()
        raise
    if errors:
        raise min(errors, key=lambda e: isinstance(e, Aborted))
    return results


class LaneRandom:
    """A generator state per lane, swapped into the global CPU generator while the lane's loop
    runs on its own thread (`lane`), swapped out while it waits for a step (`away`): one lane
    draws at a time, from its own state (see the module)."""

    def __init__(self, seeds: Sequence[int]):
        self.states = [torch.Generator().manual_seed(seed).get_state() for seed in seeds]
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lane(self, lane: int) -> Iterator[None]:
        """Lane `lane`'s loop runs inside, drawing from its own state."""
        self._lock.acquire()
        torch.set_rng_state(self.states[lane])
        try:
            yield
        finally:
            self.states[lane] = torch.get_rng_state()
            self._lock.release()

    @contextlib.contextmanager
    def away(self, lane: int) -> Iterator[None]:
        """Inside `lane`, the lane's wait for a step: the others draw meanwhile."""
        self.states[lane] = torch.get_rng_state()
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            torch.set_rng_state(self.states[lane])


class Gathered:
    """`lanes` threads each `give` a part; the last to come runs `run(parts)` (in lane order)
    and each gets its own result. `abort(error)` wakes the waiting ones (a lane that failed
    before it gave its part), who raise `Aborted`."""

    def __init__(self, lanes: int, run: Callable[[list[Any]], Sequence[Any]]):
        self.lanes, self.run = lanes, run
        self.parts: dict[int, Any] = {}
        self.results: Sequence[Any] | None = None
        self.error: BaseException | None = None
        self._done = threading.Condition()

    def give(self, lane: int, part: Any) -> Any:
        with self._done:
            self.parts[lane] = part
            if len(self.parts) == self.lanes and self.error is None:
                try:
                    self.results = self.run([self.parts[l] for l in range(self.lanes)])
                except BaseException as e:
                    self.error = e
                    raise
                finally:
                    self._done.notify_all()
            while self.results is None and self.error is None:
                self._done.wait(POLL_S)
            if self.error is not None:
                raise Aborted(f"lane {lane}: another lane failed ({type(self.error).__name__})")
            return self.results[lane]

    def abort(self, error: BaseException) -> None:
        with self._done:
            if self.error is None:
                self.error = error
            self._done.notify_all()


def bubble(run: Run | None) -> float | None:
    """The share of stage-time idle between the first action's start and the last's end of
    `run` (None without actions)."""
    slots = run.slots if run is not None else []
    if not slots:
        return None
    span = max(s.end_s for s in slots) - min(s.start_s for s in slots)
    busy = sum(s.end_s - s.start_s for s in slots)
    return max(0.0, 1 - busy / (run.num_stages * span)) if span > 0 else 0.0
