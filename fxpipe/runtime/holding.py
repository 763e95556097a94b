"""What a pipeline holds under the model's names: one module gathering a loaded plan's stages'
tensors (`gathered`); a pipeline without the model it was planned from runs the mode it was
planned in only (`check_mode_without_model`). The values carried from one mode's stages to the
other's are `fxpipe.passes.codegen.carry_values`."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from fxpipe.passes.errors import ModelChangedError, PlanFileError
from fxpipe.passes.stage import Stage

# `Plan` in annotations is `fxpipe.plans.plan_data.Plan`, named, never imported: plans sit above
# the runtime (`tests/test_layers.py`).


def check_mode_without_model(plan: Plan, planned_mode: bool, mode: bool) -> None:
    """Refuse `train(mode)` for a pipeline that has no model to capture again (a loaded plan's):
    a graph torch.export captured fixes how its dropout and BatchNorm behave, and an fx graph may
    have read `self.training` in Python at capture, so only the mode planned in runs."""
    captured = plan.capture.training
    if captured is not None and captured != mode:
        have, want = ("train", "eval") if captured else ("eval", "train")
        raise ModelChangedError(
            f"this pipeline's graph was captured by torch.export in {have} mode\n"
            f"that fixes how its dropout and BatchNorm behave: compile the model after "
            f"model.{want}() to run it in {want} mode")
    if mode != planned_mode:
        have, want = ("train", "eval") if planned_mode else ("eval", "train")
        raise ModelChangedError(
            f"a plan made in {have} mode has no model to capture in {want} mode\n"
            f"this pipeline runs such a plan; plan the model after model.{want}() for "
            f"that (or compile it, which switches modes)")


def gathered(stages: Sequence[Stage]) -> nn.Module:
    """One module holding every stage's parameters and buffers under their own names (the
    model's: stages keep the names of what they hold), each once, non-persistent buffers
    (marked so in the stages) out of its `state_dict` as out of the model's."""
    root = nn.Module()
    for stage in stages:
        for table in ("_parameters", "_buffers"):
            for path, owner in stage.module.named_modules():
                for name, value in getattr(owner, table).items():
                    target = _module_at(root, path)
                    held = getattr(target, table).get(name)
                    if held is not None and held is not value:
                        raise PlanFileError(f"stages hold two different tensors named "
                                            f"{'.'.join(filter(None, (path, name)))!r}")
                    getattr(target, table)[name] = value
                    if name in owner._non_persistent_buffers_set:
                        target._non_persistent_buffers_set.add(name)
    root.train(all(stage.module.training for stage in stages))
    return root


def _module_at(root: nn.Module, path: str) -> nn.Module:
    """The submodule of `root` at the dotted `path`, made empty where missing."""
    module = root
    for part in filter(None, path.split(".")):
        if part not in module._modules:
            module._modules[part] = nn.Module()
        module = module._modules[part]
    return module
