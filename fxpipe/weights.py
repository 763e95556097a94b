"""Where a stage's tensors come from: a checkpoint read per tensor, or the model's own init.

    weights = open_weights("ckpt/")                  # .safetensors, HF sharded dir, torch file
    tensors = weights.read(like, device="cuda:1")     # like: name -> (meta) tensor of one stage

Names are the model's (`model.layers.0.self_attn.q_proj.weight`), as a stage GraphModule holds
them. `read` gives a real tensor for every name it is asked, with the asked shape and dtype, on
the asked device, and reads nothing else: a stage never reads the whole checkpoint. Names that
share one tensor in `like` (a tied output layer) give one tensor, found under whichever of them
the checkpoint stores. A missing tensor, another shape or dtype is a `PlanFileError` naming the
tensor and the file; a dtype is cast only when the weights were opened with `cast=True`.

`Init` draws values instead, as the model initialises them, module by module; planning's
`Init(..., stand_ins=True)` gives a tensor no rule writes plausible values (`stand_in_`).
`build_on_meta(make_model)` builds a model's structure as on meta, but with its buffers computed
(a non-persistent buffer made in `__init__` is in no checkpoint, and no rule computes it again).
"""

from __future__ import annotations

import abc
import contextlib
import copy
import dataclasses
import difflib
import hashlib
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from fxpipe.passes.errors import PlanFileError

# safetensors' dtype names (its header's "dtype"), as torch's
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Weights(abc.ABC):
    """Where tensors come from, by the model's names.

    A subclass says which names it has (`names`) and reads some of them, checked (`_read`);
    `read` resolves tied names first, so a subclass reads each stored tensor once.
    """

    where: str = "weights"      # for messages: "ckpt/model.safetensors (safetensors)"
    cast: bool = False          # whether a dtype other than the asked one is cast

    @abc.abstractmethod
    def names(self) -> set[str]:
        """The names it can give."""

    def read(self, like: Mapping[str, torch.Tensor], device: torch.device | str
             ) -> dict[str, torch.Tensor]:
        """Real tensors for every name in `like`, on `device`, each with like[name]'s shape and
        dtype (`like` values are usually meta tensors). Reads only those tensors. Tied names (two
        names, one tensor object in `like`) give one tensor object, read under whichever name
        the weights hold. Raises PlanFileError naming the tensor and the file when a name is
        missing or has another shape or dtype (cast only with `cast=True` at open)."""
        device = torch.device(device)
        available = self.names()
        wanted: dict[str, list[str]] = {}         # the name read -> the names it gives
        for group in tied_groups(like):
            stored = next((name for name in group if name in available), None)
            if stored is None:
                raise PlanFileError(self._missing(group, available))
            wanted[stored] = group
        tensors = self._read({stored: like[group[0]] for stored, group in wanted.items()}, device)
        return {name: tensors[stored] for stored, group in wanted.items() for name in group}

    @abc.abstractmethod
    def _read(self, like: Mapping[str, torch.Tensor], device: torch.device
              ) -> dict[str, torch.Tensor]:
        """Real tensors for the names of `like`, all of which `names()` holds, checked against
        like's shapes and dtypes (`_check`)."""

    def _check(self, name: str, source: str, shape: Iterable[int], dtype: torch.dtype,
               want: torch.Tensor) -> None:
        """Refuse a tensor whose shape, or dtype without `cast`, is not the model's."""
        if tuple(shape) != tuple(want.shape):
            raise PlanFileError(
                f"shape of {name!r}: {list(shape)} in {source}, {list(want.shape)} in the model"
                f"\nthese weights are for another model (or another "
                f"configuration of it); give the checkpoint of this model")
        if dtype != want.dtype and not self.cast:
            raise PlanFileError(
                f"tensor {name!r} in {source} is {dtype}, the model's is {want.dtype}\n"
                f"open the weights with cast=True (open_weights(..., cast=True)) to cast it, or "
                f"plan the model in {dtype}")

    def _missing(self, group: list[str], available: set[str]) -> str:
        names = " or ".join(repr(name) for name in group)
        close = difflib.get_close_matches(group[0], available, n=1)
        hint = f" (it holds {close[0]!r})" if close else ""
        return (f"tensor {names} is not in {self.where}{hint}\nthese weights are for another "
                f"model, or name its tensors otherwise; give the checkpoint of this model, saved "
                f"under the model's names (model.state_dict()). A tied weight stored once is "
                f"found when the tensors asked share one object under both names, as the "
                f"model's do")


def tied_groups(like: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The names of `like` grouped by tensor object, in order: a tied weight's names share one."""
    groups: dict[int, list[str]] = {}
    for name, tensor in like.items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


class _StateDict(Weights):
    """A state_dict in memory (or memory-mapped): its tensors copied to the device asked."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], where: str, cast: bool):
        self.tensors, self.where, self.cast = tensors, where, cast

    def names(self) -> set[str]:
        return set(self.tensors)

    def _read(self, like, device):
        out = {}
        for name, want in like.items():
            tensor = self.tensors[name]
            self._check(name, self.where, tensor.shape, tensor.dtype, want)
            out[name] = tensor.detach().to(device, want.dtype, copy=True)
        return out


class _Safetensors(Weights):
    """Safetensors files: each tensor read alone (`safe_open`), straight to the device.

    `files` maps each name to the file holding it (one file, or an HF index's weight_map); only
    the files holding asked names are opened, and only their headers until a tensor is read.
    `tied` maps a name the files do not store to the name of the tensor it shares (an index
    written by `save_weights` lists them).
    """

    def __init__(self, files: Mapping[str, Path], where: str, cast: bool,
                 tied: Mapping[str, str] | None = None):
        tied = {name: stored for name, stored in (tied or {}).items() if stored in files}
        self.files = {**files, **{name: files[stored] for name, stored in tied.items()}}
        self.stored_as, self.where, self.cast = tied, where, cast

    def names(self) -> set[str]:
        return set(self.files)

    def _read(self, like, device):
        from safetensors import SafetensorError, safe_open

        by_file: dict[Path, list[str]] = {}
        for name in like:
            by_file.setdefault(self.files[name], []).append(name)
        # safetensors names a CUDA device by its index ("cuda:0"), not a bare "cuda", and the
        # CPU only as "cpu" (a plan's "cpu:1" is the same memory)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.type == "cpu":
            device = torch.device("cpu")
        out = {}
        for file, names in by_file.items():
            if not file.is_file():
                raise PlanFileError(f"{file} does not exist; {self.where} names it as holding "
                                    f"{names[0]!r}\ncopy the checkpoint whole")
            try:
                with safe_open(file, framework="pt", device=str(device)) as f:
                    for name in names:
                        stored = self.stored_as.get(name, name)
                        if stored not in f.keys():
                            raise PlanFileError(
                                f"tensor {stored!r} is not in {file}, which {self.where} says "
                                f"holds it\nthe index and its files disagree; copy the "
                                f"checkpoint whole, or write it again")
                        header = f.get_slice(stored)
                        dtype = _SAFETENSORS_DTYPES.get(header.get_dtype())
                        self._check(name, str(file), header.get_shape(), dtype, like[name])
                        out[name] = f.get_tensor(stored).to(like[name].dtype)
            except SafetensorError as e:
                raise PlanFileError(f"{file} is not a readable safetensors file ({e})\n"
                                    f"copy the checkpoint again") from e
        return out


class _DistributedCheckpoint(Weights):
    """A torch.distributed.checkpoint directory (as torchtitan saves): names, shapes and dtypes
    from its `.metadata`; `dcp.load` reads only the asked tensors' bytes, in this process alone
    (no collective, so ranks read their own stages independently)."""

    def __init__(self, path: Path, cast: bool):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path, self.where, self.cast = path, f"{path} (torch.distributed.checkpoint)", cast
        entries = FileSystemReader(path).read_metadata().state_dict_metadata
        self.entries = {name: entry for name, entry in entries.items()
                        if isinstance(entry, TensorStorageMetadata)}

    def names(self) -> set[str]:
        return set(self.entries)

    def _read(self, like, device):
        import torch.distributed.checkpoint as dcp

        into = {}
        for name, want in like.items():
            entry = self.entries[name]
            self._check(name, self.where, entry.size, entry.properties.dtype, want)
            into[name] = torch.empty(entry.size, dtype=entry.properties.dtype, device=device)
        with warnings.catch_warnings():     # its note that no_dist=True loads in one process
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(into, storage_reader=dcp.FileSystemReader(self.path), no_dist=True)
        return {name: tensor.to(like[name].dtype) for name, tensor in into.items()}


INDEX_FILE, SINGLE_FILE, DCP_FILE = "model.safetensors.index.json", "model.safetensors", ".metadata"


def open_weights(spec, *, cast: bool = False) -> Weights:
    """The `Weights` that `spec` names.

    spec: a `Weights` (as is); a Mapping[str, Tensor] (a state_dict in memory); a path to a
    .safetensors file, a Hugging Face sharded directory (model.safetensors.index.json), a
    directory holding one model.safetensors, a torch.distributed.checkpoint directory (its
    .metadata), or a torch state_dict file (.pt/.pth/.bin, read with torch.load(mmap=True,
    weights_only=True)); "init" -> Init() (per-module init, seed 0; give it the model with
    `bind`). `cast=True` casts a checkpoint's tensors to the model's dtypes instead of
    refusing them. Opening reads headers and indexes only.
    """
    if isinstance(spec, Weights):
        return spec
    if isinstance(spec, Mapping):
        return _StateDict(spec, "the state_dict given", cast)
    if isinstance(spec, str) and spec == "init":
        return Init()
    if not isinstance(spec, (str, os.PathLike)):
        raise PlanFileError(f"weights={spec!r} is not weights\n"
                            f"give a path to a checkpoint (.safetensors file or directory, "
                            f"torch state_dict file), a state_dict, \"init\" or a "
                            f"fxpipe.weights.Weights")
    path = Path(spec)
    if not path.exists():
        raise PlanFileError(f"no checkpoint at {str(path)!r}: the path does not exist\n"
                            f"give the path of a .safetensors file, a directory of them, or a "
                            f"torch state_dict file")
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            return _safetensors_index(path / INDEX_FILE, cast)
        if (path / SINGLE_FILE).is_file():
            return _safetensors_file(path / SINGLE_FILE, cast)
        if (path / DCP_FILE).is_file():
            return _DistributedCheckpoint(path, cast)
        raise PlanFileError(f"no checkpoint in the directory {path}\n"
                            f"it holds none of {INDEX_FILE} (Hugging Face sharded safetensors), "
                            f"{SINGLE_FILE}, {DCP_FILE} (torch.distributed.checkpoint); give "
                            f"the directory holding one, or the path of a checkpoint file")
    if path.suffix == ".safetensors":
        return _safetensors_file(path, cast)
    return _torch_file(path, cast)


def _safetensors_file(path: Path, cast: bool) -> _Safetensors:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return _Safetensors(dict.fromkeys(f.keys(), path), f"{path} (safetensors)", cast)
    except SafetensorError as e:
        raise PlanFileError(f"{path} is not a readable safetensors file ({e})\n"
                            f"give a checkpoint file") from e


def _safetensors_index(index: Path, cast: bool) -> _Safetensors:
    try:
        document = json.loads(index.read_text())
        files = {name: index.parent / file for name, file in document["weight_map"].items()}
        tied = document.get("metadata", {}).get(TIED_KEY, {})
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PlanFileError(f"{index} is not a Hugging Face index ({type(e).__name__}: {e})\n"
                            f"it needs a \"weight_map\" of tensor names to files; copy the "
                            f"checkpoint again") from e
    return _Safetensors(files, f"{index} (Hugging Face sharded safetensors)", cast, tied)


def _torch_file(path: Path, cast: bool) -> _StateDict:
    """A torch state_dict file, memory-mapped: a tensor's bytes are read when it is copied."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:      # torch raises pickle's, zipfile's or its own errors
        raise PlanFileError(f"{path} is not a checkpoint fxpipe reads ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})\n"
                            f"give a .safetensors file or directory, or a torch state_dict "
                            f"file saved with torch.save(model.state_dict(), path)") from e
    if not isinstance(state, Mapping) or not all(isinstance(t, torch.Tensor)
                                                 for t in state.values()):
        raise PlanFileError(f"{path} holds a {type(state).__name__}, not a state_dict of "
                            f"tensors by name\n"
                            f"save it with torch.save(model.state_dict(), path)")
    return _StateDict(state, f"{path} (torch state_dict)", cast)


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
    differ). Cost: each module's own tensors, once per read asking for them, on their device.
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
    refused: it gets a stand-in (`stand_in_`), drawn after the module's rules under the same
    seed, so every read of it gives the same values; its name is added to `stood_in`.
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
        fresh = _with_tensors(module, lambda t: torch.empty_like(t, device=device))
        own = {name: t for name, t in {**fresh._parameters, **fresh._buffers}.items()
               if t is not None}
        versions = {name: t._version for name, t in own.items()}
        rules = self._rules(model, fresh, path)
        held = {**module._parameters, **module._buffers}
        with _seeded(_module_seed(self.seed, path), device):
            for rule in rules:
                rule()
            after = {**fresh._parameters, **fresh._buffers}
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
                    raise _no_rule(path, fresh)
                if not self.stand_ins:
                    raise PlanFileError(
                        f"tensor {_join(path, name)!r} ({type(module).__name__}) has no rule "
                        f"to initialise it\nits module's rules left it unwritten; load it "
                        f"from a checkpoint, write it in the module's reset_parameters(), or "
                        f"use Init(build=..., exact=True), which builds the model")
                stand_in_(t, name)
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
    Only `device`'s CUDA generator is touched (another GPU's is neither seeded nor read)."""
    cuda = [torch.cuda.current_device() if device.index is None else device.index] \
        if device.type == "cuda" else []
    with _SEEDING, torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def _module_seed(seed: int, path: str) -> int:
    """A seed for the module at `path`, stable across processes and runs."""
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# Writing: Hugging Face's layout (shards model-<k>-of-<n>.safetensors and an index mapping each
# name to its shard), the names a tied tensor shares listed in the index's metadata.
TIED_KEY = "tied"
MAX_SHARD_BYTES = 5 * 2 ** 30


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which file each tensor is written to, decided from names and sizes alone, so that every
    torchrun rank computes the same layout and no rank needs another's tensors.

    files: stored name -> shard file name; shards: each group's shard files (group k writes
    shards[k]); tied: a name not stored -> the stored name whose tensor it shares; total_size:
    bytes of the stored tensors (the index's metadata).
    """

    files: dict[str, str]
    shards: list[list[str]]
    tied: dict[str, str]
    total_size: int


def shard_layout(groups: Sequence[Mapping[str, torch.Tensor]], *,
                 max_shard_bytes: int = MAX_SHARD_BYTES,
                 tied: Mapping[str, str] | None = None) -> ShardLayout:
    """The layout of tensors written by several writers (one group each: a stage, a rank), in
    order; meta tensors are fine. A group's tensors go to its own shards (a shard never mixes
    groups), a new shard when the next tensor would pass `max_shard_bytes`. A tensor is stored
    once, under its first name: a later name for the same tensor (one object, or the same
    memory) or a name an earlier group stores is not stored again. `tied` adds names the model
    gives a stored tensor that no group holds (name -> stored name: a stage holds a tied
    weight under the model's first name only)."""
    if max_shard_bytes <= 0:
        raise PlanFileError(f"max_shard_bytes={max_shard_bytes} must be positive\n"
                            f"give the most bytes one shard file may hold")
    first_name: dict[object, str] = {}
    stored_names: set[str] = set()
    tied = dict(tied or {})
    shards: list[list[list[str]]] = []          # per group, its shards' names
    total = 0
    for group in groups:
        shards.append([])
        filled = 0
        for name, tensor in group.items():
            if name in stored_names or name in tied:
                continue
            stored = first_name.setdefault(_same_tensor(tensor), name)
            if stored != name:
                tied[name] = stored
                continue
            stored_names.add(name)
            size = tensor.numel() * tensor.element_size()
            if not shards[-1] or filled + size > max_shard_bytes:
                shards[-1].append([])
                filled = 0
            shards[-1][-1].append(name)
            filled += size
            total += size
    count = sum(map(len, shards))
    numbered = iter(range(1, count + 1))
    files, group_files = {}, []
    for group_shards in shards:
        group_files.append([])
        for names in group_shards:
            file = f"model-{next(numbered):05d}-of-{count:05d}.safetensors"
            group_files[-1].append(file)
            files.update(dict.fromkeys(names, file))
    missing = {name: stored for name, stored in tied.items() if stored not in files}
    if missing:
        name, stored = next(iter(missing.items()))
        raise PlanFileError(f"tied name {name!r} shares tensor {stored!r}, which no group holds\n"
                            f"give the groups every stored tensor")
    return ShardLayout(files, group_files, tied, total)


def _same_tensor(tensor: torch.Tensor) -> object:
    """A key equal for two tensors that are one (one object, or one view of the same memory:
    `model.state_dict()` gives a tied weight as two tensor objects)."""
    if tensor.is_meta or tensor.numel() == 0:         # no memory to compare
        return id(tensor)
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def save_weights(tensors: Mapping[str, torch.Tensor], directory: str | os.PathLike, *,
                 max_shard_bytes: int = MAX_SHARD_BYTES, layout: ShardLayout | None = None,
                 group: int = 0, write_index: bool = True) -> Path:
    """Write `tensors` (the model's names, as `model.state_dict()` gives them: persistent
    tensors only) as Hugging Face sharded safetensors in `directory` (made if needed), with
    model.safetensors.index.json: a tied tensor once, its other names listed in the index's
    metadata ("tied").

    Read back with `open_weights(directory)` (tied names resolved), `from_pretrained(directory)`
    for a Hugging Face model, or `model.load_state_dict(open_weights(directory).read(
    model.state_dict(), "cpu"), strict=True)`.

    Under torchrun, every rank computes the layout of the whole model from names and sizes
    (`shard_layout`, one group per stage, in stage order) and passes it with its stage's tensors
    and its group: it writes that group's shards; the rank passing `write_index=True` writes the
    index from the layout. No rank gathers another's tensors. Returns the directory.
    """
    directory = Path(directory)
    layout = layout or shard_layout([tensors], max_shard_bytes=max_shard_bytes)
    unknown = [name for name in tensors if name not in layout.files and name not in layout.tied]
    if unknown:
        raise PlanFileError(f"tensor {unknown[0]!r} is not in the layout given to save_weights\n"
                            f"compute the layout from every stage's names (shard_layout)")
    if not 0 <= group < len(layout.shards):
        raise PlanFileError(f"group={group}, but the layout has groups 0 to "
                            f"{len(layout.shards) - 1}\ngive the index of this writer's group")
    directory.mkdir(parents=True, exist_ok=True)
    names_in: dict[str, list[str]] = {}
    for name, file in layout.files.items():
        names_in.setdefault(file, []).append(name)
    for file in layout.shards[group]:
        names = names_in[file]
        absent = [name for name in names if name not in tensors]
        if absent:
            raise PlanFileError(f"shard {file}: tensor {absent[0]!r} was not given to this "
                                f"save_weights call\n"
                                f"give group {group}'s tensors as shard_layout was given them")
        _write_shard({name: tensors[name] for name in names}, directory / file)
    if write_index:
        index = {"metadata": {"total_size": layout.total_size, TIED_KEY: layout.tied},
                 "weight_map": layout.files}
        _replace(directory / INDEX_FILE, lambda tmp: tmp.write_text(json.dumps(index, indent=2)))
    return directory


def _write_shard(shard: Mapping[str, torch.Tensor], path: Path) -> None:
    """One safetensors file, its tensors on CPU, each its own memory (safetensors refuses views
    of one storage)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    on_cpu = {}
    for name, tensor in shard.items():
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        on_cpu[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    _replace(path, lambda tmp: save_file(on_cpu, tmp, metadata={"format": "pt"}))


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """Write `path` whole or not at all (a crash leaves the old file, never half a new one)."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)
