"""The options of `fxpipe.compile` and `fxpipe.plan`, checked once into one frozen value.

`Options(devices, chunks=..., ...)` takes what compile takes (see its docstring for what each
option means) and refuses a bad value as it is made, with the `FxpipeError` subclass naming the
option and a fix; a value that exists is valid, so planning reads fields, never checks them
again. The command line (`fxpipe plan`) passes the same options by the same names, its choices
read off the Literal types here. `input_dims` checks the one option that needs the example,
`batch_dims`, against it (the inputs it names), and `placeholder_dims` carries it to the graph.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.cost_model import OPTIMIZER_STATE, DeviceSpec, LinkFn
from fxpipe.passes.errors import (BatchError, CostError, DeviceError, InputError,
                                  PartitionError, ScheduleError, VerificationError)
from fxpipe.passes.signature import Signature
from fxpipe.passes.capture import CaptureMode

from ..runtime.devices import parse_devices
from ..plans.plan_data import Plan
from ..runtime.schedules import SCHEDULES, ScheduleName
from ..weights import Weights

Auto = Literal["auto"]
Recompute = Literal["never", "always", "auto"]
LinkName = Literal["default", "measure", "gloo"]
BatchDims = int | Mapping[str | int, int | None]


@dataclass(frozen=True)
class Options:
    """Every option of compile and plan, checked (see the module docstring). `devices` is
    given as compile takes it (names, torch.devices or DeviceSpecs) and kept as DeviceSpecs."""

    devices: tuple[DeviceSpec, ...]
    chunks: int | Auto | None = None
    capture: CaptureMode = "auto"
    leaf_modules: tuple[str | type, ...] = ()
    concrete_args: Mapping[str, Any] | None = None
    num_stages: int | Auto | None = None
    schedule: ScheduleName | Auto = "gpipe"
    training: bool | None = None
    threads_per_stage: int | None = None
    link: LinkFn | LinkName = "default"
    repeats: int = 5
    reuse_blocks: bool = True
    batch_dims: BatchDims = 0
    verify: bool = True
    verify_tolerance: float | None = None
    costs: Plan | None = field(default=None, repr=False)
    progress: bool | None = None
    recompute: Recompute = "never"
    optimizer: str | float | type | torch.optim.Optimizer = "adam"
    weights: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(parse_devices(self.devices)))
        object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))
        chunks, threads, repeats = self.chunks, self.threads_per_stage, self.repeats
        if chunks not in ("auto", None) and not _count(chunks):
            raise BatchError(f"chunks={chunks!r}: the number of micro-batches must be an int "
                             f">= 1 or 'auto'\n'auto' lets the plan choose; None (the default) "
                             f"takes 2 per stage")
        if self.schedule != "auto" and self.schedule not in SCHEDULES:
            raise ScheduleError(f"unknown schedule {self.schedule!r}\nuse one of "
                                f"{', '.join(SCHEDULES)}, or 'auto' to let the plan choose")
        if threads is not None and not _count(threads):
            raise DeviceError(f"threads_per_stage={threads!r} is not a number of threads >= 1\n"
                              f"use a number of intra-op threads >= 1 for each CPU stage, or "
                              f"None to share the cores evenly")
        if not _count(repeats):
            raise CostError(f"repeats={repeats!r}: must be a number of timed runs >= 1 per node")
        if not isinstance(self.reuse_blocks, bool):
            raise CostError(f"reuse_blocks={self.reuse_blocks!r} is not True or False\n"
                            f"use True (a block repeating another takes its measured costs) or "
                            f"False (every node measured)")
        tolerance = self.verify_tolerance
        if tolerance is not None and not (isinstance(tolerance, (int, float))
                                          and 0 <= tolerance < math.inf):
            raise VerificationError(f"verify_tolerance={tolerance!r} is not a tolerance >= 0\n"
                                    f"use a relative tolerance >= 0, e.g. 1e-4, or verify=False "
                                    f"to skip the check")
        if self.recompute not in ("never", "always", "auto"):
            raise CostError(f"recompute={self.recompute!r} is not 'never', 'always' or 'auto'\n"
                            f"use 'never' (keep activations for the backward), 'always' (keep "
                            f"each stage's inputs, recompute the rest) or 'auto' (recompute "
                            f"where a stage would not fit otherwise)")
        optimizer_state_factor(self.optimizer)
        if self.costs is not None and not (isinstance(self.costs, Plan)
                                           and self.costs.record.measurements):
            raise CostError(f"costs={type(self.costs).__name__} is not a plan of this fxpipe\n"
                            f"pass a plan made by this version of fxpipe (pipe.plan, "
                            f"fxpipe.plan(...) or fxpipe.load_plan(path)), "
                            f"whose measured costs are reused")
        if self.link not in ("default", "measure", "gloo") and (
                isinstance(self.link, str) or not callable(self.link)):
            raise CostError(f"link={self.link!r} is not a link the cost model knows\n"
                            f"use 'default', 'measure', 'gloo' or a (src, dst) -> Link function")
        weights = self.weights
        if weights is not None and not isinstance(weights, (str, os.PathLike, Mapping, Weights)):
            raise InputError(f"weights={type(weights).__name__} is not where weights come from\n"
                             f"for a model built on the meta device, pass where its values come "
                             f"from: a checkpoint path (a "
                             f".safetensors file, a Hugging Face directory, a .pt state_dict), a "
                             f"state_dict, \"init\" or a fxpipe.weights.Weights, or None for the "
                             f"values the model initialises")
        stages = self.num_stages
        if stages is not None and stages != "auto" and (
                not isinstance(stages, int) or not 1 <= stages <= len(self.devices)):
            raise PartitionError(f"num_stages={stages!r} is not 'auto' or from 1 to "
                                 f"{len(self.devices)}\nuse 'auto' or a number from 1 to the "
                                 f"{len(self.devices)} devices given")

    @property
    def optimizer_state(self) -> float:
        """The optimizer state a training stage holds, in bytes per parameter byte."""
        return optimizer_state_factor(self.optimizer)

    @property
    def link_name(self) -> str:
        """What the plan says transfers were priced as (`Plan.link`)."""
        return self.link if isinstance(self.link, str) else "yours"

    @property
    def stages_asked(self) -> int:
        """The stages the graph must be fine enough for: those asked, or one per device."""
        return self.num_stages if isinstance(self.num_stages, int) else len(self.devices)


def input_dims(model: nn.Module, args: tuple, kwargs: Mapping[str, Any],
               batch_dims: BatchDims) -> tuple[tuple, dict]:
    """`batch_dims` as one dimension per input: a pytree prefix of `(args, kwargs)`."""
    names = _positional_names(model, len(args))
    if isinstance(batch_dims, int) and not isinstance(batch_dims, bool):
        by_name: dict[str, int | None] = {}
        default = batch_dims
    elif isinstance(batch_dims, Mapping):
        default, by_name = 0, {}
        for key, dim in batch_dims.items():
            if isinstance(key, int) and 0 <= key < len(args):
                key = names[key] if names[key] is not None else key
            elif key not in kwargs and key not in names:
                raise BatchError(f"batch_dims names {key!r}, which is not an input of the example"
                                 f"\nits inputs: positional 0..{len(args) - 1}: {names}; keyword: "
                                 f"{sorted(kwargs)}\nname an input or give its position")
            if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool)):
                raise BatchError(f"batch_dims[{key!r}]={dim!r}: must be a dimension (an int) or "
                                 f"None")
            by_name[key] = dim
    else:
        raise BatchError(f"batch_dims={batch_dims!r} is not an int or a dict\n"
                         f"use an int (the batch dimension of every input) or a dict from "
                         f"input name or position to its batch dimension")
    positional = tuple(by_name.get(n if n is not None else i, default)
                       for i, n in enumerate(names))
    return positional, {k: by_name.get(k, default) for k in kwargs}


def _positional_names(model: nn.Module, count: int) -> list[str | None]:
    """The forward parameter each of `count` positional inputs binds to (None: past `*args`)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return [None] * count
    named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [named[i] if i < len(named) else None for i in range(count)]


def placeholder_dims(signature: Signature, input_dims: tuple[tuple, dict],
                     default: int) -> dict[str, Any]:
    """The batch dimension of each graph placeholder, from the model inputs' ones."""
    positional, keyword = input_dims
    if signature.in_spec is None:          # fx: one placeholder per forward parameter
        names = list(signature.names)
        by_name = dict(keyword)
        for name, dim in zip(names, positional):
            if name == signature.var_positional:
                break
            by_name[name] = dim
        return {p: by_name.get(n, default) for p, n in zip(signature.placeholders, names)}
    # export: one placeholder per leaf of (args, kwargs), in in_spec's order
    tree = pytree.tree_unflatten(list(range(signature.in_spec.num_leaves)), signature.in_spec)
    dims: dict[int, Any] = {}
    for i, value in enumerate(tree[0]):
        for leaf in pytree.tree_leaves(value):
            dims[leaf] = positional[i] if i < len(positional) else default
    for name, value in tree[1].items():
        for leaf in pytree.tree_leaves(value):
            dims[leaf] = keyword.get(name, default)
    return {p: dims.get(i, default) for i, p in enumerate(signature.placeholders)}


def _count(value: Any) -> bool:
    """Whether `value` is an int >= 1 (a bool is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def optimizer_state_factor(optimizer: str | float | type) -> float:
    """The optimizer state a training stage holds, in bytes per parameter byte: a name from
    `cost_model.OPTIMIZER_STATE`, a `torch.optim` class of one, or the number itself."""
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool) and optimizer >= 0:
        return float(optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        return _state_of(optimizer)
    name = optimizer.__name__ if isinstance(optimizer, type) else optimizer
    if isinstance(name, str) and name.lower() in OPTIMIZER_STATE:
        return OPTIMIZER_STATE[name.lower()]
    raise CostError(f"optimizer={optimizer!r} is not an optimizer the cost model knows\n"
                    f"use one of {', '.join(OPTIMIZER_STATE)} (or its torch.optim class), or "
                    f"the bytes of optimizer state per parameter "
                    f"byte as a number (Adam keeps 2.0, SGD 0.0)")


def _state_of(optimizer: torch.optim.Optimizer) -> float:
    """The state an optimizer instance keeps, in bytes per parameter byte, read off its settings
    (SGD's momentum, Adam's amsgrad, RMSprop's momentum and centred average), or, for another
    kind, off the state it holds already (after a step)."""
    kind, group = type(optimizer), optimizer.param_groups[0] if optimizer.param_groups else {}
    momentum = float(bool(group.get("momentum", 0)))
    if issubclass(kind, torch.optim.SGD):
        return momentum
    if issubclass(kind, (torch.optim.Adam, torch.optim.AdamW)):
        return 2.0 + bool(group.get("amsgrad", False))
    if issubclass(kind, torch.optim.RMSprop):
        return 1.0 + momentum + bool(group.get("centered", False))
    if issubclass(kind, torch.optim.Adagrad):
        return 1.0
    params = [p for g in optimizer.param_groups for p in g["params"]]
    held = sum(t.numel() * t.element_size() for p in params
               for t in optimizer.state.get(p, {}).values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)
    if held:
        return held / max(1, sum(p.numel() * p.element_size() for p in params))
    return optimizer_state_factor(kind)
