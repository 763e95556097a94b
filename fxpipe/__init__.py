"""fxpipe: turn a PyTorch model into a balanced pipeline across devices, automatically.

    pipe = fxpipe.compile(model, ["cpu", "cpu"], example_inputs=(x,), chunks=8)
    y = pipe(x)          # equals model(x)
    print(pipe.plan)     # how the model was split
"""

__version__ = "0.4.0"   # the one place the version lives (pyproject.toml reads it)

from fxpipe.passes.stage import Stage
from fxpipe.passes.cost_model import DeviceSpec, Link, NodeCost
from fxpipe.passes.errors import (BatchError, CostError, DeviceError, FxpipeError, InputError,
                                  LossError, LossReductionError, ModelChangedError, PartitionError,
                                  PipelineClosedError,
                                  ScheduleError, StageError, TraceError, VerificationError)
from fxpipe.passes.partition import Partition

from . import timeline
from .api import compile, plan
from .runtime.devices import tune_cpu_allocator
from .pipeline import Pipeline
from .plans.plan_data import Plan
from .plans.saved import PlanFileError, load_plan

__all__ = [
    "__version__",
    "compile", "plan", "load_plan", "PlanFileError", "tune_cpu_allocator", "Pipeline", "Plan", "Partition", "Stage", "DeviceSpec", "Link", "NodeCost",
    "FxpipeError", "TraceError", "DeviceError", "BatchError", "InputError", "PartitionError",
    "CostError", "StageError", "ModelChangedError", "ScheduleError", "LossError",
    "LossReductionError", "VerificationError", "PipelineClosedError",
]
