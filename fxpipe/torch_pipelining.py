"""A chain plan on torch.distributed.pipelining: the same stages, run by torch's own schedules.

    # torchrun --nproc-per-node 2 run.py     (rank r holds stages r, r + 2, ...)
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    stages = fxpipe.torch_pipelining.pipeline_stages("plans/net-4")
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=F.mse_loss)
    schedule.step(x) if rank == 0 else schedule.step(target=target)

torch.distributed.pipelining passes one stage's outputs to the next stage only, so this works
for plans that are chains: stage 0 reads only graph inputs, every later stage reads only what
the stage before it sends, and only the last stage returns graph outputs. Plans with skips
(a value from stage 0 read by stage 2) run on `fxpipe.distributed`, which routes them; a plan
that is not a chain is refused here, naming the value that skips. Each stage becomes a module
whose `forward` takes the previous stage's outputs positionally (stage 0: the graph's inputs, in
the model's order) and returns its own outputs (one tensor alone, several as a tuple); the last
stage returns the graph's outputs as a flat tuple, not rebuilt into the model's output type.
Stages are placed as torch's looped schedules expect: with `w` processes, rank r holds stages
r, r + w, r + 2w, ...
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch import nn

from fxpipe.passes.stage import Stage
from fxpipe.passes.errors import FxpipeError

from .runtime.devices import DeviceLike
from .plans.plan_data import Plan
from .distributed import DistributedError, WorldSizeError, rank_device
from .distributed.stage import forget_captured_default_group
from .plans.saved import load_stage_plan, planned_device, stage_count
from .runtime.wiring import DRIVER

__all__ = ["NotAChainError", "chain_module", "check_chain", "pipeline_stages"]


class NotAChainError(FxpipeError):
    """A plan whose stages pass values past their neighbour, which torch's pipelining cannot."""


class _Link(nn.Module):
    """One stage of a chain, taking what the previous stage returns, in its order."""

    def __init__(self, stage: Stage, takes: tuple[str, ...]):
        super().__init__()
        self.stage = stage.module
        self.takes = takes
        self.reads = tuple(stage.inputs)

    def forward(self, *args):
        values = dict(zip(self.takes, args))
        out = self.stage.forward(*(values[name] for name in self.reads))
        return out[0] if len(out) == 1 else tuple(out)


def check_chain(plan: Plan) -> None:
    """Raise `NotAChainError` unless each stage reads only from the one before it (stage 0 only
    from the graph's inputs) and only the last stage returns graph outputs."""
    flow, last = plan.wiring.inference, len(plan.stages) - 1
    for stage in plan.stages:
        for sender, names in flow.reads.get(stage.index, {}).items():
            expected = DRIVER if stage.index == 0 else stage.index - 1
            if sender != expected:
                where = "the graph's input" if sender == DRIVER else f"stage {sender}"
                raise NotAChainError(
                    f"stage {stage.index} reads {names[0]!r} from {where}, not stage "
                    f"{expected}\ntorch.distributed.pipelining passes values to the next stage "
                    f"only; run this plan with fxpipe.distributed, which routes skips")
    for sender in flow.reads.get(DRIVER, {}):
        if sender != last:
            raise NotAChainError(f"stage {sender} returns a graph output, not the last stage "
                                 f"{last}\nrun this plan with fxpipe.distributed")


def chain_module(plan: Plan, index: int) -> nn.Module:
    """Stage `index` of a chain plan as a module for `PipelineStage` (see the module docstring)."""
    check_chain(plan)
    stage = plan.stages[index]
    takes = (tuple(plan.signature.placeholders) if index == 0 else
             tuple(plan.stages[index - 1].outputs))
    return _Link(stage, takes)


def pipeline_stages(path: str | os.PathLike, *, device: DeviceLike | None = None,
                    group: dist.ProcessGroup | None = None) -> list:
    """This rank's `PipelineStage`s of the chain plan saved at `path` (rank r of w holds stages
    r, r + w, ...), each loaded with its own weights only; the default process group must be
    initialised (torchrun, then `dist.init_process_group`). Each stage, its weights and the
    devices its code names, is put on `device`, by default as `fxpipe.distributed.load` does
    (`rank_device`: `cuda:LOCAL_RANK` for a stage planned on a GPU, else its planned device)."""
    from torch.distributed.pipelining import PipelineStage

    forget_captured_default_group()     # that import may have bound the caller's group
    if not dist.is_initialized():
        raise DistributedError("no process group\nstart the processes with torchrun and call "
                               "torch.distributed.init_process_group() before pipeline_stages()")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    count = stage_count(path)
    if count % world:
        raise WorldSizeError(f"the plan's {count} stages are not a multiple of the {world} "
                             f"processes\nthe plan at {str(path)!r}: start {count} (or a "
                             f"divisor of it) with torchrun")
    stages = []
    for index in range(rank, count, world):
        plan, stage = load_stage_plan(path, index,
                                      device=rank_device(planned_device(path, index), device))
        stages.append(PipelineStage(chain_module(plan, index), index, count, stage.device,
                                    group=group))
    return stages
