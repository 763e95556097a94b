"""Python a pipeline would not run: attribute changes forward makes, and hooks.

A pipeline runs the model's tensor operations only. Each front-end runs on a snapshot of every
module's plain attributes, restored afterwards (`without_side_effects`), and a forward that
filled a list, dict or set, or stored a number or a tensor, is refused by name where a second
run on the example does it again (`_unsettled`); what forward fills on first use and then keeps
(a cache, a setting) is only undone.

A submodule with a hook (forward, forward pre-, backward, backward pre-) stays whole under fx,
so its hook runs each time a stage calls it; export runs hooks once, at capture, so it refuses
them. Hugging Face's output-recording hooks do not count (`_records_outputs`): what they record
is the model's output, and the capture records it so. A hook on the model itself is refused.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import traceback
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from ..compare import equal
from ..errors import TraceError
from ..state import unchanged_state
from ..user_code import describe_frame
from .frontend import copied

_HOOKS = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
          "_backward_pre_hooks": "backward pre-hook", "_backward_hooks": "backward hook"}


def hooked_modules(model: nn.Module) -> dict[str, str]:
    """The submodules with hooks, by qualified name, each with the kind of its first hook.

    A hook on the model itself would never run (the pipeline runs the graph in stages, never
    the model), so it is refused: the pipeline, an nn.Module, takes forward hooks itself.
    Output-recording hooks (`_records_outputs`) do not count.
    """
    hooked = {}
    for name, module in model.named_modules():
        kind = hook_kind(module)
        if kind and not name:
            raise TraceError(
                f"the model ({type(model).__name__}) has a {kind}, which a pipeline never runs\n"
                f"it runs the model's graph in stages and never calls the model\n"
                f"    Fix: register the hook on the pipeline (pipe.register_forward_hook(...), as "
                f"on the model), or on a submodule, which fxpipe keeps whole so that its hooks run")
        if kind:
            hooked[name] = kind
    return hooked


def hook_kind(module: nn.Module) -> str | None:
    """The kind of `module`'s first hook ("forward hook", ...), or None where it has none but
    output-recording ones (`_records_outputs`)."""
    return next((kind for attr, kind in _HOOKS.items()
                 if not all(map(_records_outputs, getattr(module, attr, {}).values()))), None)


def _records_outputs(hook: Any) -> bool:
    """Whether `hook` is Hugging Face's output-recording forward hook. transformers installs one
    on each module at the first call asking for hidden states or attentions; it only appends
    the module's output to the collector of the model call under way (inactive otherwise),
    which the model's forward returns. A capture runs it with the model: what it recorded
    becomes the graph's outputs, as the model returns them."""
    return (getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
            and getattr(hook, "__name__", None) == "output_capturing_hook")


_STATE = ("_parameters", "_buffers", "_modules")


def _snapshot(model: nn.Module) -> list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]:
    """Every module's plain attributes (not parameters, buffers, submodules), and the contents
    of the lists, dicts and sets among them, as objects: what a forward's Python could change.
    The contents are kept in plain containers (a module's dozen hook dicts each copied by
    `copy.copy` made this cost several times a small model's run)."""
    return [(m, {k: v for k, v in vars(m).items() if k not in _STATE},
             {k: _contents(v) for k, v in vars(m).items()
              if k not in _STATE and isinstance(v, (list, dict, set))})
            for m in model.modules()]


def _contents(container: list | dict | set) -> list | dict | set:
    """What `container` holds, in a new plain list, dict or set."""
    if isinstance(container, list):
        return list(container)
    return dict(container) if isinstance(container, dict) else set(container)


def _restore_attributes(snapshot) -> list[tuple[nn.Module, str, Any]]:
    """Put every attribute of `snapshot` back as it was; the (module, name, value it had, or
    the changed container) of each that changed."""
    changed = []
    for module, values, contents in snapshot:
        attrs = vars(module)
        for name in [k for k in attrs if k not in _STATE and k not in values]:
            changed.append((module, name, attrs.pop(name)))
        for name, value in values.items():
            if attrs.get(name) is not value:
                changed.append((module, name, attrs.get(name)))
                attrs[name] = value
            if name in contents and not _same_contents(value, contents[name]):
                changed.append((module, name, list(value)))
                if isinstance(value, list):
                    value[:] = contents[name]
                else:
                    value.clear()
                    value.update(contents[name])
    return changed


def _same_contents(now: Any, before: Any) -> bool:
    if isinstance(now, dict):
        return now.keys() == before.keys() and all(now[k] is before[k] for k in now)
    if isinstance(now, set):
        return now == before
    return len(now) == len(before) and all(a is b for a, b in zip(now, before))


@contextlib.contextmanager
def attributes_restored(model: nn.Module):
    """Undo, on exit, every change to the plain attributes of `model`'s modules (see `_snapshot`):
    for any run of the model on an example, so that compiling leaves the model as it was."""
    snapshot = _snapshot(model)
    try:
        yield
    finally:
        _restore_attributes(snapshot)


def without_side_effects(model: nn.Module, example: tuple[tuple, Mapping[str, Any]],
                          front_end, *args):
    """`front_end(*args)`, leaving `model`'s attributes as they were.

    A TraceError names the first public attribute that forward filled (a list, dict or set), or
    set to a tensor (or a tracer's stand-in for one) or a number, and that a second run on the
    `example` (args, kwargs) changes again (see `_unsettled`): what a pipeline would not do per
    call (`self.seen.append(x)`, `self.calls += 1`). Other changes are only undone: private
    attributes, and what forward fills on first use and then keeps, a cache or a setting (a
    dict of tensors filled once per device, a size computed from the input's).
    """
    snapshot = _snapshot(model)
    try:
        return front_end(*args)
    finally:
        changed = [(m, name) for m, name, value in _restore_attributes(snapshot)
                   if not name.startswith("_") and _per_call(value)]
        changed = _unsettled(model, example, changed)
        if changed:
            raise _side_effect_error(model, *changed[0])


def _unsettled(model: nn.Module, example: tuple[tuple, Mapping[str, Any]],
               changed: list[tuple[nn.Module, str]]) -> list[tuple[nn.Module, str]]:
    """Those of the `changed` (module, attribute name) that forward changes on every call: run
    eagerly on the example twice, the second run leaves them other than the first left them
    (a list grown, a number counted on, a new tensor stored), or the model cannot run so.
    Without an example, all of them. Everything is restored afterwards."""
    args, kwargs = example
    if not changed or not (args or kwargs):
        return changed
    snapshot = _snapshot(model)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), unchanged_state(model):
            model(*copied(args), **copied(kwargs))
            first = [_held(module, name) for module, name in changed]
            model(*copied(args), **copied(kwargs))
            return [c for c, before in zip(changed, first) if not _settled(before, _held(*c))]
    except Exception:  # the model's own failure is reported by the front-ends
        return changed
    finally:
        _restore_attributes(snapshot)


def _held(module: nn.Module, name: str) -> tuple[Any, Any]:
    """An attribute's value (None when absent), and a copy of its contents if a container."""
    value = vars(module).get(name)
    return value, _contents(value) if isinstance(value, (list, dict, set)) else None


def _settled(before: tuple[Any, Any], now: tuple[Any, Any]) -> bool:
    """Whether an attribute holds what it held (`_held`): the same object with the same contents,
    or a new value equal to the old that holds no tensor (a size or setting computed again)."""
    (value, contents), (new, _) = before, now
    if new is value:
        return contents is None or _same_contents(new, contents)
    return not any(isinstance(v, (torch.Tensor, fx.Proxy)) for v in pytree.tree_leaves(new)) \
        and equal(new, value)


def _per_call(value: Any) -> bool:
    """Whether a changed attribute's value looks computed per call: a container forward filled
    (given as a list), a number, or anything holding a tensor or an fx Proxy."""
    if isinstance(value, list) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return True
    return any(isinstance(v, (torch.Tensor, fx.Proxy)) for v in pytree.tree_leaves(value))


def _side_effect_error(model: nn.Module, module: nn.Module, name: str) -> TraceError:
    path = next((p for p, m in model.named_modules() if m is module), "")
    where = f"module {path!r} ({type(module).__name__})" if path else type(module).__name__
    message = (f"forward changes {where}'s attribute {name!r}: a Python side effect\n"
               f"a pipeline would not reproduce it, since it runs the model's tensor operations "
               f"only")
    try:
        lines, start = inspect.getsourcelines(type(module).forward)
        file = inspect.getsourcefile(type(module).forward)
        found = next((i for i, line in enumerate(lines) if re.search(rf"\bself\.{name}\b", line)),
                     None)
        if found is not None:
            frame = traceback.FrameSummary(file, start + found, "forward", line=lines[found])
            message += "\n" + describe_frame(frame, "      ", one_line=True)
    except (OSError, TypeError):
        pass
    return TraceError(message + "\n    Fix: move it out of forward (do it with the pipeline's "
                      "inputs or outputs), or into a forward hook on a submodule, which fxpipe "
                      "keeps whole so that its hook runs on every micro-batch")


