"""Stage workers: one thread per stage, started at its first run and parked on a queue between
runs, for as long as the runtime (the `Pipeline`) lives.

A thread started per call costs on every call: about 90 us and a new OpenMP team on a CPU, and
on a GPU an empty cuDNN plan cache (torch keeps it per thread: a new thread's first convolutions
plan again, 60 ms to 1 s a call). A kept worker sets its stage's intra-op thread count and GPU
once, as it starts, and keeps that state across calls, steps and streams.

Every way of running (a call, a train step, a stream, asynchronous learning) hands each stage's
work to its worker as one job (`Workers.run`), waits for every job to end whatever happens (a
failure, Ctrl-C: the run's abort wakes them), and leaves the workers parked, ready for the next.

- A run that finds the workers busy (a call made while a stream of the same pipeline is open, or
  from a second thread at once) runs on threads of its own, ended with it: never a wait on work
  that may only go on after this run returns.
- `close()` ends the workers once their job is done; a later run raises `PipelineClosedError`.
  A runtime dropped without `close()` ends them too: the threads hold no reference to it (only
  their queue), and a finalizer closes them when it is collected.
- After `os.fork()`, the child's first run starts workers of its own (the parent's threads do
  not exist there).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from fxpipe.passes.errors import PipelineClosedError

from .transport import POLL_S

CLOSE_S = 1.0      # how long `close()` waits for each worker to end

_working: set[threading.Thread] = set()     # the workers running a job now


def working() -> set[threading.Thread]:
    """The workers of every runtime that are running a job now (not parked): none once every
    run has returned, whatever stopped it."""
    return set(_working)


@dataclass
class _Job:
    work: Callable[[int], None] | None
    index: int
    done: threading.Event


def _serve(jobs: queue.SimpleQueue, setup: Callable[[], None]) -> None:
    """A worker's life: set up once, then run jobs until told to stop (None)."""
    setup()
    while True:
        job = jobs.get()
        if job is None:
            return
        _run(job)
        del job            # nothing of a finished run is kept alive by a parked worker


def _run(job: _Job) -> None:
    me = threading.current_thread()
    _working.add(me)
    try:
        job.work(job.index)
    except BaseException:  # a run records its own failures (`Driver.walk`): the worker lives on
        pass
    finally:
        job.work = None
        _working.discard(me)
        job.done.set()


class _Thread:
    """One worker: its thread and its queue of jobs."""

    def __init__(self, name: str, setup: Callable[[], None]):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=_serve, args=(self.jobs, setup), name=name,
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)


class Jobs:
    """The jobs of one run, one per stage."""

    def __init__(self, jobs: Sequence[_Job]):
        self.jobs = list(jobs)

    def wait(self) -> None:
        """Until every job has ended; a signal reaches the waiting thread meanwhile."""
        for job in self.jobs:
            while not job.done.wait(POLL_S):
                pass

    def join(self) -> None:
        """`wait`, through a second Ctrl-C too: no stage may outlive its run."""
        interrupted: BaseException | None = None
        while True:
            try:
                self.wait()
                break
            except KeyboardInterrupt as e:
                interrupted = e
        if interrupted is not None:
            raise interrupted


class Workers:
    """A runtime's stage workers, `setups[i]` run once on worker i as it starts."""

    def __init__(self, setups: Sequence[Callable[[], None]], name: str = "fxpipe-stage"):
        self.setups = list(setups)
        self.name = name
        self.closed = False
        self._fresh()

    def _fresh(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._threads: list[_Thread] = []

    @property
    def threads(self) -> list[threading.Thread]:
        """The workers' threads (none before the first run)."""
        return [t.thread for t in self._threads]

    @contextlib.contextmanager
    def run(self, work: Callable[[int], None], abort: Callable[[BaseException], None]
            ) -> Iterator[Jobs]:
        """Hand `work(i)` to every worker i; if the caller's block raises, `abort(error)` the
        run; wait for every job to end, always."""
        if self.closed:
            raise PipelineClosedError("this pipeline was closed: its stage workers are gone\n"
                                      "compile (or load) it again to run it")
        if os.getpid() != self._pid:         # a forked child: workers of its own
            self._fresh()
        kept = self._lock.acquire(blocking=False)
        try:
            threads = self._started() if kept else self._start()   # busy: this run's own
        except BaseException:       # no thread could start (or Ctrl-C): the workers stay free
            if kept:
                self._lock.release()
            raise
        jobs = Jobs([_Job(work, i, threading.Event()) for i in range(len(threads))])
        try:
            for thread, job in zip(threads, jobs.jobs):
                thread.jobs.put(job)
            yield jobs
        except BaseException as e:
            abort(e)
            raise
        finally:
            try:
                jobs.join()
            finally:
                if kept:
                    self._lock.release()
                else:
                    for thread in threads:
                        thread.stop()

    def _started(self) -> list[_Thread]:
        if not self._threads:
            self._threads = self._start()
        return self._threads

    def _start(self) -> list[_Thread]:
        return [_Thread(f"{self.name}-{i}", setup) for i, setup in enumerate(self.setups)]

    def close(self, wait: bool = True) -> None:
        """End every worker once its job is done; later runs are refused. With `wait`, wait
        for each to end (within `CLOSE_S` each when parked); without, as a finalizer must (it
        runs wherever a garbage collection starts, the caller's thread mid-call included), only
        tell them to."""
        self.closed = True
        threads, self._threads = self._threads, []
        for thread in threads:
            thread.stop()
        if not wait or os.getpid() != self._pid:
            return
        for thread in threads:
            if thread.thread is not threading.current_thread():
                thread.thread.join(CLOSE_S)
