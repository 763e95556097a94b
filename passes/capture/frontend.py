"""The protocol every front-end follows, what it is given and what it returns, and the check it
shares: whether a graph reproduces the model on the example.

A front-end (`FrontEnd`) takes the model and a `Request` and returns a `Captured` (the graph,
with its `Signature` in `gm.meta["signature"]`, and how it was captured), or raises
`CaptureFailed` with the reason, which names the user's line where there is one. `choose` reads
the result: it records a `Capture` on the graph, with its `Method`.

`Request` holds what a front-end is given: the example, the leaves, the fixed inputs, the hooked
modules, the batch dims and the device type. `Method` (FX, FX_LEAVES, EXPORT) is a str enum whose
value, "fx", "fx+leaves", "export", plans print and save; a plan pickled with the string loads as
the member. `Capture` is the record on the graph; `mismatch` is the check every front-end makes on
the example.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from ..compare import difference
from ..device import forked_generators
from ..errors import FxpipeError
from ..state import unchanged_state
from ..user_code import describe_frame, user_frame


class Method(str, enum.Enum):
    """The front-end that captured a graph. Its value is the name plans print and save
    (plan.json's `capture.method`); a plan saved with the name alone loads as the member."""

    FX = "fx"
    FX_LEAVES = "fx+leaves"
    EXPORT = "export"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Capture:
    """How a graph was captured: the front-end that succeeded, leaf modules, and earlier failures.

    `leaves` names the submodules kept whole: those given, those with hooks, and (fx+leaves)
    those whose forward broke tracing.

    `training` is the mode an export graph was captured in (its dropout and BatchNorm stay so);
    None for fx graphs, whose modules follow `.train()` and `.eval()`.

    `reason` says why this front-end and not an earlier one: their failures, or an fx graph too
    coarse to balance the stages asked (see `fxpipe.passes.capture.trace`); the plan prints it.

    `uncached` is True when the model was captured with `use_cache=False` (see `without_cache`).

    `fake` is the device type of the fake tensors a model on meta was exported on, where meta
    alone failed or hid an autocast region (see `fxpipe.passes.capture.export`); None otherwise.
    """

    method: Method
    leaves: tuple[str, ...] = ()
    failures: tuple[str, ...] = field(default=(), compare=False)
    training: bool | None = None
    reason: str = field(default="", compare=False)
    uncached: bool = False
    fake: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method(self.method))

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled: a plan saved before `Method` holds the method's name."""
        self.__dict__.update(state, method=Method(state["method"]))

    def __str__(self) -> str:
        text = str(self.method)
        if self.training is not None:
            text += f" in {'train' if self.training else 'eval'} mode"
        if self.uncached:
            text += " without the key/value cache (use_cache=False)"
        if self.fake:
            text += f" on fake {self.fake} tensors"
        if self.leaves:
            text += f" (kept whole: {', '.join(self.leaves)})"
        if self.reason:
            text += " because " + self.reason
        return text


@dataclass(frozen=True)
class Request:
    """What a front-end is asked to capture, beyond the model.

    `args` and `kwargs` are the example (`kwargs` with `use_cache=False` where forward takes
    it: see `without_cache`); `leaves` the modules fx keeps whole (qualified names or classes:
    those given, then those with hooks), `concrete` the inputs fx fixes to values (those given,
    the defaults of those the example leaves out, and `use_cache`); `hooked` the submodules
    with hooks, each with its first hook's kind (export refuses them); `batch_dims` the
    dimensions export leaves free, and `device_type` the kind of device the graph will run on
    (None: the example inputs').
    """

    args: tuple
    kwargs: Mapping[str, Any]
    leaves: tuple[str | type, ...] = ()
    concrete: Mapping[str, Any] = field(default_factory=dict)
    hooked: Mapping[str, str] = field(default_factory=dict)
    batch_dims: Any = 0
    device_type: str | None = None

    @property
    def uncached(self) -> bool:
        """Whether the model is captured with `use_cache=False`."""
        return self.kwargs.get("use_cache") is False

    @property
    def example(self) -> tuple[tuple, Mapping[str, Any]]:
        return self.args, self.kwargs

    @property
    def fx_kwargs(self) -> dict[str, Any]:
        """The keyword inputs fx takes: `use_cache`, which forward branches on, is fixed."""
        return {k: v for k, v in self.kwargs.items() if not (k == "use_cache" and self.uncached)}

    @property
    def named_leaves(self) -> tuple[str, ...]:
        return tuple(l for l in self.leaves if isinstance(l, str))


@dataclass(frozen=True)
class Captured:
    """A front-end's graph, its calling convention in `gm.meta["signature"]`, and how it was
    captured: the modules kept whole, by name; the mode baked into its ops (export; None where
    the modules follow `.train()` and `.eval()`); the device type of the fake tensors it was
    exported on (None: none)."""

    gm: fx.GraphModule
    leaves: tuple[str, ...] = ()
    training: bool | None = None
    fake: str | None = None


class CaptureFailed(Exception):
    """A front-end could not capture the model faithfully. `reason` says why (with the user's
    line where there is one); `culprit` is the qualified name of the innermost submodule whose
    forward was running (a module fx+leaves can keep whole); `fix` is what to do, where it is
    not the front-end's own fix."""

    def __init__(self, reason: str, culprit: str | None = None, fix: str | None = None):
        super().__init__(reason)
        self.reason, self.culprit, self.fix = reason, culprit, fix

    @classmethod
    def of(cls, error: BaseException, model: nn.Module) -> "CaptureFailed":
        """The failure `error`, raised while capturing `model`, stands for."""
        return cls(describe(error, model), _culprit(error, model))


class FrontEnd(Protocol):
    """One way of capturing a model: `method` names it in the record, `label` in failures
    (`torch.fx: ...`), followed by `fix` unless the failure brings its own."""

    method: Method
    label: str
    fix: str

    def capture(self, model: nn.Module, request: Request) -> Captured:
        """`model` as a graph that reproduces it on `request`'s example; raises `CaptureFailed`."""
        ...


def describe(error: BaseException, model: nn.Module) -> str:
    """`error`'s type and first line, the user's line it came from and the module running."""
    message = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    if isinstance(error, FxpipeError):        # fxpipe's own: its fix, on the lines below, too
        message += "".join(f"\n      {line.strip()}" for line in str(error).strip().splitlines()[1:]
                           if line.strip())
    frame = user_frame(error)
    if frame is not None:
        message += "\n" + describe_frame(frame, "      ", one_line=True)
    culprit = _culprit(error, model)
    if culprit:
        message += f"\n      in module {culprit!r} ({type(model.get_submodule(culprit)).__name__})"
    return message


def _culprit(error: BaseException, model: nn.Module) -> str | None:
    """The qualified name of the innermost submodule whose forward was running when tracing broke."""
    names = {id(m): name for name, m in model.named_modules()}
    culprit = None
    tb = error.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_locals.get("self")
        if isinstance(module, nn.Module) and names.get(id(module)):
            culprit = names[id(module)]
        tb = tb.tb_next
    return culprit


def mismatch(model: nn.Module, gm: fx.GraphModule, args: tuple,
             kwargs: Mapping[str, Any]) -> tuple[str, pytree.TreeSpec | None]:
    """Why `gm` does not reproduce `model` on the example ("" when it does), and the structure
    of the model's output, which the signature keeps so that the pipeline returns the model's
    own containers (an `OrderedDict`, where fx's graph returns a `dict`).

    Each runs on its own copy of the example (a forward may write its inputs in place), from the
    same random state, and buffers (e.g. BatchNorm statistics) are restored afterwards, so
    checking leaves the model and the caller's tensors as they were. Outputs compare as in
    `fxpipe.passes.compare`.
    """
    given = copied((args, kwargs))
    # `manual_seed` seeds every GPU's generator too: each one there is is forked.
    try:
        with torch.no_grad(), forked_generators():
            with unchanged_state(model):
                torch.manual_seed(0)
                expected = model(*given[0], **given[1])
            with unchanged_state(model):
                torch.manual_seed(0)
                actual = gm(*copied(args), **copied(kwargs))
    except Exception as e:
        return f"running the graph raised {type(e).__name__}: {e}", None
    gm.meta["input_writes"] = _written_inputs(model, (args, kwargs), given)
    return difference(actual, expected, tolerance=None), pytree.tree_structure(expected)


def copied(value: Any) -> Any:
    """`value` with every tensor in it cloned."""
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num())


def _written_inputs(model: nn.Module, inputs: tuple, ran_on: tuple) -> tuple[str, ...]:
    """The inputs whose copies the model's forward changed (`x += 1`, `x.mul_(2)`), by name:
    `fxpipe.passes.functionalize` refuses them (a graph may not show the write: fx records `x += 1`
    on a tensor as an add)."""
    try:
        names = inspect.signature(model.forward).bind(*inputs[0], **inputs[1]).arguments
        ran = inspect.signature(model.forward).bind(*ran_on[0], **ran_on[1]).arguments
    except (TypeError, ValueError):
        names, ran = dict(enumerate([*inputs[0], *inputs[1].values()])), dict(
            enumerate([*ran_on[0], *ran_on[1].values()]))
    return tuple(str(name) for name, value in names.items()
                 if any(isinstance(before, torch.Tensor) and not _same(before, after)
                        for before, after in zip(pytree.tree_leaves(value),
                                                 pytree.tree_leaves(ran[name]))))
