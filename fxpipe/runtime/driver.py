"""One run's driving, written once for every way of running stages (`Driver`), and the
failures it keeps and raises: a stage's as a `StageError` naming the stage, the micro-batch and
the statement that failed (`stage_error`), and a stream's item's (`item_error`).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from fxpipe.passes.errors import StageError
from fxpipe.passes.stage import Stage

from .schedules import Action
from .executor import StageExecutor
from .record import Run
from .transport import Aborted, Transport
from .workers import Workers

if TYPE_CHECKING:
    from .stage_row import StageRow


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
