"""The errors fxpipe raises. Each message names the problem in its first line (at most about 80
characters) and the fix on the line(s) below it.

`tests/test_error_shape.py` checks every raise; the command line prints the fix indented below the
problem.

Example (a call a graph cannot take: an `InputError`, one `FxpipeError` to catch them all):

>>> import torch
>>> from torch import fx, nn
>>> from fxpipe.passes.errors import FxpipeError
>>> from fxpipe.passes.signature import signature_of
>>> signature = signature_of(fx.symbolic_trace(nn.Linear(2, 2)))
>>> try:
...     signature.flatten_inputs((torch.ones(2), torch.ones(2)))
... except FxpipeError as e:
...     print(type(e).__name__, e, sep=": ")
InputError: 2 positional inputs given; the graph takes 1 positionally
its positional inputs: input
"""

from __future__ import annotations


class FxpipeError(Exception):
    """Base class of every error fxpipe raises on purpose."""


class TraceError(FxpipeError):
    """No front-end could capture the model as a graph."""


class InputError(FxpipeError):
    """Inputs do not match the graph: a missing or unexpected input."""


class DeviceError(FxpipeError):
    """A device list is empty, names a device that does not exist, or mixes what cannot mix."""


class BatchError(FxpipeError):
    """Inputs cannot be split into micro-batches, or outputs cannot be merged back."""


class PartitionError(FxpipeError):
    """The graph cannot be split as asked: too many stages, or too little memory."""


class CostError(FxpipeError):
    """A node failed while its cost was measured, or a node has no cost (a plan loaded from
    disk keeps no costed graph to explain), or a cost rule's option (link, optimizer, recompute,
    repeats) is not one the cost model knows."""


class ScheduleError(FxpipeError):
    """A schedule that does not exist, or a timetable that cannot run: an action missing or
    repeated, a deadlock, or ranks whose messages do not match."""


class LossError(FxpipeError):
    """train_step's loss_fn returned what it cannot use (not a 0-d tensor or a (loss_sum, count)
    pair, one that autograd does not reach), or a reduction other than 'mean' or 'sum'."""


class VerificationError(FxpipeError):
    """The placed stages do not reproduce the model on the example inputs, or the tolerance
    asked for that check is not one."""


class ModelChangedError(FxpipeError):
    """The model changed after compile in a way the pipeline cannot follow (a module, parameter or
    buffer replaced; a hook on a module no stage calls; train() or eval() where the pipeline
    cannot capture the other mode): compile it again."""


class LossReductionError(LossError):
    """A `reduction="mean"` loss_fn is not a mean over rows (a token loss with ignore_index,
    say): micro-batch means weighted by rows would not give the whole batch's loss."""


class PlanFileError(FxpipeError):
    """A plan or checkpoint that cannot be saved or loaded: a file missing or changed, other
    versions, a stage that is not in it, stages that disagree, a Pipeline pickled instead of its
    weights; a checkpoint tensor missing, of another shape or dtype."""


class PipelineClosedError(FxpipeError):
    """A Pipeline used after `close()` (or after its `with` block): its stage workers are gone."""


class StageError(FxpipeError):
    """A stage failed while the pipeline ran; names the stage, the micro-batch and the node."""

    def __init__(self, message: str, *, stage: int, microbatch: int | None = None):
        super().__init__(message)
        self.stage = stage
        self.microbatch = microbatch
