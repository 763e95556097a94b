"""One run's front, the same in process and on torchrun ranks: split the batch -> timetable ->
seeds -> run -> merge.

The batch is split into the plan's `chunks` micro-batches, or one per row where it has fewer rows
(a single request, a dataset's last short batch; an empty batch is refused), each micro-batch
draws from its own seed, and the timetable is built for the micro-batches there are (GPipe's
forwards for a call, the plan's schedule with backwards for a train step). In process the
caller's thread does it all (`runtime.calls`, `runtime.training`). Under torchrun the stage-0
rank of each replica splits its batch and draws the seeds (`split`, `Front.seeds`), every rank of the replica
learns the count and the seeds from it (`fxpipe.distributed.stage`), builds the same timetable,
and the last rank merges: so any batch the model takes runs alike in both.

`Facade` is what the drivers (`calls`, `training`, `streaming`, `fxpipe.generate`) are given by
`fxpipe.pipeline.Pipeline`: its current plan and runtime, and its checks and records.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

from torch import nn

from fxpipe.passes.randomness import microbatch_seeds

from . import microbatch
from .schedules import Timetable, gpipe, timetable_for

if TYPE_CHECKING:
    from .orchestrator import Runtime

# `Plan` in annotations is `fxpipe.plans.plan_data.Plan`, a layer above the runtime: named, never
# imported (the import runs one way, `tests/test_layers.py`).


@dataclass
class Front:
    """One batch as it runs: its micro-batches' graph inputs (by placeholder) and the batch's
    rows (None where no input has a batch dimension)."""

    chunks: list[dict[str, Any]]
    rows: int | None = None

    @property
    def microbatches(self) -> int:
        return len(self.chunks)

    def seeds(self) -> list[int]:
        """Each micro-batch's seed, drawn from the caller's generator (once per batch) as the
        run starts, so that a batch refused before it runs draws nothing."""
        return microbatch_seeds(self.microbatches)


def split(plan: Plan, values: dict[str, Any]) -> Front:
    """`values` (graph inputs by placeholder) split as the plan runs them."""
    return Front(microbatch.split_up_to(values, plan.chunks, plan.placeholder_dims),
                 microbatch.rows_of(values, plan.placeholder_dims))


def timetable(plan: Plan, microbatches: int, *, training: bool) -> Timetable:
    """The timetable of one call (GPipe's forwards) or train step (the plan's schedule, with
    backwards) of `microbatches` micro-batches on the plan's stages."""
    if training:
        return timetable_for(plan.schedule, len(plan.stages), microbatches, backward=True)
    return gpipe(len(plan.stages), microbatches)


def merged(plan: Plan, outputs: Sequence[Any]) -> Any:
    """The model's output for the batch from each micro-batch's (in order)."""
    return microbatch.merge(list(outputs), plan.output_dims)


class LossCheck:
    """Whether a pipeline's steps have checked that `loss_fn` averages over rows: its first
    "mean" step of more than one micro-batch does (`runtime.step.StepLoss`), none after."""

    done = False


@dataclass
class Facade:
    """What a driver is given by the Pipeline (`fxpipe.pipeline`) for one use: the plan and
    runtime of its current mode, its parameters (those a step's gradients go to), the model where
    the plan runs it as is (None otherwise), the checks that the pipeline is open and that the
    model did not change (`ModelWatch`), the record of a run's time and memory (`measuring(training=...)`), and
    what its steps share (`LossCheck`)."""

    plan: Plan
    runtime: Runtime
    parameters: list[nn.Parameter]
    as_is: nn.Module | None = None
    check_open: Callable[[], None] = lambda: None
    check_model: Callable[[], None] = lambda: None
    measuring: Callable[..., ContextManager[None]] = lambda training: contextlib.nullcontext()
    loss_check: LossCheck = field(default_factory=LossCheck)
