"""Asynchronous learning on a stream: PipeDream's weight stashing, with the caller's one optimizer.

`Pipeline.stream_train(..., mode="async")` keeps every stage busy, as `stream()` does in
inference: item m's forward enters as soon as stage 0 is free and the staleness bound allows,
and each stage walks an endless 1F1B row (its warm-up forwards, then one backward and one
forward), so stages work on different items' forwards and backwards at once.

Versions. The weights after v optimizer steps are version v. An item that enters at version v
runs its forward and its backward, on every stage, against a copy of version v taken as it
entered (the stash: per version one copy of each stage's parameters, shared by the items that
entered at it, dropped once none of them is inside). So an item's forward and backward agree,
and its gradient is the gradient of the model at version v. Stages write gradients only into the
stashes; the driver (the caller's thread, inside the generator) adds each item's gradient to
the parameters' `.grad`, item after item in stream order, and steps the optimizer after every
`window` items. Item m belongs to window m // window, whose update is number m // window + 1; it
enters only while `m // window - version <= max_staleness`, so its gradient is at most
`max_staleness` updates old when it is applied (its staleness, recorded per item in the run's
record). With a source that is never late, item m enters at version max(0, m // window -
max_staleness) exactly: the run is delayed SGD, the same every time.

Per stage the worker reads its parameters through a copy of the stage's module tree (its own
submodule objects holding the same tensors), where the item's stash is put in place of each
parameter: nothing the caller or another stage reads is touched.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

import torch
from torch import nn

from fxpipe.passes.device import is_gpu, synchronize_stream
from fxpipe.passes.errors import LossError
from fxpipe.passes.stage import Stage

from . import microbatch
from .schedules import Action, Phase, async_warmup
from .executor import EVERY, StageExecutor
from .orchestrator import (DRIVER, END, Run, Runtime, StageRow, _NO_MORE, _Rows,
                           _kept_thread_count, item_error, send_inputs)
from .step import micro_loss
from .transport import POLL_S, Aborted


def row(stage: int, warmup: int) -> Iterator[Action]:
    """Stage `stage`'s endless row: `warmup` forwards (`schedules.async_warmup`), then one
    backward and one forward."""
    yield from (Action(stage, m, Phase.FORWARD) for m in range(warmup))
    m = 0
    while True:
        yield Action(stage, m, Phase.BACKWARD)
        yield Action(stage, m + warmup, Phase.FORWARD)
        m += 1


def private_tree(module: nn.Module) -> nn.Module:
    """`module` with a submodule object of its own at every level, holding the same parameter
    and buffer tensors: a parameter put in place in the copy is seen by nobody else."""
    copy = object.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    copy._parameters = dict(module._parameters)
    copy._buffers = dict(module._buffers)
    copy._modules = {name: None if sub is None else private_tree(sub)
                     for name, sub in module._modules.items()}
    return copy


@dataclass
class _Stash:
    """One version's copies of every stage's parameters, and the items inside that use it."""

    copies: list[dict[int, torch.Tensor]]      # per stage: id(live parameter) -> its copy
    users: int = 0


class _ItemLoss:
    """Each item's loss on the last stage, unweighted (a window weighs its items when it
    applies their gradients), or its `(loss_sum, count)`."""

    def __init__(self, loss_fn: Callable[[Any, Any], Any], signature: Any):
        self.loss_fn = loss_fn
        self.signature = signature
        self.targets: dict[int, Any] = {}
        self.inputs: dict[int, dict[str, Any]] = {}
        self.counts: dict[int, torch.Tensor] = {}

    def __call__(self, m: int, values: dict[str, Any]) -> torch.Tensor:
        output = self.signature.rebuild_outputs({**self.inputs[m], **values})
        loss, count = micro_loss(self.loss_fn, output, self.targets[m])
        if count is not None:
            self.counts[m] = count
        return loss


class _StashingExecutor(StageExecutor):
    """A stage's executor that computes item m against the stash item m entered with, and
    hands the stash's gradients to the driver after m's backward."""

    def __init__(self, stage: Stage, holders: list[tuple[nn.Module, str, int]],
                 stash_of: Callable[[int], dict[int, torch.Tensor]],
                 finished: Callable[[int, int, dict[int, torch.Tensor]], None], **kwargs: Any):
        super().__init__(stage, **kwargs)
        self.holders = holders          # (submodule of the private tree, name, id(live))
        self.stash_of = stash_of
        self.finished = finished

    def _use(self, m: int) -> dict[int, torch.Tensor]:
        stash = self.stash_of(m)
        for owner, name, key in self.holders:
            owner._parameters[name] = stash[key]
        return stash

    def forward(self, m: int, values: Mapping[str, Any]) -> dict[str, Any]:
        self._use(m)
        return super().forward(m, values)

    def backward(self, m: int, grads: Any) -> Any:
        stash = self._use(m)
        input_grads = super().backward(m, grads)
        taken = {}
        for key, copy in stash.items():
            if copy.grad is not None:
                taken[key], copy.grad = copy.grad, None
        if self.stream is not None:     # the driver reads them on its own stream
            self.stream.synchronize()
        self.finished(m, self.stage.index, taken)
        return input_grads


@dataclass
class _Window:
    """One optimizer step's items as they are applied: their rows and losses, for its loss."""

    rows: list[int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    counts: list[torch.Tensor] = field(default_factory=list)


class AsyncTraining(_Rows):
    """One asynchronous `stream_train` (see the module's docstring)."""

    def __init__(self, runtime: Runtime, params: Sequence[nn.Parameter], *,
                 loss_fn: Callable[[Any, Any], Any], signature: Any,
                 optimizer: torch.optim.Optimizer, window: int, max_staleness: int,
                 reduction: Literal["mean", "sum"], train_partial: bool,
                 seed: Callable[[], int | None]):
        super().__init__(runtime, runtime.wiring.flow(training=True))
        self.params = {id(p): p for p in params}
        self.optimizer = optimizer
        self.window = window
        self.k = max_staleness
        self.reduction = reduction
        self.train_partial = train_partial
        self.seed = seed
        self.loss = _ItemLoss(loss_fn, signature)
        self.seeds: dict[int, int | None] = {}
        self.version = 0
        self.item_version: dict[int, int] = {}
        self.stashes: dict[int, _Stash] = {}
        self.spare: list[_Stash] = []        # released versions, their copies to reuse
        self.done: queue.Queue = queue.Queue()
        self.trees = [private_tree(stage.module) for stage in runtime.stages]
        n = len(runtime.stages)
        self.executors = []
        for stage, tree in zip(runtime.stages, self.trees):
            holders = [(owner, name, id(p)) for owner in tree.modules()
                       for name, p in owner._parameters.items()
                       if p is not None and id(p) in self.params]
            self.executors.append(_StashingExecutor(
                Stage(stage.index, tree, stage.inputs, stage.outputs, stage.device),
                holders, self._stash_for(stage.index), self._finished,
                from_stages=[name for src, names in self.flow.reads.get(stage.index, {}).items()
                             if src != DRIVER for name in names], backward_for=EVERY,
                loss_of=self.loss if stage.index == n - 1 else None, seeds=self.seeds,
                stream=runtime.streams[stage.index], recompute=runtime.recompute[stage.index]))
        self.stage_keys = [{key for _, _, key in e.holders} for e in self.executors]
        self.rows = [row(s, async_warmup(s, n, max_staleness, window)) for s in range(n)]
        self.fed = self.applied = 0       # items sent in, and items whose gradient was added
        self.arrived: dict[int, dict[int, dict[int, torch.Tensor]]] = {}   # item -> stage -> grads
        self.window_items = _Window()

    # --- the stashes ---------------------------------------------------------------------------

    def _stash_for(self, stage: int) -> Callable[[int], dict[int, torch.Tensor]]:
        return lambda m: self.stashes[self.item_version[m]].copies[stage]

    def _stash(self) -> _Stash:
        """The current version's stash, copied from the parameters now if it is new."""
        stash = self.stashes.get(self.version)
        if stash is None:
            with torch.no_grad():
                if self.spare:     # a released version's copies, written over in one call
                    stash = _Stash(self.spare.pop().copies)
                    copies = [t for copies in stash.copies for t in copies.values()]
                    torch._foreach_copy_(copies, [self.params[key] for copies in stash.copies
                                                  for key in copies])
                else:
                    stash = _Stash([{key: self.params[key].detach().clone().requires_grad_(
                                         self.params[key].requires_grad)
                                     for key in keys} for keys in self.stage_keys])
            for device in {p.device for p in self.params.values() if is_gpu(p.device)}:
                synchronize_stream(device)   # stages copy on their own
            self.stashes[self.version] = stash
        return stash

    def _finished(self, m: int, stage: int, grads: dict[int, torch.Tensor]) -> None:
        self.done.put((m, stage, grads))

    # --- the driver ----------------------------------------------------------------------------

    def run(self, items: Iterator[tuple[dict[str, Any], Any]]) -> Iterator[torch.Tensor]:
        """Feed items while the bound allows, apply finished items' gradients in order, step
        the optimizer every `window` of them and yield that window's loss."""
        ended = False
        self.optimizer.zero_grad()
        try:
            with self.driving(Run(num_stages=len(self.rt.stages)), self.work, item_error), \
                    _kept_thread_count():
                # The driver's own work (copying a version, adding gradients, the optimizer's
                # step) on one intra-op thread: the stages' threads hold the cores, and a team
                # of OpenMP threads of the caller's would spin on them between its ops
                # (measured: ViT 20.8 items/s, 28.1 with it). Switching back and forth costs
                # ~0.2 ms a time, so the loop's body runs so too, until the stream ends.
                torch.set_num_threads(1)
                while not ended or self.applied < self.fed:
                    if not ended and self.fed // self.window - self.version <= self.k:
                        item = next(items, _NO_MORE)
                        ended = item is _NO_MORE
                        # What finished while the source was waited for is applied first, so
                        # a late item enters with the newest weights.
                        yield from self._apply_finished(wait=False)
                        self._feed(self.fed, item)
                        self.fed += not ended
                    else:
                        yield from self._apply_finished(wait=True)
                if self.window_items.rows:
                    if self.train_partial:
                        yield self._step(self.window_items)
                    else:
                        self.optimizer.zero_grad()
        except BaseException:      # stopped early, a stage failed, or Ctrl-C: no gradient left
            self.optimizer.zero_grad()
            raise

    def _feed(self, m: int, item: Any) -> None:
        """Item m's inputs and target, its version's stash; or the stream's end."""
        if item is _NO_MORE:
            send_inputs(self.flow, self.transport, m, {END: None})
            return
        values, target = item
        self.item_version[m] = self.version
        self._stash().users += 1
        self.seeds[m] = self.seed()
        self.loss.inputs[m] = values
        self.loss.targets[m] = microbatch.on_device(target, self.rt.stages[-1].device)
        send_inputs(self.flow, self.transport, m, values)

    def _apply_finished(self, wait: bool) -> Iterator[torch.Tensor]:
        """Take every item's backward the stages finished (with `wait`, at least one), apply
        the items whose every stage finished, in order, and step the optimizer at each
        window's end, yielding its loss. Raises `Aborted` once the run is."""
        while True:
            if self.stopping.is_set():
                raise Aborted("the stream was aborted")
            try:
                m, stage, grads = self.done.get(timeout=POLL_S) if wait else \
                    self.done.get_nowait()
            except queue.Empty:
                if wait:
                    continue
                return
            wait = False
            self.arrived.setdefault(m, {})[stage] = grads
            while len(self.arrived.get(self.applied, ())) == len(self.rt.stages):
                self._apply(self.applied, self.arrived.pop(self.applied), self.window_items)
                self.applied += 1
                if self.applied % self.window == 0:
                    yield self._step(self.window_items)
                    self.window_items = _Window()

    def _apply(self, m: int, grads: dict[int, dict[int, torch.Tensor]], window: _Window) -> None:
        """Add item m's gradient to `.grad` (weighted by its rows for a mean), release its
        stash, and keep its loss for its window."""
        rows = microbatch.batch_size(self.loss.targets.pop(m))
        weight = float(rows) if self.reduction == "mean" and m not in self.loss.counts else 1.0
        with torch.no_grad():
            for stage_grads in grads.values():
                for key, g in stage_grads.items():
                    p = self.params[key]
                    if weight != 1.0:
                        g.mul_(weight)
                    p.grad = g if p.grad is None else p.grad.add_(g)
        version = self.item_version.pop(m)
        self.stashes[version].users -= 1
        self.rt.last_run.versions.append(version)
        self.rt.last_run.staleness.append(m // self.window - version)
        self.loss.inputs.pop(m)
        self.seeds.pop(m, None)
        window.rows.append(rows)
        window.losses.append(self.executors[-1].losses.pop(m))
        if m in self.loss.counts:
            window.counts.append(self.loss.counts.pop(m))
        elif window.counts:
            raise LossError("loss_fn returned (loss_sum, count) for one item but not for "
                            "another\nreturn the same for every item")

    def _step(self, window: _Window) -> torch.Tensor:
        """Scale the window's gradients, step the optimizer, start the next version; the
        window's loss."""
        losses = torch.stack([loss.double() for loss in window.losses])
        if window.counts:
            count = sum(float(c) for c in window.counts)
            scale = 1 / count if count > 0 else 0.0
            loss = losses.sum() * scale
        elif self.reduction == "mean":
            rows = torch.tensor(window.rows, dtype=torch.float64, device=losses.device)
            scale, loss = 1 / float(rows.sum()), (losses * rows).sum() / rows.sum()
        else:
            scale, loss = 1.0, losses.sum()
        if scale != 1.0:
            with torch.no_grad():
                for p in self.params.values():
                    if p.grad is not None:
                        p.grad.mul_(scale)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.version += 1
        for version in [v for v, s in self.stashes.items() if s.users == 0 and v < self.version]:
            self.spare.append(self.stashes.pop(version))
        return loss.to(window.losses[0].dtype)

    # --- the workers ---------------------------------------------------------------------------

    def work(self, index: int) -> None:
        """Stage `index` walks its row until the stream ended and its last backward ran."""
        executor = self.executors[index]
        record = self.rt.last_run
        self.walk(StageRow(executor, self.rows[index], self.flow, self.transport),
                  clock=record.clock, done=record.done, drain=True)

