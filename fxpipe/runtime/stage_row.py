"""One stage's row of a timetable, walked against a `Transport` (`StageRow`), and the messages
around it: the driver's inputs to the stages that read them (`send_inputs`), a row's forward
values received (`receive_values`), a row's executor (`row_executor`) and the key that ends a
stream (`END`). The thread runtime walks one row per worker thread; `fxpipe.distributed` one per
process.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

from fxpipe.passes.device import Stream
from fxpipe.passes.stage import Stage

from .schedules import Action, Phase
from .wiring import DRIVER, Flow
from .executor import LossFn, StageExecutor
from .transport import Transport


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
