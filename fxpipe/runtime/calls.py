"""A call's driver (`pipe(*args, **kwargs)`), and a plan's stages run as a Pipeline runs them,
without a Pipeline: a runtime for a plan, one call, one train step. The Pipeline
(`fxpipe.pipeline`) calls them, and so do compile's check and race (`fxpipe.planning.checks`,
`fxpipe.planning.measure`), which build no Pipeline: planning imports these, not the runtime's
façade. Each splits its batch by the shared front (`runtime.front`).
"""

from __future__ import annotations

from typing import Any

import torch

from fxpipe.passes.errors import StageError
from fxpipe.passes.graph_values import tensors
from torch import nn

from .as_is import run_as_is
from .front import merged, split, timetable
from .orchestrator import Runtime

# `Plan` in annotations is `fxpipe.plans.plan_data.Plan`, a layer above the runtime: named, never
# imported (the import runs one way, `tests/test_layers.py`).


def runtime_of(plan: Plan) -> Runtime:
    """A runtime for `plan`'s stages, along its wiring, with its threads and recomputation
    (starting no thread: a run does)."""
    return Runtime(plan.stages, plan.wiring, threads_per_stage=list(plan.threads),
                   recompute=plan.stage_recompute)


def call(plan: Plan, runtime: Runtime, model: nn.Module | None, args: tuple,
         kwargs: dict[str, Any]) -> Any:
    """`pipe(*args, **kwargs)`: the model's own forward where the plan runs it as is (`model`,
    as it is now: every hook fires), the stages' call otherwise."""
    if model is not None:
        return run_as_is(runtime, plan.stages[0], model, args, kwargs)
    return call_stages(plan, runtime, args, kwargs)


def call_stages(plan: Plan, runtime: Runtime, args: tuple, kwargs: dict[str, Any]) -> Any:
    """One call of `plan`'s stages on the model's inputs, as `pipe(*args, **kwargs)` makes it:
    split into micro-batches (one per row for a batch of fewer rows than chunks), run by
    `runtime` (GPipe's forwards, each micro-batch from its seed), merged into the model's
    output. Compile's check runs it in order, without a Pipeline."""
    signature = plan.signature
    values = dict(zip(signature.placeholders, signature.flatten_inputs(args, kwargs)))
    front = split(plan, values)
    try:
        outputs, record = runtime.run(timetable(plan, front.microbatches, training=False),
                                      front.chunks, seeds=front.seeds())
    except StageError as error:
        raise with_the_call(error, plan, values, front.microbatches) from error.__cause__
    record.rows = front.rows
    return merged(plan, [signature.rebuild_outputs({**chunk, **out})
                         for chunk, out in zip(front.chunks, outputs)])


def with_the_call(error: StageError, plan: Plan, values: dict[str, Any],
                  chunks: int) -> StageError:
    """`error`, a stage's on a micro-batch, with the caller's inputs (their shapes, as given,
    before the split into micro-batches) and the sizes the plan serves."""
    given = ", ".join(f"{name} {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
                      for name, v in values.items() if isinstance(v, torch.Tensor))
    message = (f"{error}\nthe call's inputs: {given or 'no tensor'}, split into "
               f"{chunks} micro-batch{'es' * (chunks > 1)}; the plan serves "
               f"{plan.signature.sizes_served()}\nFix: call the pipeline with inputs the model "
               f"takes, shaped as its example (every size the plan does not mark free), or "
               f"compile again on an example of these")
    return StageError(message, stage=error.stage, microbatch=error.microbatch)


def train_stages(plan: Plan, runtime: Runtime, args: tuple, kwargs: dict[str, Any]) -> None:
    """One train step of `plan`'s stages on the model's inputs, as `train_step` runs it (its
    schedule, each micro-batch from its seed), the sum of the outputs as the loss: what
    compile's race times in training. `.grad` is left as it was."""
    signature = plan.signature
    values = dict(zip(signature.placeholders, signature.flatten_inputs(args, kwargs)))
    front = split(plan, values)
    params = list({id(p): p for stage in plan.stages for p in stage.module.parameters()}.values())
    before = [p.grad for p in params]

    def loss_of(m: int, graph_values: dict[str, Any]) -> torch.Tensor:
        out = signature.rebuild_outputs(graph_values)
        return sum((t.float().sum() for t in tensors(out) if t.requires_grad),
                   torch.zeros((), device=plan.stages[-1].device))
    try:
        for p in params:
            p.grad = None
        runtime.run(timetable(plan, front.microbatches, training=True), front.chunks,
                    loss_of=loss_of, seeds=front.seeds())
    finally:
        for p, grad in zip(params, before):
            p.grad = grad
