"""Executes a timetable: one worker thread per stage, values handed over through queues.

The caller's thread is the driver: it feeds each stage the graph inputs it reads, one message per
micro-batch, and collects the graph outputs. A stage receives, for each micro-batch, one message
from each stage (or the driver) it reads from, in micro-batch order, so a FIFO queue per
(sender, receiver) pair is all the synchronisation there is. Workers release the GIL inside torch
ops, so stages overlap.

On a GPU each worker runs on its own CUDA stream; a message carries an event recorded after the
sender's work, and the receiver's stream waits on it before using the tensors.

If a stage fails, every queue gets an abort token, all workers stop, the threads are joined, and
the caller gets a `StageError` naming the stage, the micro-batch and the statement that failed.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx

from passes.codegen import Stage
from passes.errors import StageError

from .schedules import Action, Phase, Timetable

DRIVER = -1
_ABORT = object()


@dataclass(frozen=True)
class Event:
    """One action as it ran: seconds since the run started."""

    action: Action
    start_s: float
    end_s: float


@dataclass
class Run:
    """What the last run did, action by action, for reports and traces."""

    events: list[Event] = field(default_factory=list)
    wall_s: float = 0.0


@dataclass
class _Message:
    values: dict[str, Any]
    ready: Any = None          # a CUDA event the receiver waits on, if the sender used a GPU


class Runtime:
    """Runs the stages of one pipeline; holds only their wiring, so it can run many times."""

    def __init__(self, stages: Sequence[Stage], output_names: Sequence[str]):
        self.stages = list(stages)
        producer = {name: stage.index for stage in stages for name in stage.outputs}
        # reads[dst][src]: the names stage `dst` (or the driver) receives from `src`
        self.reads: dict[int, dict[int, list[str]]] = {}
        for stage in stages:
            for name in stage.inputs:
                src = producer.get(name, DRIVER)
                self.reads.setdefault(stage.index, {}).setdefault(src, []).append(name)
        for name in output_names:
            self.reads.setdefault(DRIVER, {}).setdefault(producer[name], []).append(name)
        self.streams = [torch.cuda.Stream(s.device) if s.device.type == "cuda" else None
                        for s in stages]

    def sends(self, src: int) -> dict[int, list[str]]:
        return {dst: srcs[src] for dst, srcs in self.reads.items() if src in srcs}

    def run(self, timetable: Timetable, inputs: Sequence[dict[str, Any]]) -> tuple[list[dict], Run]:
        """Run `timetable` on per-micro-batch graph inputs; per-micro-batch graph outputs."""
        channels = {(src, dst): queue.SimpleQueue()
                    for dst, srcs in self.reads.items() for src in srcs}
        errors: list[StageError] = []
        record = Run()
        start = time.perf_counter()
        grad = torch.is_grad_enabled()

        def abort():
            for channel in channels.values():
                channel.put(_ABORT)

        def work(stage: Stage, actions: list[Action]):
            action = Action(stage.index, 0, Phase.FORWARD)
            try:
                with torch.set_grad_enabled(grad), _on_stream(self.streams[stage.index]):
                    for action in actions:
                        if not self._step(stage, action, channels, record, start):
                            return
            except BaseException as e:
                errors.append(_stage_error(stage, action, e))
                abort()

        threads = [threading.Thread(target=work, args=(stage, timetable[stage.index]),
                                    name=f"fxpipe-stage-{stage.index}", daemon=True)
                   for stage in self.stages]
        outputs: list[dict] = []
        try:
            for t in threads:
                t.start()
            for m, values in enumerate(inputs):
                for dst, names in self.sends(DRIVER).items():
                    channels[DRIVER, dst].put(_Message({n: values[n] for n in names}))
            for m in range(len(inputs)):
                received = self._receive(DRIVER, channels, None)
                if received is None:
                    break
                outputs.append(received)
        finally:
            if len(outputs) < len(inputs):
                abort()
            for t in threads:
                t.join()
        if errors:
            raise errors[0] from errors[0].__cause__
        record.wall_s = time.perf_counter() - start
        return outputs, record

    def _step(self, stage: Stage, action: Action, channels, record: Run, start: float) -> bool:
        if action.phase is not Phase.FORWARD:
            raise NotImplementedError(f"{action}: this runtime runs forward actions only")
        values = self._receive(stage.index, channels, stage.device)
        if values is None:
            return False
        began = time.perf_counter() - start
        out = stage.module(*(values[name] for name in stage.inputs))
        out = dict(zip(stage.outputs, out))
        stream = self.streams[stage.index]
        ready = stream.record_event() if stream is not None else None
        for dst, names in self.sends(stage.index).items():
            channels[stage.index, dst].put(_Message({n: out[n] for n in names}, ready))
        record.events.append(Event(action, began, time.perf_counter() - start))
        return True

    def _receive(self, dst: int, channels, device: torch.device | None) -> dict[str, Any] | None:
        """One message from every sender of `dst`, moved to `device`; None if the run aborted."""
        values: dict[str, Any] = {}
        for src in self.reads.get(dst, {}):
            message = channels[src, dst].get()
            if message is _ABORT:
                return None
            if message.ready is not None and device is not None and device.type == "cuda":
                torch.cuda.current_stream(device).wait_event(message.ready)
            elif message.ready is not None:
                message.ready.synchronize()
            values.update(message.values if device is None else
                          {k: _to(v, device) for k, v in message.values.items()})
        return values


def _to(value: Any, device: torch.device) -> Any:
    def move(v):
        if not isinstance(v, torch.Tensor) or v.device == device:
            return v
        moved = v.to(device, non_blocking=True)
        if device.type == "cuda":
            moved.record_stream(torch.cuda.current_stream(device))
        return moved
    return fx.node.map_aggregate(value, move)


class _on_stream:
    def __init__(self, stream):
        self.context = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.context is not None:
            self.context.__enter__()

    def __exit__(self, *exc):
        if self.context is not None:
            self.context.__exit__(*exc)


def _stage_error(stage: Stage, action: Action, error: BaseException) -> StageError:
    """A StageError naming the stage, micro-batch and the generated statement that raised."""
    statement = ""
    for frame in traceback.extract_tb(error.__traceback__):
        if frame.filename.startswith("<eval_with_key>") and frame.line:
            statement = f"\n  at: {frame.line.strip()}"
    message = (f"stage {stage.index} (on {stage.device}) failed on micro-batch {action.microbatch} "
               f"({action.phase.name.lower()}): {type(error).__name__}: {error}{statement}\n"
               f"  print(pipe.stages[{stage.index}].code) shows the stage's code")
    result = StageError(message, stage=stage.index, microbatch=action.microbatch)
    result.__cause__ = error
    return result
