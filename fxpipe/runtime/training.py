"""`train_step`'s driver: forward and backward over a batch's micro-batches on the plan's
schedule, by the train-step contract (`runtime.step`).

The batch is split by the shared front (`runtime.front`): `chunks` micro-batches, or one per row
for a batch of fewer rows; `target` is split alike and `loss_fn(output, target)` runs on each
micro-batch in the last stage. With `reduction="mean"` (a `loss_fn` averaging over the batch)
each micro-batch's loss is weighted by its share of the rows, so the loss and the gradients left
in `.grad` equal the whole batch's; with `"sum"` the losses are added. A `loss_fn` returning
`(loss_sum, count)` (a mean over something other than rows, such as tokens that are not padding)
makes the step's loss `sum(loss_sums) / sum(counts)` and its gradients those of that mean
(`reduction` not used). The first "mean" step of more than one micro-batch checks that `loss_fn`
averages over rows (`LossReductionError` otherwise, `.grad` left as it was). A plan that runs the
model as is trains the model's own forward (`runtime.as_is`). `stream_train`'s exact windows
(`runtime.streaming`) are steps whose micro-batches are the window's items (`train_microbatches`).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

import torch

from fxpipe.passes.graph_values import tensors

from . import microbatch
from .as_is import train_as_is
from .front import Facade, Front, split, timetable
from .step import DeferredScale, StepLoss, check_reduction, check_target, step_inputs


def call_args(inputs: Any) -> tuple[tuple, dict[str, Any]]:
    """A call's `(args, kwargs)` from what `train_step` and streams take: a tensor, a tuple of
    positional inputs or a dict of keyword inputs."""
    if isinstance(inputs, dict):
        return (), inputs
    return (inputs if isinstance(inputs, tuple) else (inputs,)), {}


def train_step(use: Facade, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], Any],
               reduction: Literal["mean", "sum"]) -> torch.Tensor:
    """`pipe.train_step(inputs, target, loss_fn, reduction=...)` (see the module docstring)."""
    check_reduction(reduction)
    use.check_open()
    use.check_model()
    plan = use.plan
    values = step_inputs(plan.signature, inputs)
    front = split(plan, values)
    check_target(target, microbatch.batch_size(values, plan.placeholder_dims))
    with use.measuring(training=True):
        if use.as_is is not None:
            return train_as_is(use.runtime, plan.stages, plan.signature,
                               [*use.parameters, *tensors(values)], use.as_is,
                               *call_args(inputs), target, loss_fn, reduction)
        loss = train_microbatches(use, front, microbatch.split(target, front.microbatches),
                                  loss_fn, reduction, leaves=tensors(values))
        use.runtime.last_run.rows = front.rows
        return loss


def train_microbatches(use: Facade, front: Front, targets: Sequence[Any],
                       loss_fn: Callable[[Any, Any], Any], reduction: Literal["mean", "sum"], *,
                       leaves: list[torch.Tensor]) -> torch.Tensor:
    """Forward and backward of these micro-batches (graph inputs by placeholder, with their
    targets), each from its own seed, following the plan's schedule; the step's loss. `leaves`: the caller's
    input tensors, whose gradients accumulate as the parameters'."""
    plan = use.plan
    step = StepLoss(loss_fn, plan.signature, reduction,
                    DeferredScale([*use.parameters, *leaves]),
                    check_rows_mean=not use.loss_check.done, output_dims=plan.output_dims)
    step.take_targets(targets, plan.stages[-1].device)
    try:
        losses, _ = use.runtime.run(timetable(plan, front.microbatches, training=True),
                                    front.chunks, loss_of=step, seeds=front.seeds())
    except BaseException:
        step.finish([])     # the gradients held aside are given back
        raise
    loss = step.finish(losses)
    use.loss_check.done = use.loss_check.done or bool(step.kept)
    return loss
