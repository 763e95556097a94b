"""The errors fxpipe raises. Each message names the problem and the fix."""

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
    """A node failed while its cost was measured, or a node has no cost."""


class ModelChangedError(FxpipeError):
    """The model changed after compile in a way the pipeline cannot follow (a module, parameter or
    buffer replaced; a hook on a module no stage calls): compile it again."""


class LossReductionError(FxpipeError):
    """A `reduction="mean"` loss_fn is not a mean over rows (a token loss with ignore_index,
    say): micro-batch means weighted by rows would not give the whole batch's loss."""


class StageError(FxpipeError):
    """A stage failed while the pipeline ran; names the stage, the micro-batch and the node."""

    def __init__(self, message: str, *, stage: int, microbatch: int | None = None):
        super().__init__(message)
        self.stage = stage
        self.microbatch = microbatch
