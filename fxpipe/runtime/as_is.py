"""The model run as is, where its plan says so (one stage, the whole batch, the caller's
threads): a call or a train step runs the model's own forward, which costs what the model
costs, recorded in `last_run` as the pipeline's one micro-batch."""

from __future__ import annotations

import time
from typing import Any, Callable, Literal, Sequence

import torch
from torch import nn

from fxpipe.passes.device import forked_generators, seed_generators, started_generators
from fxpipe.passes.errors import FxpipeError, StageError
from fxpipe.passes.randomness import microbatch_seeds
from fxpipe.passes.signature import Signature
from fxpipe.passes.stage import Stage

from .schedules import Action, Phase, Slot
from .memory import stage_memory
from .orchestrator import Run, Runtime
from .step import DeferredScale, StepLoss


def run_as_is(runtime: Runtime, stage: Stage, model: nn.Module, args: tuple,
              kwargs: dict[str, Any], then: Callable[[Any], Any] = lambda out: out) -> Any:
    """`then(model(*args, **kwargs))` as the pipeline's one micro-batch (`stage` its one
    stage): from its seed (the caller's generator left as the graph would leave it), recorded
    in `runtime.last_run`, a failure raised as a `StageError` (but fxpipe's own errors, a loss
    refused, as they are)."""
    seed = microbatch_seeds(1)[0]
    generators = started_generators()
    record = Run(num_stages=1, microbatches=1)
    runtime.last_run = record
    start = time.perf_counter()
    try:
        with forked_generators(generators), stage_memory(stage):
            # torch.manual_seed(seed), for the generators there are (it costs 100 us more).
            torch.default_generator.manual_seed(seed)
            seed_generators(seed, generators)
            out = then(model(*args, **kwargs))
    except FxpipeError as e:
        record.error = f"{type(e).__name__} in the model run as is"
        raise
    except Exception as e:
        record.error = f"{type(e).__name__} in the model run as is"
        raise StageError(f"stage 0 (the model as is) failed on micro-batch 0\n"
                         f"{type(e).__name__}: {e}", stage=0, microbatch=0) from e
    finally:
        record.wall_s = time.perf_counter() - start
    record.slots.append(Slot(Action(0, 0, Phase.FORWARD), 0.0, record.wall_s))
    return out


def train_as_is(runtime: Runtime, stages: Sequence[Stage], signature: Signature,
                leaves: list[torch.Tensor], model: nn.Module, args: tuple,
                kwargs: dict[str, Any], target: Any, loss_fn: Callable[[Any, Any], Any],
                reduction: Literal["mean", "sum"]) -> torch.Tensor:
    """A train step of the model as is: its own forward on the whole batch, the step's loss
    (one micro-batch, by the train-step contract) and its backward, on the caller's thread;
    `leaves`: the tensors whose `.grad` the step adds to (parameters and inputs)."""
    step = StepLoss(loss_fn, signature, reduction, DeferredScale(leaves))
    step.take_targets([target], stages[-1].device)

    def learn(output: Any) -> torch.Tensor:
        loss = step.of_output(0, output)
        loss.backward()
        return loss.detach()
    try:
        loss = run_as_is(runtime, stages[0], model, args, kwargs, then=learn)
    except BaseException:
        step.finish([])     # the gradients held aside are given back
        raise
    return step.finish([loss])
