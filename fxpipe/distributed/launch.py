"""Launch: the process groups, and this rank's stage of a saved plan (`load`).

A world of `replicas x stages` ranks: rank r runs stage `r % stages` of replica `r // stages`.
`load` joins (or starts) the default process group, loads this rank's stage on its device
(`rank_device`), makes every rank stop when one cannot load its stage, and makes the gloo
groups a step needs: each replica's ranks, each stage's replicas, the holders of tied weights.

A stage planned on a GPU loads, by default, on cuda:LOCAL_RANK made current (`rank_device`), else
on `device=`. A world size not a multiple of the stages is refused (`WorldSizeError`); a plan not
priced with `link="gloo"` is warned of. `weights=` reads this rank's stage only
(`saved.load_stage`). Over a default NCCL group, tensors go over it.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from fxpipe.passes.cost_model import DeviceSpec
from fxpipe.passes.device import is_gpu, set_device

from ..runtime.devices import DeviceLike
from ..plans.report import LINK_DESCRIPTIONS
from ..plans.saved import load_stage_plan, planned_device, shared_tensors, stage_count, stored_names
from .stage import DistributedStage, forget_captured_default_group, release_groups
from .transport import DistributedError


class WorldSizeError(DistributedError):
    """The number of processes differs from the plan's number of stages."""


def load(path: str | os.PathLike, *, weights: Any = None, device: DeviceLike | None = None,
         timeout: float = 60.0, model: torch.nn.Module | None = None,
         functions: Sequence[Callable] = ()) -> "DistributedStage":
    """This process's stage of the plan saved at `path`, its weights only.

    The weights are the plan's own (its stage files), or with `weights` (a checkpoint,
    "init": see `fxpipe.load_plan`) those this stage holds, read from there straight to its
    device and nothing else (`model`, when given, is the structure `fxpipe.weights.Init`
    draws from, and gives the modules of the model's own classes a capture kept whole;
    `functions`, the functions kept whole with `torch.fx.wrap`: a plan holds no code, see
    `fxpipe.load_plan`). A stage whose planned memory exceeds its device's is refused before
    anything is read. A checkpoint without a tensor of this stage, or with another shape or
    dtype, is a `PlanFileError` naming the tensor and the file, and every other rank stops too,
    naming this rank and the error.

    The world is `replicas x stages` processes: rank r runs stage `r % stages` of replica
    `r // stages` (one process per stage is one replica). The stage runs on `device`; by default
    (see `rank_device`) a stage planned on a GPU runs on this process's own GPU, `cuda:LOCAL_RANK`
    under torchrun, and one planned on the CPU on the CPU. Joins the default process group,
    initialised here from torchrun's environment (env://, gloo) unless the caller did; `timeout`
    (seconds) bounds every wait for another rank. A rank that cannot load its stage makes every
    rank raise: itself its error, the others a `DistributedError` naming it. The stage's
    `close()` (leaving `with` does it) destroys the groups made here, and the default group
    if it was started here; a default group the caller started is the caller's to destroy.
    """
    forget_captured_default_group()
    made: list[Any] = []    # the groups made here, destroyed with the stage (release_groups)
    group, owned = _process_group(timeout, made)
    try:
        return _load(path, device, timeout, group, owned, weights, model, made, functions)
    except BaseException:
        release_groups(made, owned)
        raise


def rank_device(planned: torch.device, device: DeviceLike | None = None) -> DeviceLike:
    """Where this process runs a stage planned for `planned`: `device` when given; otherwise,
    for a stage planned on a GPU, this process's own GPU under torchrun (`cuda:LOCAL_RANK`: a
    plan's devices are those of the host it was planned on, and replicas on one host must not
    share a GPU), else `planned`. A CUDA device chosen becomes the current one
    (`torch.cuda.set_device`), so that what runs without naming a device runs there too."""
    if device is None:
        local = os.environ.get("LOCAL_RANK")
        device = torch.device(planned.type, int(local)) if (
            is_gpu(planned) and local is not None) else planned
    chosen = torch.device(device.name if isinstance(device, DeviceSpec) else device)
    if is_gpu(chosen) and chosen.index is not None:
        set_device(chosen)
    return device


def _load(path: str | os.PathLike, device: DeviceLike | None, timeout: float, group: Any,
          owned: bool, weights: Any, model: torch.nn.Module | None,
          made: list[Any], functions: Sequence[Callable] = ()) -> "DistributedStage":
    rank, world = dist.get_rank(), dist.get_world_size()
    stages = stage_count(path)
    if world % stages:
        raise WorldSizeError(
            f"the plan at {str(path)!r} has {stages} stages; {world} processes run it\n"
            f"rank {rank}: start a multiple of the stages, one process per stage and replica: "
            f"torchrun --nproc-per-node {stages} (or {2 * stages} for two replicas)")
    replica, index = divmod(rank, stages)
    loaded, error = None, None
    # Over NCCL (a default group the caller started with it) tensors travel between GPUs as
    # they are, headers over gloo (`group`); over gloo, both over `group`.
    nccl = dist.get_backend() == "nccl"
    try:
        here = rank_device(planned_device(path, index), device)
        if nccl and not is_gpu(torch.device(getattr(here, "name", here))):
            raise DistributedError(
                f"stage {index} is on {here}, but the process group is NCCL\n"
                f"rank {rank} runs it; NCCL carries CUDA tensors only: give every rank a GPU "
                f"(device='cuda:N'), or "
                f"start the process group with gloo")
        loaded = (load_stage_plan(path, index, device=here, weights=weights, model=model,
                                  functions=functions),
                  shared_tensors(path), stored_names(path))
    except Exception as e:
        error = e
    _agree_loaded(rank, error, group, timeout)
    pipeline, gradients = _replica_groups(world // stages, stages, replica, index, timeout, made)
    (plan, stage), shared, stored = loaded
    if rank == 0 and stages > 1 and plan.link != "gloo":
        warnings.warn(f"the plan at {str(path)!r} priced the values its stages exchange as "
                      f"{LINK_DESCRIPTIONS[plan.link]}, not as messages between processes, so it "
                      f"balanced and predicted with transfers too cheap: plan with "
                      f"fxpipe.plan(..., link='gloo') for a run under torchrun", stacklevel=3)
    tied = _tied_groups(_tied_parameters(plan, shared), stage, stages, world // stages,
                        replica, timeout, made)
    return DistributedStage(plan, stage, rank, group, timeout, owned, replica=replica,
                            replicas=world // stages, pipeline_group=pipeline,
                            gradient_group=gradients, tied=tied,
                            tensor_group=dist.group.WORLD if nccl else None,
                            stored_names=stored, made_groups=made)


def _agree_loaded(rank: int, error: BaseException | None, group: Any, timeout: float) -> None:
    """Raise `error` here, and on every other rank a `DistributedError` naming the first rank
    that could not load its stage, so that no rank waits for a stage that never started."""
    states: list[Any] = [None] * dist.get_world_size()
    note = None if error is None else f"{type(error).__name__}: {error}"
    try:
        dist.all_gather_object(states, note, group=group)
    except RuntimeError as e:
        raise DistributedError(f"rank {rank} did not hear from every rank within {timeout:g} s of "
                               f"loading\n{e}\nsee the other ranks' output") from None
    if error is not None:
        raise error
    failed = [(r, n) for r, n in enumerate(states) if n is not None]
    if failed:
        raise DistributedError(f"rank {failed[0][0]} could not load its stage, so rank {rank} "
                               f"stops too\n{failed[0][1]}\nfix the plan files and start every "
                               f"rank again")


def _replica_groups(replicas: int, stages: int, replica: int, index: int,
                    timeout: float, made: list[Any]) -> tuple[Any, Any]:
    """This rank's pipeline group (its replica's ranks) and gradient group (its stage's
    replicas); None for both with one replica. Every rank creates every group, in one order,
    as `dist.new_group` requires (each added to `made`)."""
    if replicas == 1:
        return None, None
    wait = datetime.timedelta(seconds=timeout)
    pipelines = [dist.new_group(list(range(k * stages, (k + 1) * stages)), timeout=wait,
                                backend="gloo") for k in range(replicas)]
    gradients = [dist.new_group([k * stages + i for k in range(replicas)], timeout=wait,
                                backend="gloo") for i in range(stages)]
    made.extend([*pipelines, *gradients])
    return pipelines[replica], gradients[index]


def _tied_parameters(plan: Any, shared: dict[tuple[int, str], dict[int, str]]
                     ) -> dict[tuple[int, ...], list[dict[int, str]]]:
    """The parameters needing a gradient that several stages hold (tied weights), by the
    stages holding them: each one's name in each of those stages. Read off the saved plan's
    `shared` entries (`saved.shared_tensors`), the same on every rank; buffers are left out."""
    tied: dict[tuple[int, ...], list[dict[int, str]]] = {}
    for (first, name), held in sorted(shared.items()):
        try:       # the plan's skeleton tells parameters from buffers, on any rank
            parameter = plan.stages[first].module.get_parameter(name)
        except AttributeError:
            continue
        if parameter.requires_grad:
            tied.setdefault(tuple(sorted(held)), []).append(held)
    return tied


def _tied_groups(tied: dict[tuple[int, ...], list[dict[int, str]]], stage: Any, stages: int,
                 replicas: int, replica: int, timeout: float, made: list[Any]
                 ) -> list[tuple[Any, list[torch.nn.Parameter]]]:
    """For each set of stages sharing parameters, in one order on every rank, a gloo group of
    the ranks holding them in each replica (`dist.new_group` is collective, each added to
    `made`); this rank's groups with its parameters in each, in that order."""
    wait = datetime.timedelta(seconds=timeout)
    mine = []
    for holders, parameters in sorted(tied.items()):
        for k in range(replicas):
            group = dist.new_group([k * stages + s for s in holders],
                                   timeout=wait, backend="gloo")
            made.append(group)
            if k == replica and stage.index in holders:
                mine.append((group, [stage.module.get_parameter(held[stage.index])
                                     for held in parameters]))
    return mine


def _process_group(timeout: float, made: list[Any]) -> tuple[Any, bool]:
    """The group messages travel in, and whether this call initialised the default one.

    The default group when it is gloo; a gloo group of every rank beside another backend
    (added to `made`)."""
    if not dist.is_available():
        raise DistributedError("this torch has no torch.distributed\ninstall a build with it")
    wait = datetime.timedelta(seconds=timeout)
    if dist.is_initialized():
        if dist.get_backend() == "gloo":
            return None, False
        made.append(dist.new_group(backend="gloo", timeout=wait))
        return made[-1], False
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
               if v not in os.environ]
    if missing:
        raise DistributedError(
            f"no process group, and {', '.join(missing)} not set\nstart the script with "
            f"torchrun --nproc-per-node <stages> script.py, or call "
            f"torch.distributed.init_process_group first")
    dist.init_process_group("gloo", init_method="env://", timeout=wait)
    return None, True

