"""Values as the model initialises them (`Init`), a model's structure built with its buffers
computed (`build_on_meta`), and plausible values where no rule writes a tensor (`stand_in_`)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import threading
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from fxpipe.passes.device import forked_generators, generators_of, seed_generators
from fxpipe.passes.errors import PlanFileError

from .base import Weights, _StateDict


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` run on the CPU, each parameter put on meta as its module registers it: the
    model's structure, as `with torch.device("meta"): build()` gives it, but its buffers
    computed as its modules compute them (a rotary `freqs` registered with `persistent=False`
    in `__init__`, which no checkpoint holds and no init rule writes). Plan this model (the
    plan then holds those buffers' values, and loads from a checkpoint alone), or give it as
    `model=` where a plan made on meta is loaded (`load_plan(path, model, weights=...)`,
    `fxpipe.distributed.load`).

    Cost: the buffers, and each parameter made on the CPU for as long as its module takes to
    register it (nn.Linear's and nn.Embedding's `torch.empty`, whose memory is never touched;
    a `torch.ones(d)`): one parameter at a time, never the model's weights together. The
    modules' own init then runs on meta parameters (nothing drawn). `nn.Module.register_parameter`
    is patched while `build` runs: build in one thread at a time."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        held = module._parameters.get(name)
        if held is not None and not held.is_meta:
            if type(held) is nn.Parameter:
                moved = nn.Parameter(held.to("meta"), held.requires_grad)
                moved.__dict__.update(held.__dict__)
            else:       # a Parameter subclass takes its fields as arguments
                moved = type(held)(held.to("meta"), **{**held.__dict__,
                                                      "requires_grad": held.requires_grad})
            module._parameters[name] = moved

    with _BUILDING:
        nn.Module.register_parameter = on_meta
        try:
            with torch.device("cpu"):
                return build()
        finally:
            nn.Module.register_parameter = register


_BUILDING = threading.RLock()    # build_on_meta patches nn.Module for one build at a time


class Init(Weights):
    """Values as the model initialises them, drawn where they are needed.

    Per-module mode, `Init(model, seed)`: each module owning an asked tensor is copied (never
    changed), its own tensors made on the device, and initialised by the rules building the
    model runs on them: its `reset_parameters()`, those of the modules enclosing it, then a
    Hugging Face model's `root._init_weights(module)` (which also computes rotary `inv_freq`);
    non-persistent buffers are computed by those rules too, never left as uninitialised memory.
    A module's seed is drawn from (seed, module path), so values depend neither on the
    partition nor on the order of reads (they do on the device type: CPU and CUDA generators
    differ). Cost: each module's own tensors, once per read asking for them, on their device
    (of a module that no rule initialises, only those asked: a generation's `CachedLM` owns
    every layer's cache, read one at a time).
    `model` is the model's structure (built on meta is fine), or `build` builds it with
    `build_on_meta` (parameters on meta, buffers computed on the CPU); without either, give it
    later with `bind(model)`. A tensor that no rule writes takes the value the model holds (a
    non-persistent buffer its module computed in `__init__`, the model built by
    `build_on_meta`); where the model holds none (built on meta) it is refused by name. Draws
    in one process take turns (the generators are global); another thread of yours drawing
    random numbers meanwhile would change them.

    Exact mode, `Init(build=callable, seed=seed, exact=True)`: the values of
    `torch.manual_seed(seed); build()` on CPU, bit for bit. Cost: the whole model built once in
    CPU memory per process (each rank under torchrun), then each asked tensor copied to its
    device.

    With `stand_ins=True` (what planning uses: timing and the streamed check need plausible
    values, the same on both sides, not the model's), a tensor that no rule writes is not
    refused: it gets a stand-in (`stand_in_`), drawn after the module's rules under a seed of
    its own, from (seed, its name), so every read of it gives the same values, whatever else
    the read asks for; its name is added to `stood_in`.
    """

    where = "Init (the model's own initialisation)"

    def __init__(self, model: nn.Module | None = None, seed: int = 0, *,
                 build: Callable[[], nn.Module] | None = None, exact: bool = False,
                 stand_ins: bool = False):
        if exact and build is None:
            raise PlanFileError("Init(exact=True) builds the model on CPU, but has no builder\n"
                                "give the function that builds it, "
                                "Init(build=lambda: MyModel(config), exact=True)")
        self.model, self.seed, self.build, self.exact = model, seed, build, exact
        self.stand_ins = stand_ins
        self.stood_in: set[str] = set()     # the names given stand-ins so far
        self._built: _StateDict | None = None       # exact mode: the model built on CPU

    def for_planning(self, model: nn.Module) -> Init:
        """A copy drawing the same values (bound to `model` where it has no structure yet) that
        gives stand-ins where no rule writes a tensor, with a record of its own."""
        planning = copy.copy(self)
        planning.model = self.model if self.model is not None else model
        planning.stand_ins, planning.stood_in = True, set()
        return planning

    def bind(self, model: nn.Module) -> Init:
        """Give the model's structure (its modules and tied tensors) to draw from; returns self."""
        self.model = model
        return self

    def names(self) -> set[str]:
        return set(self._owners())

    def read(self, like, device):
        """As `Weights.read`; a tied tensor is drawn under the model's first name for it, so a
        stage holding only the output layer gets the embedding's values."""
        if self.exact:
            return self._built_on_cpu().read(like, device)
        canonical = self._canonical()
        first: dict[str, torch.Tensor] = {}
        for name, tensor in like.items():
            first.setdefault(canonical.get(name, name), tensor)
        drawn = super().read(first, device)
        return {name: drawn[canonical.get(name, name)] for name in like}

    def _read(self, like, device):
        by_module: dict[str, list[str]] = {}
        for name in like:
            by_module.setdefault(name.rpartition(".")[0], []).append(name)
        out = {}
        for path, names in by_module.items():
            drawn = self._draw(path, device, {name.rpartition(".")[2] for name in names})
            for name in names:
                tensor = drawn[name.rpartition(".")[2]]
                self._check(name, self.where, tensor.shape, tensor.dtype, like[name])
                out[name] = tensor
        return out

    def _draw(self, path: str, device: torch.device, asked: set[str]
              ) -> dict[str, torch.Tensor]:
        """The own tensors of the module at `path`, made on `device` and initialised by its
        rules under the seed of (seed, path); one no rule writes takes the value the model
        holds (a buffer its module computed as `build_on_meta` built it), else a stand-in
        (`stand_ins`), else, when `asked` names it, is refused. The model is not touched."""
        model = self._structure()
        module = model.get_submodule(path)
        held = {**module._parameters, **module._buffers}
        if _has_rules(model, path):    # a rule may write any own tensor, drawing in turn: all
            fresh = _with_tensors(module, lambda t: torch.empty_like(t, device=device))
            own = {name: t for name, t in {**fresh._parameters, **fresh._buffers}.items()
                   if t is not None}
            rules = self._rules(model, fresh, path)
        else:       # each tensor's value is its own: only those asked are made (a module
            # owning many, as a generation's root its caches, is read one tensor at a time)
            rules = []
            own = {name: torch.empty_like(t, device=device) for name, t in held.items()
                   if t is not None and name in asked}
        versions = {name: t._version for name, t in own.items()}
        standing: list[str] = []
        with _seeded(_module_seed(self.seed, path), device):
            for rule in rules:
                rule()
            after = {**fresh._parameters, **fresh._buffers} if rules else own
            for name, t in own.items():
                if after[name] is not t or t._version != versions[name]:
                    continue
                if not held[name].is_meta:          # the model holds its value
                    with torch.no_grad():
                        t.copy_(held[name])
                    continue
                if not self.stand_ins and name not in asked:
                    continue            # not returned: left as made
                if not self.stand_ins and name in module._non_persistent_buffers_set:
                    raise _no_value(path, name, module)
                if not rules and not self.stand_ins:
                    raise _no_rule(path, module)
                if not self.stand_ins:
                    raise PlanFileError(
                        f"tensor {_join(path, name)!r} ({type(module).__name__}) has no rule "
                        f"to initialise it\nits module's rules left it unwritten; load it "
                        f"from a checkpoint, write it in the module's reset_parameters(), or "
                        f"use Init(build=..., exact=True), which builds the model")
                standing.append(name)
        for name in standing:       # each under a seed of its own: the same whatever is asked
            with _seeded(_module_seed(self.seed, _join(path, name)), device):
                stand_in_(own[name], name)
            self.stood_in.add(_join(path, name))
        return {name: t.detach() if isinstance(t, nn.Parameter) else t
                for name, t in after.items() if t is not None}

    def _rules(self, model: nn.Module, fresh: nn.Module, path: str) -> list[Callable[[], None]]:
        """The rules that initialise `fresh` (the module at `path`), in the order building the
        model runs them: its own `reset_parameters()`; nearest first, the reset of each
        enclosing module that has one (nn.MultiheadAttention zeroes its out_proj's bias), run
        on a copy holding `fresh` and meta tensors elsewhere, so that it writes `fresh`'s
        tensors alone; then a Hugging Face model's `_init_weights(module)`."""
        rules = [rule for rule in [_reset_rule(fresh)] if rule]
        parts = path.split(".") if path else []
        enclosing = [".".join(parts[:k]) for k in range(len(parts) - 1, -1, -1)]
        with_rule = [k for k, p in enumerate(enclosing) if _reset_rule(model.get_submodule(p))]
        inner = fresh
        for k in range(max(with_rule, default=-1) + 1):
            key = parts[len(parts) - 1 - k]
            inner = _with_tensors(model.get_submodule(enclosing[k]), _on_meta, {key: inner})
            if k in with_rule:
                rules.append(_reset_rule(inner))
        if callable(getattr(model, "_init_weights", None)):      # a Hugging Face PreTrainedModel
            rules.append(lambda: model._init_weights(fresh))
        return rules

    def _built_on_cpu(self) -> _StateDict:
        if self._built is None:
            with _seeded(self.seed, torch.device("cpu")), torch.device("cpu"):
                model = self.build()
            self._built = _StateDict(_named_tensors(model), "the model built on CPU", cast=False)
        return self._built

    def _structure(self) -> nn.Module:
        if self.model is None and self.build is not None:
            self.model = build_on_meta(self.build)      # its buffers computed, as built
        if self.model is None:
            raise PlanFileError("Init has no model to initialise\n"
                                "give its structure, Init(model) or init.bind(model) (built on "
                                "meta is fine)")
        return self.model

    def _owners(self) -> Mapping[str, torch.Tensor]:
        if self.exact:
            return self._built_on_cpu().tensors
        return _named_tensors(self._structure())

    def _canonical(self) -> dict[str, str]:
        """Each name -> the model's first name for its tensor (itself unless tied)."""
        first: dict[int, str] = {}
        return {name: first.setdefault(id(t), name) for name, t in self._owners().items()}


def _has_rules(model: nn.Module, path: str) -> bool:
    """Whether any rule initialises the module at `path` (`Init._rules`): its own reset, an
    enclosing module's, or a Hugging Face model's `_init_weights`."""
    parts = path.split(".") if path else []
    return callable(getattr(model, "_init_weights", None)) or any(
        _reset_rule(model.get_submodule(".".join(parts[:k]))) for k in range(len(parts) + 1))


def _with_tensors(module: nn.Module, make: Callable[[torch.Tensor], torch.Tensor],
                  children: Mapping[str, nn.Module] | None = None) -> nn.Module:
    """A shallow copy of `module` whose own tensors are `make(tensor)`, whose submodules are
    `children`'s where it names them, else copies holding new meta tensors: a rule run on it
    writes no tensor of the model."""
    children = children or {}
    fresh = copy.copy(module)
    fresh._parameters = {name: None if p is None else nn.Parameter(make(p), p.requires_grad)
                         for name, p in module._parameters.items()}
    fresh._buffers = {name: None if b is None else make(b) for name, b in module._buffers.items()}
    fresh._modules = {name: children[name] if name in children else
                      None if child is None else _with_tensors(child, _on_meta)
                      for name, child in module._modules.items()}
    return fresh


# 1-D tensors named so hold offsets (near zero); other 1-D ones scales (near one)
_OFFSETS = ("bias", "beta", "shift", "offset")


def stand_in_(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Fill `tensor` (a module's own, called `name` there) with plausible values of its shape
    and dtype, for a tensor no rule initialises, and return it: integers and booleans zero
    (a valid index); a 0-D or 1-D float named as an offset (`bias`, `beta`, `shift`,
    `offset`) zero, any other (a norm's `weight`, a `scale`, a `gamma`) one; a float of 2-D
    and more drawn from normal(0, 1/sqrt(fan_in)), fan_in the elements of one slice along
    dimension 0 (a Linear's in_features, a conv's in_channels times its kernel), so a
    product keeps its inputs' scale. Draws from the current generators."""
    with torch.no_grad():
        if not (tensor.is_floating_point() or tensor.is_complex()):
            tensor.zero_()
        elif tensor.dim() <= 1:
            tensor.fill_(0 if any(word in name.lower() for word in _OFFSETS) else 1)
        elif tensor.numel():
            tensor.normal_(0, tensor[0].numel() ** -0.5)
    return tensor


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, device="meta")


def _reset_rule(module: nn.Module) -> Callable[[], None] | None:
    """A module's own initialisation, as torch modules name it (nn.MultiheadAttention and
    nn.Transformer call theirs `_reset_parameters`)."""
    for name in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(module, name, None)):
            return getattr(module, name)
    return None


def _no_rule(path: str, fresh: nn.Module) -> PlanFileError:
    return PlanFileError(
        f"module {path or '(the model)'!r} ({type(fresh).__name__}) has no "
        f"reset_parameters() for its tensors\n"
        f"its tensors: "
        f"{', '.join(_join(path, n) for n in (*fresh._parameters, *fresh._buffers))}\n"
        f"give it reset_parameters(), load these tensors from a checkpoint, or use "
        f"Init(build=..., exact=True)")


def _no_value(path: str, name: str, module: nn.Module) -> PlanFileError:
    """A non-persistent buffer (in no checkpoint) that no rule computes and the model, built
    on meta, holds no value of."""
    return PlanFileError(
        f"buffer {_join(path, name)!r} ({type(module).__name__}) has no value to run with\n"
        f"it is not persistent (register_buffer(..., persistent=False)), so no checkpoint holds "
        f"it, and no init rule computes it: its module computes it as it is built, and the "
        f"model was built on meta\n"
        f"build the model with fxpipe.weights.build_on_meta(make_model) (its parameters on "
        f"meta, its buffers computed on the CPU) and plan it again (the plan keeps the "
        f"buffer), or give that model as model= where the plan is loaded "
        f"(load_plan(path, model, weights=...), fxpipe.distributed.load(path, model=model, "
        f"weights=...)); or compute the buffer in the module's reset_parameters()")


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent too) by every name, tied ones sharing a
    tensor object."""
    detached: dict[int, torch.Tensor] = {}
    return {name: detached.setdefault(id(t), t.detach())
            for name, t in [*model.named_parameters(remove_duplicate=False),
                            *model.named_buffers(remove_duplicate=False)]}


_SEEDING = threading.Lock()     # stages loading on threads of one process draw one at a time


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Draw from `seed` on the CPU and on `device`; the generators' states are restored after.
    Only `device`'s own generator is touched (another GPU's is neither seeded nor read)."""
    generators = generators_of([device])
    with _SEEDING, forked_generators(generators):
        torch.random.default_generator.manual_seed(seed)
        seed_generators(seed, generators)
        yield


def _module_seed(seed: int, path: str) -> int:
    """A seed for the module at `path`, stable across processes and runs."""
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
