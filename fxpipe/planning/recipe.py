"""`Recipe`: what planning takes (the model, the example, the options checked once), with the
model's one capture per mode and, for a model on the meta device, where its values come from.
Planning's steps (`prepare`, `measure`, `checks`) read it; `build` conducts them on it. The
`link` option becomes a checked function here (`fxpipe.distributed.measure_link` for "gloo").
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.codegen import Placed
from fxpipe.passes.cost_model import DRIVER_DEVICE, DeviceSpec, Link, LinkFn, default_link
from fxpipe.passes.errors import CostError, DeviceError, InputError, TraceError
from fxpipe.passes.graph_values import tensors
from fxpipe.passes.materialize import Materialize, Tiled, blockless, holds_meta
from fxpipe.passes.capture import trace, with_tensor_defaults, without_cache

from ..runtime.devices import measure_links
from ..weights import Init, open_weights
from .options import Options, input_dims
from .progress import Progress
from .reference import copied


@dataclass(frozen=True)
class Recipe:
    """What planning takes: the model, the example and the options, checked once (`of`), and the
    one capture of each mode (`trace`); `fxpipe.planning.build.Planner` adds the way back to
    planning a pipeline keeps.

    The model and the example inputs are kept as given (the pipeline holds the model's
    parameters anyway; `fxpipe.compile(Net(), ...)` must still switch modes).
    """

    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    input_dims: tuple[tuple, dict]      # a batch dimension per input, a prefix of (args, kwargs)
    default_dim: int                    # that of inputs the example does not give
    options: Options
    link: LinkFn                        # options.link as a function, checked for the devices
    traced_code: dict[bool, str] = field(default_factory=dict)
    progress: Progress = field(default_factory=lambda: Progress(False))
    # The copies of the model's tensors placed on stage devices, shared by both modes' stages.
    placed: Placed = field(default_factory=dict)
    # Where the values of a model built on the meta device come from (a fxpipe.weights.Weights);
    # None for a model that holds its own.
    weights: Any = None
    # Each mode's model prepared to plan, by mode and the example's shapes (`prepare.prepare`).
    # (`prepare.PreparedKey` -> `prepare.Prepared`: prepare reads the recipe, so not imported here)
    prepared: dict = field(default_factory=dict, repr=False)

    @functools.cached_property
    def plausible(self) -> Materialize | None:
        """What runs that need plausible values only read (timing nodes, finding which values
        share memory, finding the outputs' batch dimensions): `materialize`, but where the
        values are drawn (`Init`, no checkpoint given), each parameter's are tiled from the
        first drawn for its role (`Tiled`), one object for every such run."""
        if not isinstance(self.weights, Init):
            return self.materialize
        return Tiled(self.materialize)

    @functools.cached_property
    def computed(self) -> Init | None:
        """What computes the tensors no checkpoint holds (non-persistent buffers: rotary
        `inv_freq`) as the model initialises them; None for a model that holds its own."""
        if self.weights is None:
            return None
        return self.weights if isinstance(self.weights, Init) else \
            Init(self.model, seed=0, stand_ins=True)

    @property
    def materialize(self) -> Materialize | None:
        """The model's tensors read from `weights` by the model's first name for each (a tied
        tensor is read once, whichever module asks), for `fxpipe.passes.materialize`; None for
        a model that holds its own values. What no checkpoint holds (non-persistent buffers:
        rotary `inv_freq`) is computed as the model initialises it (`Init`)."""
        if self.weights is None:
            return None
        first: dict[int, str] = {}
        for name, t in [*self.model.named_parameters(remove_duplicate=False),
                        *self.model.named_buffers(remove_duplicate=False)]:
            first.setdefault(id(t), name)
        stored = set(self.model.state_dict(keep_vars=True))
        weights, computed = self.weights, self.computed

        def read(like: Mapping[str, torch.Tensor], device: torch.device
                 ) -> dict[str, torch.Tensor]:
            asked = {first.get(id(t), name): t for name, t in like.items()}
            values = {}
            for source, names in ((weights, [n for n in asked if n in stored]),
                                  (computed, [n for n in asked if n not in stored])):
                if names:
                    values.update(source.read({n: asked[n] for n in names}, device))
            return {name: values[first.get(id(t), name)] for name, t in like.items()}
        return read

    def stand_ins(self) -> tuple[str, ...]:
        """The model's meta tensors (by its first name for each) timed or checked on stand-in
        values so far (`fxpipe.weights.stand_in_`: no rule of the model's initialisation writes
        them): those drawn so, and those of the same role (the name without block numbers,
        shape and dtype), which timing's `Tiled` values repeat."""
        drawn = {name for init in (self.weights, self.computed) if isinstance(init, Init)
                 for name in init.stood_in}
        if not drawn:
            return ()
        first: dict[int, tuple[str, torch.Tensor]] = {}
        for name, t in [*self.model.named_parameters(remove_duplicate=False),
                        *self.model.named_buffers(remove_duplicate=False)]:
            if t.is_meta:
                first.setdefault(id(t), (name, t))
        tensors = dict(first.values())

        def role(name: str) -> tuple:
            return blockless(name), tuple(tensors[name].shape), tensors[name].dtype
        roles = {role(name) for name in drawn if name in tensors}
        return tuple(name for name in tensors if name in drawn or role(name) in roles)

    @classmethod
    def of(cls, model: nn.Module, example_inputs: tuple | Any,
           example_kwargs: Mapping[str, Any] | None, options: Options) -> Recipe:
        """The recipe of `model` on the example, once the model and the example are fit to plan
        from (options are checked already, as `Options`)."""
        if not isinstance(model, nn.Module):
            raise TraceError(f"the model is a {type(model).__name__}, not an nn.Module\nwrap it "
                             f"in a module whose forward calls it, then compile that module")
        if example_inputs is None or isinstance(example_inputs, list):
            raise InputError(
                f"example_inputs={'None' if example_inputs is None else 'a list'} is not a "
                f"tuple\npass the model's positional example inputs as a tuple (one tensor may "
                f"be passed alone)"
                + (", e.g. tuple(inputs), or (inputs,) if the model takes the list as its one "
                   "input" if example_inputs is not None else
                   ", and keyword inputs in example_kwargs"))
        if not isinstance(example_inputs, tuple):
            example_inputs = (example_inputs,)
        if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
            raise InputError(f"example_kwargs is a {type(example_kwargs).__name__}, not a dict\n"
                             f"pass the model's keyword example inputs as a dict (name -> value), "
                             f"positional ones in example_inputs")
        example_kwargs = with_tensor_defaults(                                    # what it runs
            model, example_inputs, without_cache(model, example_inputs, example_kwargs))
        _refuse_meta_inputs((example_inputs, example_kwargs))
        batch_dims = options.batch_dims
        return cls(model, example_inputs, example_kwargs,
                      input_dims(model, example_inputs, example_kwargs, batch_dims),
                      batch_dims if isinstance(batch_dims, int) else 0, options,
                      _link_function(options), progress=Progress(options.progress),
                      weights=_weights_of(model, options.weights))

    def trace(self, model: nn.Module) -> fx.GraphModule:
        """`model` captured in its current mode: the one capture of each mode's planning."""
        o = self.options
        gm = trace(model, copied(self.args), copied(self.kwargs), batch_dims=self.input_dims,
                   capture=o.capture, leaf_modules=o.leaf_modules, concrete_args=o.concrete_args,
                   stages=o.stages_asked,     # a graph fine enough for the stages
                   device_type=torch.device(o.devices[0].name).type)   # a meta model's fakes
        self.traced_code[model.training] = gm.code
        return gm


def _refuse_meta_inputs(inputs: Any) -> None:
    """Refuse example inputs on the meta device: activations are measured on real values."""
    if any(t.is_meta for t in tensors(inputs)):
        raise DeviceError("an example input is on the meta device: it has a shape but no values\n"
                          "fxpipe measures and checks the model on real ones (a model built "
                          "on meta is fine); pass real example inputs (e.g. torch.randn(shape), "
                          "or token ids) of the batch's shape")


def _weights_of(model: nn.Module, spec: Any) -> Any:
    """Where the values of a model built on the meta device come from (`weights=`, see
    `compile`), or None for a model holding its own values, which refuses `weights=`."""
    if not holds_meta(model):
        if spec is not None:
            raise InputError(
                "weights= was given, but the model holds its own values\n"
                "it was not built on the meta device: load them into the model instead "
                "(model.load_state_dict(...)), "
                "or build it under torch.device('meta') to plan it without holding it")
        return None
    weights = Init(model, seed=0) if spec is None else open_weights(spec)
    # Planning never needs an init rule: a tensor none writes is timed and checked on a
    # stand-in (the plan names it); only running the plan needs its values.
    return weights.for_planning(model) if isinstance(weights, Init) else weights


def _link_function(options: Options) -> LinkFn:
    """The `link` option as a function pricing a transfer between two devices, its answer for
    every pair of the devices (and the driver) checked once, up front."""
    link, specs = options.link, options.devices
    if link == "measure":
        link = measure_links(specs)
    elif link == "default":
        link = default_link
    elif link == "gloo":
        link = _gloo_link()
    return _checked_link(link, specs)


@functools.cache
def _gloo_link() -> LinkFn:
    """Every value priced as one message between two gloo processes, measured once a process."""
    from ..distributed.link import measure_link
    measured = measure_link()
    return lambda src, dst: measured


def _checked_link(link: LinkFn, specs: Sequence[DeviceSpec]) -> LinkFn:
    """`link`, its answer for every pair of devices (and the driver) checked once, up front."""
    checked: dict[tuple[str, str], Link] = {}

    def checked_link(src: DeviceSpec, dst: DeviceSpec) -> Link:
        if (src.name, dst.name) not in checked:
            checked[src.name, dst.name] = _valid_link(link(src, dst), src, dst)
        return checked[src.name, dst.name]
    for src in [DRIVER_DEVICE, *specs]:
        for dst in [DRIVER_DEVICE, *specs]:
            checked_link(src, dst)
    return checked_link


def _valid_link(found: Any, src: DeviceSpec, dst: DeviceSpec) -> Link:
    where = f"link({src.name!r}, {dst.name!r}) returned {found!r}"
    if not isinstance(found, Link):
        raise CostError(f"{where}: a link function must return a fxpipe.Link\ne.g. "
                        f"Link(latency_s=10e-6, bytes_per_s=20e9)")
    if not (isinstance(found.latency_s, (int, float)) and 0 <= found.latency_s < math.inf):
        raise CostError(f"{where}: latency_s must be a finite number of seconds >= 0")
    if not (isinstance(found.bytes_per_s, (int, float)) and found.bytes_per_s > 0):
        raise CostError(f"{where}: bytes_per_s must be a bandwidth > 0\n"
                        f"math.inf for a free copy")
    return found
