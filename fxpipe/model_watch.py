"""Noticing that a compiled model changed in a way its pipeline cannot follow.

A Pipeline made by `fxpipe.compile` keeps its model weakly (`ModelWatch`) and, before each
call, step or stream, refuses to run with a `ModelChangedError` when a module, parameter or
buffer of the model was replaced since compile (a stage would still run the old one), or when
a module no stage calls got a hook (it would never fire). Both checks cost a comparison or two
in the common case, where nothing changed.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fxpipe.passes.capture import hook_kind
from fxpipe.passes.errors import ModelChangedError
from fxpipe.passes.stage import Stage


class ModelWatch:
    """The model compiled, held weakly, with what its names referred to at compile."""

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)
        self._parts = {name: weakref.ref(value) for name, value in _parts(model)}
        self._members = _members(model)
        self._uncalled: tuple[Any, list[tuple[str, nn.Module]]] = (None, [])
        self._hook_ids_seen = -1                    # see `hooks`

    @property
    def model(self) -> nn.Module | None:
        """The model, while it lives."""
        return self._model()

    def check(self, plan: Any) -> None:
        """Refuse to run `plan`'s stages when the model changed since compile (`replaced`,
        `hooks`)."""
        self.replaced(plan.stages)
        self.hooks(plan)

    def replaced(self, stages: Sequence[Stage]) -> None:
        """Refuse to run when a module, parameter or buffer of the model was replaced since
        compile and a stage still holds the old one: it would run the old model. (A stage that
        calls the model's own module, as fx graphs do, follows a parameter replaced in it.)"""
        model = self.model
        if model is None:
            return
        members = _members(model)
        if len(members) == len(self._members) and all(
                a is b for a, b in zip(members, self._members)):
            return      # nothing replaced: the common case, checked in a few microseconds
        for name, value in _parts(model):
            old = self._parts.get(name)
            if old is not None and old() is value:
                continue
            for stage in stages:
                held = _lookup(stage.module, name)
                if held is not None and held is not value:
                    raise ModelChangedError(
                        f"the model's {name!r} was replaced after compile\n"
                        f"the pipeline still runs the old one: compile the model again (to "
                        f"change weights in place instead, assign to .data or use "
                        f"load_state_dict)")

    def hooks(self, plan: Any) -> None:
        """Refuse to run when a module of the model that no stage of `plan` calls got a hook
        after compile: the model itself, or a module fx traced through (export, every module),
        whose operations the stages run without calling it, so the hook would never fire. Hooks
        on the modules stages call (kept whole: compile keeps a hooked module so) and on their
        submodules fire once per micro-batch.

        Registering any hook (on a module, a tensor, ...) takes an id from one counter,
        `RemovableHandle.next_id`: while it stands still there is nothing to look at, and the
        check costs one comparison; otherwise it reads the hook dicts of each uncalled module
        (output-recording hooks, which transformers installs at a first call, do not count)."""
        registered = RemovableHandle.next_id
        if registered == self._hook_ids_seen and self._uncalled[0] is plan:
            return
        model = self.model
        if model is None:
            return
        if self._uncalled[0] is not plan:     # a plan of its own per mode
            self._uncalled = (plan, _uncalled_modules(model, plan.stages))
        for name, module in self._uncalled[1]:
            kind = hook_kind(module)
            if kind is not None:
                raise ModelChangedError(_never_fires(model, name, module, kind))
        self._hook_ids_seen = registered


def _members(model: nn.Module) -> list[Any]:
    """Every module, parameter and buffer of `model`, in a fixed order (kept alive: a stage
    holds them anyway), to see at a glance whether any was replaced."""
    found, todo, seen = [], [model], {id(model)}
    while todo:
        module = todo.pop()
        for table in (module._modules, module._parameters, module._buffers):
            found.extend(table.values())
        for m in module._modules.values():
            if m is not None and id(m) not in seen:    # modules may be shared, or even cycle
                seen.add(id(m))
                todo.append(m)
    return found


def _uncalled_modules(model: nn.Module, stages: Sequence[Stage]) -> list[tuple[str, nn.Module]]:
    """The model's modules that no stage calls, by name: the model itself and those traced
    through. A stage holds the modules it calls, and they call their own submodules; a stage
    placed away from a module's tensors holds a shallow copy of it, which shares its hooks (so
    modules are known by their hook dicts)."""
    called = {id(m._forward_hooks) for stage in stages for m in stage.module.modules()}
    return [(name, m) for name, m in model.named_modules() if id(m._forward_hooks) not in called]


def _never_fires(model: nn.Module, name: str, module: nn.Module, kind: str) -> str:
    """Why a `kind` of hook registered after compile on `module` (at `name`, uncalled) never
    fires, and the fix."""
    if not name:
        return (f"the model ({type(model).__name__}) got a {kind} after compile\n"
                f"a pipeline never calls the model: it runs the model's graph in stages. Register "
                f"the hook on the pipeline instead (pipe.register_forward_hook(...), as on the "
                f"model)")
    return (f"module {name!r} ({type(module).__name__}) got a {kind} after compile\n"
            f"no stage calls that module: the stages run its operations, spread among them, so "
            f"the hook would never fire. Compile the model again with the hook registered: "
            f"fxpipe then keeps the module whole, and its hooks fire once per micro-batch")


def _parts(model: nn.Module) -> list[tuple[str, Any]]:
    return [*model.named_modules(), *model.named_parameters(), *model.named_buffers()]


def _lookup(model: nn.Module, name: str) -> Any:
    """The model's attribute at a dotted path (a module, parameter or buffer), or None."""
    value: Any = model
    for part in name.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value if isinstance(value, (nn.Module, torch.Tensor)) else None
