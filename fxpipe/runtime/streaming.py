"""The drivers of streams: `stream` (inference, item after item) and `stream_train`'s two ways
of learning from a stream, its exact windows and its asynchronous ones.

Each item is run whole (no split into micro-batches): a tensor, a tuple of positional inputs or
a dict of keyword inputs (`stream_train`'s items are `(input, target)` pairs). Item m draws from
its own seed, taken from the caller's generator as it is fed.

- `stream`: the stages work on consecutive items at once, on the pipeline's workers, at most
  `max_in_flight` items inside (`Runtime.stream`).
- `stream_train(mode="exact")`: each window of items is one train step whose micro-batches are
  the items (`runtime.training.train_microbatches`, on the plan's schedule), then the
  optimizer's step: equal to the model trained on the same windows one after another. A window
  that fails leaves `.grad` zeroed.
- `stream_train(mode="async")`: every stage kept busy with weight stashing
  (`runtime.asynchronous`), refused up front where the stashes would not fit a device.

Stopping early (leaving the loop, an exception in `items`, Ctrl-C) stops every worker and waits
until it is at rest; a failing item raises a `StageError` naming its stage and its index in the
stream. The arguments are checked when `stream_train` is called (its loops are generators of
their own), `stream`'s as it starts.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator, Literal

import torch

from fxpipe.passes.cost_model import format_bytes
from fxpipe.passes.errors import BatchError, DeviceError, InputError, StageError
from fxpipe.passes.graph_values import tensors
from fxpipe.passes.randomness import microbatch_seeds

from . import microbatch
from .asynchronous import AsyncTraining
from .driver import item_error
from .front import Facade, Front
from .step import check_reduction, check_target, step_inputs
from .training import call_args, train_microbatches


def stream(use: Facade, items: Iterable[Any], max_in_flight: int | None) -> Iterator[Any]:
    """`pipe.stream(items, max_in_flight=...)`: the model's output for each item, in order, as
    the items come (default: twice the stages in flight)."""
    use.check_model()
    plan = use.plan
    limit = max_in_flight if max_in_flight is not None else 2 * len(plan.stages)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise BatchError(f"max_in_flight={max_in_flight!r}: must be a number of items >= 1")
    signature, placeholders = plan.signature, plan.signature.placeholders

    def graph_inputs() -> Iterator[dict[str, Any]]:
        for item in items:
            yield dict(zip(placeholders, signature.flatten_inputs(*call_args(item))))

    flowing = use.runtime.stream(graph_inputs(), max_in_flight=limit,
                                 seed=lambda: microbatch_seeds(1)[0])
    try:
        for values, out in flowing:
            yield signature.rebuild_outputs({**values, **out})
    finally:
        flowing.close()


def stream_train(use: Facade, items: Iterable[tuple[Any, Any]],
                 loss_fn: Callable[[Any, Any], Any], optimizer: torch.optim.Optimizer, *,
                 window: int, partial: Literal["train", "drop"], reduction: Literal["mean", "sum"],
                 mode: Literal["exact", "async"], max_staleness: int | None
                 ) -> Iterator[torch.Tensor]:
    """`pipe.stream_train(...)`: its arguments checked, then its exact or asynchronous loop."""
    check_reduction(reduction)
    use.check_open()
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise BatchError(f"window={window!r}: must be a number of items >= 1 per optimizer "
                         f"step")
    if partial not in ("train", "drop"):
        raise BatchError(f"partial={partial!r} is not 'train' or 'drop'\n"
                         f"use 'train' to train a last window of fewer items than "
                         f"window={window}, or 'drop' to leave it out")
    held = {id(p) for p in use.parameters}
    if not any(id(p) in held for group in optimizer.param_groups for p in group["params"]):
        raise InputError("the optimizer holds none of the pipeline's parameters\n"
                         "nothing would learn: make it from them, e.g. "
                         "torch.optim.SGD(pipe.parameters(), lr=1e-2)")
    if mode == "exact":
        if max_staleness is not None:
            raise BatchError(f"max_staleness={max_staleness!r} bounds mode='async', not "
                             f"mode='exact'\nthe exact mode applies every gradient before "
                             f"the next window enters; pass mode='async', or leave "
                             f"max_staleness out")
        return _windows(use, iter(items), loss_fn, optimizer, window, partial == "train",
                        reduction)
    if mode != "async":
        raise BatchError(f"mode={mode!r} is not 'exact' or 'async'\n"
                         f"use 'exact' (equal to the model trained window after window) or "
                         f"'async' (all stages busy, stale gradients)")
    bound = len(use.plan.stages) - 1 if max_staleness is None else max_staleness
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
        raise BatchError(f"max_staleness={max_staleness!r}: must be a number of optimizer "
                         f"steps >= 0")
    _check_async_memory(use, bound, window)
    return _async(use, iter(items), loss_fn, optimizer, window, bound, partial == "train",
                  reduction)


def _check_async_memory(use: Facade, max_staleness: int, window: int) -> None:
    """Refuse an asynchronous stream whose stashed weights would not fit a device."""
    plan = use.plan
    need = plan.stream_train_memory(max_staleness, window)
    for s, (bytes_, device) in enumerate(zip(need, plan.partition.devices)):
        if bytes_ > device.memory_bytes:
            params = sum(p.numel() * p.element_size()
                         for p in plan.stages[s].module.parameters())
            raise DeviceError(
                f"stage {s} would hold {format_bytes(bytes_)}, over {device.name}'s "
                f"{format_bytes(device.memory_bytes)}\nin stream_train(mode='async', "
                f"max_staleness={max_staleness}, window={window}) each step of staleness "
                f"stashes one more copy of its parameters ({format_bytes(params)}), more than "
                f"the device holds\nlower max_staleness, or use mode='exact'")


def _async(use: Facade, items: Iterator[tuple[Any, Any]], loss_fn: Callable[[Any, Any], Any],
           optimizer: torch.optim.Optimizer, window: int, max_staleness: int,
           train_partial: bool, reduction: Literal["mean", "sum"]) -> Iterator[torch.Tensor]:
    """`stream_train(mode="async")`'s loop (see `fxpipe.runtime.asynchronous`)."""
    use.check_model()
    run = AsyncTraining(use.runtime, use.parameters, loss_fn=loss_fn,
                        signature=use.plan.signature, optimizer=optimizer, window=window,
                        max_staleness=max_staleness, reduction=reduction,
                        train_partial=train_partial, seed=lambda: microbatch_seeds(1)[0])
    yield from run.run(_item(use, i, item) for i, item in enumerate(items))


def _windows(use: Facade, items: Iterator[tuple[Any, Any]], loss_fn: Callable[[Any, Any], Any],
             optimizer: torch.optim.Optimizer, window: int, train_partial: bool,
             reduction: Literal["mean", "sum"]) -> Iterator[torch.Tensor]:
    """`stream_train(mode="exact")`'s loop: each window one step of its items."""
    first = 0          # the stream's index of the window's first item
    while True:
        taken = list(itertools.islice(items, window))
        if not taken or (len(taken) < window and not train_partial):
            return
        use.check_model()
        chunks, targets = zip(*(_item(use, first + i, item) for i, item in enumerate(taken)))
        optimizer.zero_grad()
        try:
            loss = train_microbatches(use, Front(list(chunks)), list(targets), loss_fn,
                                      reduction, leaves=tensors(chunks))
        except StageError as e:
            optimizer.zero_grad()       # no part of a window's gradients is left
            error = item_error(e, first)
            raise error from error.__cause__
        except BaseException:
            optimizer.zero_grad()
            raise
        optimizer.step()
        yield loss
        first += len(taken)


def _item(use: Facade, index: int, item: Any) -> tuple[dict[str, Any], Any]:
    """Item `index` of `stream_train`'s stream: its graph inputs by placeholder, and its
    target; an item that is no `(input, target)` pair is refused, naming its index."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        what = f" of {len(item)}" if isinstance(item, (tuple, list)) else ""
        raise InputError(f"item {index} of the stream is a {type(item).__name__}{what}\n"
                         f"stream_train takes (input, target) pairs, the input a tensor, a "
                         f"tuple of positional inputs or a dict of keyword inputs")
    inputs, target = item
    try:
        values = step_inputs(use.plan.signature, inputs)
        check_target(target, microbatch.batch_size(values, use.plan.placeholder_dims),
                     "stream_train")
    except (InputError, BatchError) as e:
        raise type(e)(f"item {index} of the stream: {e}") from e
    return values, target
