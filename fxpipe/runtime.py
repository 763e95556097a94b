"""Executes a timetable: one worker thread per stage, values handed over through queues.

The caller's thread is the driver: it feeds each stage the graph inputs it reads, one message per
micro-batch, and collects what comes back. A stage receives, for each micro-batch, one message from
each stage (or the driver) it reads from, in micro-batch order, so a FIFO queue per (phase, sender,
receiver) is all the synchronisation there is. Workers release the GIL inside torch ops, so stages
overlap.

Inference (`loss_of=None`) runs forwards only; the graph outputs go back to the driver. Tensors cross
stages still attached to autograd, so `pipe(x).sum().backward()` works as for the model.

Training (`loss_of` given) cuts autograd at every stage boundary: a stage detaches what it receives,
the last stage turns the graph outputs of micro-batch m into its loss, and a backward action runs
`torch.autograd.backward` on the stage's own outputs with the gradients its readers sent back, then
sends its inputs' gradients to their producers. Activations are freed after each backward.

On a GPU each worker runs on its own CUDA stream, which first waits for the caller's stream (its
inputs, the last optimizer step), and which the caller's stream waits for at the end. A stage's
message carries an event recorded after its work, and the receiver's stream waits on it before
using the tensors (see `_to` for how copies between devices are kept safe).

Random draws follow the seeds the caller's `Pipeline` drew, one per micro-batch (see
`passes.randomness`): a worker runs micro-batch m's forward under `microbatch_seed(seeds[m])`.

If a stage fails (whatever it raises), or the caller's thread is interrupted (Ctrl-C), the run is
aborted: a flag every worker checks between actions, and an abort token in every queue. All
workers stop within one action, the threads are joined, and the caller gets a `StageError` naming
the stage, the micro-batch and the statement that failed (or its own `KeyboardInterrupt`).
The driver waits with timeouts, so a signal reaches it while it waits.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from passes.codegen import Stage
from passes.errors import StageError
from passes.graph_values import tensors
from passes.randomness import microbatch_seed

from .schedules import Action, Phase, Slot, Timetable

DRIVER = -1
_ABORT = object()
_POLL_S = 0.05     # how often a waiting thread looks for an abort or a signal

LossFn = Callable[[int, dict[str, Any]], torch.Tensor]   # (micro-batch, graph values) -> loss


@dataclass
class Run:
    """What the latest run did, action by action (seconds from its start), for reports and traces.

    A run that stopped early keeps the actions that finished, and `error` says what stopped it.
    """

    slots: list[Slot] = field(default_factory=list)
    wall_s: float = 0.0
    num_stages: int = 0
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass
class _Message:
    values: dict[str, Any]
    ready: Any = None          # a CUDA event the receiver waits on, if the sender used a GPU


@dataclass
class _Saved:
    """What a training forward keeps for its backward."""

    inputs: dict[str, Any]       # what it received, other stages' tensors as detached leaves
    outputs: dict[str, Any]
    loss: torch.Tensor | None = None


class Runtime:
    """The wiring of one pipeline's stages; runs timetables on them, any number of times."""

    def __init__(self, stages: Sequence[Stage], output_names: Sequence[str], *,
                 threads_per_stage: int | Sequence[int | None] | None = None):
        self.stages = list(stages)
        # Each CPU stage's intra-op threads (None: as the thread starts).
        self.threads = (list(threads_per_stage) if isinstance(threads_per_stage, Sequence)
                        else [threads_per_stage] * len(self.stages))
        producer: dict[str, int] = {}
        for stage in stages:
            for name in stage.outputs:
                assert producer.setdefault(name, stage.index) == stage.index, (
                    f"{name!r} is sent by stages {producer[name]} and {stage.index}")
        for stage in stages:
            for name in stage.inputs:
                assert producer.get(name, DRIVER) < stage.index, (
                    f"stage {stage.index} reads {name!r} from stage {producer[name]}, not earlier")
        self.producer = producer
        last = len(stages) - 1
        # reads[dst][src]: the names `dst` receives from `src` in a forward. Graph outputs go to the
        # driver in inference, and to the last stage, which computes the loss, in training.
        self.reads = _wiring(stages, producer, output_names, DRIVER)
        self.train_reads = _wiring(stages, producer, output_names, last)
        self.streams = [torch.cuda.Stream(s.device) if s.device.type == "cuda" else None
                        for s in stages]
        self.last_run: Run | None = None    # the latest run's record, failed or not

    def reads_from(self, training: bool) -> dict[int, list[int]]:
        """Which stages each stage reads from (the driver left out): the timetable's dependencies."""
        reads = self.train_reads if training else self.reads
        return {dst: [src for src in srcs if src != DRIVER] for dst, srcs in reads.items()
                if dst != DRIVER}

    def run(self, timetable: Timetable, inputs: Sequence[dict[str, Any]], *,
            loss_of: LossFn | None = None,
            seeds: Sequence[int] | None = None) -> tuple[list[Any], Run]:
        """Run `timetable` on per-micro-batch graph inputs, micro-batch m drawing from `seeds[m]`.

        Returns per-micro-batch graph outputs (inference) or per-micro-batch losses, detached
        (training), and the record of the run (also `self.last_run`, kept when the run fails).
        """
        return _Execution(self, inputs, loss_of, seeds).run(timetable)


def _wiring(stages, producer, output_names, outputs_to) -> dict[int, dict[int, list[str]]]:
    reads: dict[int, dict[int, list[str]]] = {}
    for stage in stages:
        for name in stage.inputs:
            reads.setdefault(stage.index, {}).setdefault(producer.get(name, DRIVER), []).append(name)
    for name in output_names:
        src = producer[name]
        if src != outputs_to:
            reads.setdefault(outputs_to, {}).setdefault(src, []).append(name)
    return reads


class _Execution:
    """One run: its queues, what training forwards saved, and its record."""

    def __init__(self, runtime: Runtime, inputs: Sequence[dict[str, Any]], loss_of: LossFn | None,
                 seeds: Sequence[int] | None):
        self.rt = runtime
        self.inputs = list(inputs)
        self.loss_of = loss_of
        self.seeds = list(seeds) if seeds is not None else [None] * len(self.inputs)
        self.stopping = threading.Event()
        self.training = loss_of is not None
        self.reads = runtime.train_reads if self.training else runtime.reads
        self.channels: dict[tuple[Phase, int, int], queue.SimpleQueue] = {}
        for dst, srcs in self.reads.items():
            for src in srcs:
                self.channels[Phase.FORWARD, src, dst] = queue.SimpleQueue()
                if self.training and src != DRIVER:
                    self.channels[Phase.BACKWARD, dst, src] = queue.SimpleQueue()
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.errors: list[StageError] = []
        self.record = Run(num_stages=len(runtime.stages))
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = [(kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
                         if torch.is_autocast_enabled(kind)]
        self.start = 0.0

    def sends(self, src: int) -> dict[int, list[str]]:
        return {dst: srcs[src] for dst, srcs in self.reads.items() if src in srcs}

    def abort(self) -> None:
        self.stopping.set()
        for channel in self.channels.values():
            channel.put(_ABORT)

    def run(self, timetable: Timetable) -> tuple[list[Any], Run]:
        # One stage runs on the caller's thread: no worker to start, hand over to, or join, so
        # a pipeline of one stage costs what the model costs.
        here = len(self.rt.stages) == 1
        threads = [] if here else [
            threading.Thread(target=self.work, args=(stage, timetable[stage.index]),
                             name=f"fxpipe-stage-{stage.index}", daemon=True)
            for stage in self.rt.stages]
        outputs: list[dict] = []
        self.rt.last_run = self.record
        self.start = time.perf_counter()
        streams = [stream for stream in self.rt.streams if stream is not None]
        for stream in streams:   # stages start after the caller's queued work (inputs, opt.step)
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        try:
            for t in threads:
                t.start()
            for values in self.inputs:
                for dst, names in self.sends(DRIVER).items():
                    self.channels[Phase.FORWARD, DRIVER, dst].put(
                        _Message({n: values[n] for n in names}))
            if here:
                with _kept_thread_count():
                    self.work(self.rt.stages[0], timetable[0])
            if not self.training:
                for _ in self.inputs:
                    received = self.receive(Phase.FORWARD, DRIVER, None)
                    if received is None:
                        break
                    outputs.append(received)
            for t in threads:      # a signal must reach this thread while it waits
                while t.is_alive():
                    t.join(_POLL_S)
        except BaseException as e:   # Ctrl-C, or anything else raised in the caller's thread
            self.abort()
            self.record.error = f"{type(e).__name__} in the caller's thread"
            raise
        finally:
            _join(threads)
            for stream in streams:   # and the caller's later work after theirs (losses, .grad)
                torch.cuda.current_stream(stream.device).wait_stream(stream)
            self.record.wall_s = time.perf_counter() - self.start
            self.record.slots.sort(key=lambda slot: (slot.start_s, slot.action.stage))
        if self.errors:
            self.record.error = str(self.errors[0])
            raise self.errors[0] from self.errors[0].__cause__
        if self.training:
            return [self.losses[m] for m in range(len(self.inputs))], self.record
        return outputs, self.record

    # --- the worker --------------------------------------------------------------------------

    def work(self, stage: Stage, actions: list[Action]) -> None:
        action = Action(stage.index, 0, Phase.FORWARD)
        try:
            if self.rt.threads[stage.index] and stage.device.type == "cpu":
                set_thread_count(self.rt.threads[stage.index])
            stream = self.rt.streams[stage.index]
            with contextlib.ExitStack() as context:   # the caller's thread-local modes, here too
                context.enter_context(torch.set_grad_enabled(self.grad_enabled or self.training))
                for kind, dtype in self.autocast:
                    context.enter_context(torch.autocast(kind, dtype=dtype))
                if stream is not None:
                    context.enter_context(torch.cuda.stream(stream))
                for action in actions:
                    if self.stopping.is_set():
                        return
                    step = self.forward if action.phase is Phase.FORWARD else self.backward
                    began = step(stage, action.microbatch)
                    if began is None:
                        return
                    self.record.slots.append(Slot(action, began, time.perf_counter() - self.start))
        except BaseException as e:   # whatever it is, the run must end
            if isinstance(e, KeyboardInterrupt) and threading.current_thread() is \
                    threading.main_thread():
                raise                # the caller's own Ctrl-C, on the caller's thread
            try:
                self.errors.append(_stage_error(stage, action, e))
            finally:
                self.abort()

    def forward(self, stage: Stage, m: int) -> float | None:
        """Run micro-batch m's forward on `stage`; when its inputs arrived, or None on abort."""
        values = self.receive(Phase.FORWARD, stage.index, stage.device)
        if values is None:
            return None
        began = time.perf_counter() - self.start
        if self.training:
            values = {k: _detach_leaf(v) if self.rt.producer.get(k, DRIVER) != DRIVER else v
                      for k, v in values.items()}
        # `forward`, not `__call__`: fx's wrapper around generated code prints errors to stderr
        # and drops the traceback that names the failing statement.
        with microbatch_seed(self.seeds[m]):
            out = dict(zip(stage.outputs, stage.module.forward(*(values[n] for n in stage.inputs))))
        if self.training:
            saved = self.saved[stage.index, m] = _Saved(values, out)
            if stage.index == len(self.rt.stages) - 1:
                saved.loss = self.loss_of(m, {**self.inputs[m], **values, **out})
                self.losses[m] = saved.loss.detach()
        self.send(Phase.FORWARD, stage, {dst: {n: out[n] for n in names}
                                         for dst, names in self.sends(stage.index).items()})
        return began

    def backward(self, stage: Stage, m: int) -> float | None:
        """Run micro-batch m's backward on `stage`; when its gradients arrived, or None on abort."""
        roots: list[torch.Tensor] = []
        root_grads: list[torch.Tensor | None] = []
        saved = self.saved.pop((stage.index, m))
        for dst in self.sends(stage.index):
            message = self.get(self.channels[Phase.BACKWARD, dst, stage.index])
            if message is _ABORT:
                return None
            _wait(message, stage.device)
            for name, grads in message.values.items():
                for leaf, g in zip(tensors(saved.outputs[name]), grads):
                    if g is not None and leaf.requires_grad:
                        roots.append(leaf)
                        root_grads.append(_to(g, stage.device))
        began = time.perf_counter() - self.start
        if saved.loss is not None and saved.loss.requires_grad:   # no parameters, no graph
            roots.append(saved.loss)
            root_grads.append(None)
        if roots:   # autograd sums the gradients of an output read by several stages
            torch.autograd.backward(roots, root_grads)
        self.send(Phase.BACKWARD, stage, {
            src: {n: [leaf.grad for leaf in tensors(saved.inputs[n])] for n in names}
            for src, names in self.reads.get(stage.index, {}).items() if src != DRIVER})
        return began

    # --- messages ----------------------------------------------------------------------------

    def send(self, phase: Phase, stage: Stage, messages: dict[int, dict[str, Any]]) -> None:
        stream = self.rt.streams[stage.index]
        ready = stream.record_event() if stream is not None else None
        for dst, values in messages.items():
            self.channels[phase, stage.index, dst].put(_Message(values, ready))

    def receive(self, phase: Phase, dst: int, device: torch.device | None) -> dict[str, Any] | None:
        """One forward message from every sender of `dst`, moved to `device`; None on abort."""
        values: dict[str, Any] = {}
        for src in self.reads.get(dst, {}):
            message = self.get(self.channels[phase, src, dst])
            if message is _ABORT:
                return None
            _wait(message, device)
            values.update(message.values if device is None else
                          {k: _to(v, device) for k, v in message.values.items()})
        return values

    def get(self, channel: queue.SimpleQueue) -> Any:
        """The next message, or `_ABORT` once the run is aborted; waits with timeouts, so the
        driver sees signals and a worker sees the abort flag."""
        while not self.stopping.is_set():
            try:
                return channel.get(timeout=_POLL_S)
            except queue.Empty:
                pass
        return _ABORT


def set_thread_count(threads: int) -> None:
    """Give this thread `threads` intra-op threads, whatever other threads set.

    With OpenMP the count is per thread, but torch sets a new thread's count, on its first
    parallel op, from the latest `torch.set_num_threads` of any thread: asking for it first
    makes that happen now, so that the count set next stays this thread's."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


@contextlib.contextmanager
def _kept_thread_count():
    """The caller's intra-op thread count, restored after a stage ran on its thread."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _join(threads: Sequence[threading.Thread]) -> None:
    """Wait for every thread, through a second Ctrl-C too: no stage may outlive its run."""
    interrupted: BaseException | None = None
    for t in threads:
        while t.is_alive():
            try:
                t.join(_POLL_S)
            except KeyboardInterrupt as e:
                interrupted = e
    if interrupted is not None:
        raise interrupted


def _wait(message: _Message, device: torch.device | None) -> None:
    if message.ready is None:
        return
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).wait_event(message.ready)
    else:
        message.ready.synchronize()


def _detach_leaf(value: Any) -> Any:
    """A received tensor as a fresh autograd leaf, so this stage's backward stops here."""
    def cut(v):
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return v.detach().requires_grad_(True)
        return v
    return fx.node.map_aggregate(value, cut)


def _to(value: Any, device: torch.device) -> Any:
    """`value`'s tensors on `device`, safe to use on this thread's current stream.

    A tensor another stage made on this GPU is marked as used by this stream, so the allocator
    does not hand its memory back to the sender first. A copy to the GPU is queued on this stream;
    one from another GPU is waited for (correct first: its source may be freed once this returns);
    one to the CPU is synchronous, since CPU ops do not wait for streams."""
    def move(v):
        if not isinstance(v, torch.Tensor):
            return v
        if v.device == device:
            if device.type == "cuda":
                v.record_stream(torch.cuda.current_stream(device))
            return v
        moved = v.to(device, non_blocking=device.type == "cuda")
        if device.type == "cuda" and v.device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        return moved
    return fx.node.map_aggregate(value, move)


def _stage_error(stage: Stage, action: Action, error: BaseException) -> StageError:
    """A StageError naming the stage, micro-batch and the generated statement that raised."""
    statement = ""
    for frame in traceback.extract_tb(error.__traceback__):
        if frame.filename.startswith("<eval_with_key>") and frame.line:
            statement = f"\n  at: {frame.line.strip()}"
    message = (f"stage {stage.index} (on {stage.device}) failed on micro-batch {action.microbatch} "
               f"({action.phase.name.lower()}): {_describe(error)}{statement}\n"
               f"  print(pipe.stages[{stage.index}].code) shows the stage's code")
    result = StageError(message, stage=stage.index, microbatch=action.microbatch)
    result.__cause__ = error
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
