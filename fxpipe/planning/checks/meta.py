"""A model built on the meta device, checked streamed, never held whole: its graph, node by node
on materialised weights, gives the output dims and the micro-batch check; the model's own
forward on a structural copy whose modules are given their own tensors just before they run
(`streamed`) gives the outputs the stages, each run node by node (`streamed_stages`), must
reproduce (`meta_reference`). Both read the same weights (`Recipe.materialize`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.codegen import placed_copy
from fxpipe.passes.errors import BatchError, FxpipeError
from fxpipe.passes.materialize import Materialize, release_freed_memory, run_graph
from fxpipe.passes.randomness import microbatch_seeds

from ...runtime import microbatch
from ...plans.plan_data import Plan
from ..reference import run_per_microbatch, unchanged
from .rounding import reduced_precision
from .runs import _GraphRun, _StageRun
from .verification import Reference, _output_dims, reference_of

if TYPE_CHECKING:
    from ..recipe import Recipe


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def streamed(model: nn.Module, materialize: Materialize, device: torch.device) -> nn.Module:
    """A structural copy of `model` that runs its own forward module by module: each module a
    shallow copy with its own tables (tensors, children, hooks), whose meta tensors are given
    real values on `device` by a forward pre-hook and put back to meta by a forward hook, so at
    most the running modules' own tensors are held. `model` is never changed. A forward that
    reads another module's tensor directly (a parent reading `self.child.weight`) meets a meta
    tensor and raises."""
    names: dict[int, str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), path)
    copies: dict[int, nn.Module] = {}

    def copy_of(module: nn.Module) -> nn.Module:
        if id(module) in copies:
            return copies[id(module)]
        copy = type(module).__new__(type(module))
        copy.__dict__.update(module.__dict__)
        copies[id(module)] = copy
        for table in ("_parameters", "_buffers", *_HOOK_TABLES):
            if table in module.__dict__:
                copy.__dict__[table] = type(module.__dict__[table])(module.__dict__[table])
        copy.__dict__["_modules"] = {name: None if child is None else copy_of(child)
                                     for name, child in module._modules.items()}
        own = {name: t for table in (copy._parameters, copy._buffers)
               for name, t in table.items() if t is not None and t.is_meta}
        if own:
            _stream_tensors(copy, own, names[id(module)], materialize, device)
        return copy
    return copy_of(model)


def _stream_tensors(module: nn.Module, own: dict[str, torch.Tensor], path: str,
                    materialize: Materialize, device: torch.device) -> None:
    """Hooks giving `module` (a copy) real values of its `own` meta tensors around its forward."""
    like = {f"{path}.{name}" if path else name: t for name, t in own.items()}

    def give(*_: Any) -> None:
        values = materialize(like, device)
        for (name, t), full in zip(own.items(), like):
            if name in module._parameters:
                module._parameters[name] = nn.Parameter(values[full],
                                                        requires_grad=t.requires_grad)
            else:
                module._buffers[name] = values[full]

    def take(*_: Any) -> None:
        for name, t in own.items():
            (module._parameters if name in module._parameters else module._buffers)[name] = t
        release_freed_memory()
    module.register_forward_pre_hook(give)
    module.register_forward_hook(take, always_call=True)


def meta_reference(model: nn.Module, gm: nn.Module, recipe: Recipe, chunks: int, verify: bool,
                   tolerance: float | None, device: torch.device) -> tuple[Reference, str]:
    """`reference_of` for a model on the meta device (see the module docstring), and why its
    outputs could not be checked ("" when they can be)."""
    materialize = recipe.materialize
    dims = _output_dims_on_meta(gm, recipe, chunks) if chunks > 1 and not verify else None
    # The graph's rounding is measured against the model's own forward in a wider dtype
    # (float32 for a reduced-precision model, float64 for a float32 one), module by module, on
    # the same plausible values: one module's tensors widened at a time.
    wide = torch.float32 if reduced_precision(model) is not None else torch.float64
    reference = Reference(dims) if dims is not None else reference_of(
        _GraphRun(gm, recipe.plausible, device,
                  lambda: streamed(model, _widened(recipe.plausible, wide), device)),
        recipe, chunks, verify, tolerance)
    if not reference.verify:
        return reference, ""
    copy = streamed(model, materialize, device)
    try:
        with unchanged(copy):
            torch.manual_seed(0)
            parts = run_per_microbatch(copy, recipe.args, recipe.kwargs, chunks,
                                       seeds=microbatch_seeds(chunks),
                                       batch_dims=recipe.input_dims)
    except FxpipeError:          # the weights' own (a tensor missing from a checkpoint)
        raise
    except Exception as e:       # the model's forward cannot run module by module
        return replace(reference, verify=False), (
            f"no (the model's forward cannot run one module at a time on materialised weights: "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})")
    return replace(reference, expected=microbatch.merge(parts, reference.output_dims)), ""


def _widened(materialize: Materialize, wide: torch.dtype) -> Materialize:
    """`materialize` giving its floating values narrower than `wide` in `wide`."""
    def read(like: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        return {name: value.to(wide) if value.is_floating_point() and
                torch.finfo(value.dtype).eps > torch.finfo(wide).eps else value
                for name, value in materialize(like, device).items()}
    return read


def _output_dims_on_meta(gm: nn.Module, recipe: Recipe, chunks: int
                         ) -> tuple[int | None, ...] | None:
    """Each output's batch dimension, as `reference_of` finds it, from the graph run on the
    meta device (shapes alone: no weight read, no op computed); None where that cannot tell:
    an op with no meta kernel, or naming another device, or an output whose shape does not
    follow the batch (a constant and a reduction differ in their values alone)."""
    args, kwargs, dims = recipe.args, recipe.kwargs, recipe.input_dims
    parts = microbatch.split((args, kwargs), chunks, dims)
    shapes = placed_copy(gm, "meta")         # its ops naming a device name meta

    def on_meta(batch: Any) -> Any:
        moved = pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v,
                                batch)
        return run_graph(shapes, *moved, None, "meta")
    try:
        whole, outputs = on_meta((args, kwargs)), [on_meta(part) for part in parts]
    except Exception:
        return None
    columns = zip(*(pytree.tree_leaves(o) for o in outputs))
    if not all(isinstance(w, torch.Tensor) and any(c.shape != w.shape for c in column)
               for w, column in zip(pytree.tree_leaves(whole), columns)):
        return None
    try:
        return tuple(_output_dims(whole, outputs, [microbatch.batch_size(p, dims) for p in parts],
                                  None))
    except BatchError:         # the run on values says it with the outputs' values
        return None


def streamed_stages(plan: Plan, materialize: Materialize) -> Plan:
    """`plan` with each stage run node by node on materialised weights, for `verify`."""
    return replace(plan, stages=tuple(
        replace(stage, module=_StageRun(stage.module, materialize, stage.device))
        for stage in plan.stages))
