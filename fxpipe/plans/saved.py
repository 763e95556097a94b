"""A plan on disk: plan once, run it in another process without the model's code.

    pipe.plan.save("plans/resnet50-4")          # or fxpipe.plan(model, ...).save(...)
    plan = fxpipe.load_plan("plans/resnet50-4")
    pipe = fxpipe.Pipeline(plan)

A saved plan (format 5) is a directory of data; loading it runs no code it holds:

- `plan.json`: what a person (or a tool) reads: the versions it was saved with, the capture, the
  devices, chunks, schedule and threads, the partition with its bound and proof, the stage
  wiring, every node's measured costs per kind of device, a SHA-256 of every other file and
  one of its own content (`sha256`, over the rest of the document). It describes what runs,
  which is read from `plan_data.json` and the stage files, so an edit would not take effect: an
  edited plan.json is refused at load rather than believed; to change a plan, plan it again.
- `plan_data.json`: the plan itself, stages included, as data (`fxpipe.plans.plan_format`,
  `fxpipe.plans.graph_data`): each node's target by name, resolved at load through closed tables.
  What a plan names but cannot hold comes from the caller: `functions=` (functions kept whole
  with `torch.fx.wrap`) and `model=` (modules of the model's own classes kept whole).
- `stage_<s>.py`: stage `s`'s generated code, to read (`print(pipe.stages[s].code)`).
- `stage_<s>.pt`: stage `s`'s own tensors (torch's format, loaded with `weights_only=True`):
  parameters, buffers persistent or not, and the tensor constants the graph reads; a tensor
  several stages share is saved once, with the first stage holding it.

Loading checks every file against `plan.json` (missing, changed), plan.json against itself, and
the fxpipe and torch versions against those running, and says what differs. A plan of format 4
holds `plan.pt`, a pickle: loaded only with `trust_pickle=True`, rewritten by `convert`.

A plan's devices are those it was planned for; `load_plan(path, devices=[...])` (one per stage)
and `load_stage(path, index, device=...)` put the stages on others: each stage's tensors are
loaded there, and the devices its code names (`full_like(h, 2.0, device=cpu)` in an export
graph) become its new one. Stages whose planned memory exceeds their new device's (a GPU's own,
or `DeviceSpec(memory_bytes=...)`; stages put on one device share it) are refused by name, as
are stages sharing a tensor (a tied weight) put on different devices.

`save_stage_weights` lays out every stage's shards from names alone, the same on every rank. A plan
keeps every measurement made, which `compile(costs=plan)` reuses; the costed graph and the link
function are not saved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from fxpipe.passes.codegen import place
from fxpipe.passes.capture.regions import regions_as_modules
from fxpipe.passes.stage import Stage
from fxpipe.passes.cost_model import DeviceSpec, format_bytes
from fxpipe.passes.device import is_cpu, same_memory
from fxpipe.passes.errors import DeviceError, PlanFileError

from ..runtime.devices import DeviceLike, parse_devices
# The format's names and plan.json's checks live in plan_format; saved.FORMAT and the rest stay.
from .plan_format import (DATA_FILE, FORMAT, PICKLE_FILE, PICKLED_FORMATS, PLAN_FILE,  # noqa: F401
                          _checked, _content_digest, _description, _document, _finite,
                          _non_persistent, _tensors, decode_plan, encode_plan, manifest,
                          plan_document, regrouped, unpickled, versions)
from ..weights import MAX_SHARD_BYTES, Init, open_weights, save_weights, shard_layout

# `Plan` in annotations is `plan_data.Plan`: plan_data saves its plans here, so this module
# names the type and never imports it (the import runs one way, `tests/test_layers.py`).


def save(plan: Plan, path: str | os.PathLike) -> Path:
    """Write `plan` (a `fxpipe.Plan` with its stages) to the directory `path` (made if needed)."""
    if not plan.stages:
        raise PlanFileError("this plan has no stages to save\nsave the plan of a Pipeline "
                            "(pipe.plan.save(path)) or of fxpipe.plan(...)")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    first_holder: dict[int, tuple[int, str]] = {}     # id(tensor) -> (stage, name) saving it
    shared: list[dict[str, list]] = []
    files: dict[str, str] = {}
    for stage in plan.stages:
        own, refs = {}, {}
        for name, tensor in _tensors(stage.module):
            holder = first_holder.setdefault(id(tensor), (stage.index, name))
            if holder != (stage.index, name):
                refs[name] = list(holder)
            elif not tensor.is_meta:      # a meta tensor has no values: the manifest lists it
                own[name] = tensor.detach()
        shared.append(refs)
        files[f"stage_{stage.index}.py"] = _write(root / f"stage_{stage.index}.py",
                                                  stage.module.code.encode())
        if own or not _without_weights(plan):
            files[f"stage_{stage.index}.pt"] = _write_torch(root / f"stage_{stage.index}.pt", own)
    # The costed graph and the link function are the process's own, not the plan's to keep.
    files[DATA_FILE] = _write(root / DATA_FILE, json.dumps(encode_plan(plan)).encode())
    document = {"format": FORMAT, **versions(), "summary": str(plan).splitlines()[0],
                **_description(plan), "shared": shared, "weights": manifest(plan),
                "files": files}
    document = json.loads(json.dumps(_finite(document), default=str))     # as read back
    document = {**document, "sha256": _content_digest(document)}
    (root / PLAN_FILE).write_text(json.dumps(document, indent=1) + "\n")
    return root


def load_plan(path: str | os.PathLike, model: nn.Module | None = None, *,
              weights: Any = None, devices: Sequence[DeviceLike] | None = None,
              functions: Sequence[Callable] = (), trust_pickle: bool = False) -> Plan:
    """The plan saved at `path`, every stage with its weights on its device.

    With `model`, the stages take that model's current weights instead of the saved ones (a
    plan made once, run with weights trained since), and the plan keeps it in memory
    (`plan.model`: what `pipe.generate` plans generation from); a model whose parameters and buffers do not
    match the plan's by name, shape and dtype is refused, naming what differs. With `weights`
    (a checkpoint, "init", anything `fxpipe.weights.open_weights` takes), each stage reads the
    model's parameters and persistent buffers it holds from there, and only those, straight to
    its device, and `model`, when given too (built on meta is fine), is only the structure that
    `fxpipe.weights.Init` draws from (see `with_weights`). A plan saved without weights and loaded without `weights`
    keeps those tensors on meta: it prints and saves, and `Pipeline` refuses it. With `devices`
    (one per stage: "cuda:0", a torch.device or a DeviceSpec), stage `s` runs on `devices[s]`
    instead of the device it was planned for (see the module docstring).

    Loading runs no code of the plan's directory: its stages are rebuilt from data (see
    `fxpipe.plans.graph_data`). What a plan names but cannot hold comes from the caller: `functions`,
    your functions kept whole in the graph (`torch.fx.wrap`), and `model`, the modules of your
    own classes a capture kept whole ("fx+leaves"); the error says which is needed. A plan of
    format 4 (plan.pt, a pickle) loads only with `trust_pickle=True`, which unpickles it and so
    runs whatever code its directory holds: only for a plan you made or trust; `convert` turns
    it into this format once.
    """
    root, document = _checked(path, None, trust_pickle)
    plan = _load_skeleton(root, document, functions, model)
    if devices is not None:
        plan = _on_devices(plan, devices, f"the plan at {str(root)!r}")
    loaded: _Loaded = {}
    for stage in plan.stages:
        _fill(root, stage, document, loaded, weighed=weights is not None)
    if weights is not None:
        plan = _weighed(plan, weights, loaded, model)
    elif model is not None:
        _take_weights(plan, model, root)
    object.__setattr__(plan, "model", model)      # in memory only: what generate plans from
    return plan


def convert(old: str | os.PathLike, new: str | os.PathLike) -> Path:
    """Write the plan saved at `old` in a pickled format (4) into the directory `new` in this
    one, which holds no code: `load_plan(new)` then runs none. Reading `old` unpickles it, so
    runs whatever code that directory holds: convert only a plan you made or trust (what
    `fxpipe convert old new` does)."""
    return save(load_plan(old, trust_pickle=True), new)


def with_weights(plan: Plan, weights: Any, devices: Sequence[DeviceLike] | None = None, *,
                 model: nn.Module | None = None) -> Plan:
    """`plan` with each stage's parameters and persistent buffers read from `weights` (see
    `fxpipe.weights.open_weights`: a safetensors file, a sharded directory, a torch file, a
    state_dict, "init"), each stage only the tensors it holds, straight to its device (stage
    `s` on `devices[s]` when given, refused by stage where its planned memory exceeds the
    device's); non-persistent buffers (computed by their module, in no checkpoint) kept where
    the plan holds their values, else computed by `fxpipe.weights.Init` from `model` (its
    structure: built on meta is fine), or without it from the stage's own modules, which are the
    model's classes only where the capture kept them whole (`nn.Linear`): a buffer of the
    model's own module class needs `model`. What a plan made from a model built on meta runs
    with. `plan` itself is left as it is; the plan returned has no
    costed graph (its stages hold the tensors; `explain()` needs the graph)."""
    non_persistent = _non_persistent(plan)
    kept = {id(t) for stage in plan.stages for name, t in _tensors(stage.module)
            if name in non_persistent}
    buffer = io.BytesIO()
    stages = _picklable(plan.stages)
    with _without_tensors([stage.module for stage in stages], keep=kept):
        torch.save(stages, buffer)      # the stages' structure, on meta stand-ins
    buffer.seek(0)
    stages = unpickled(buffer)
    _mark_non_persistent(stages, non_persistent)
    plan = dataclasses.replace(plan, stages=stages, graph=None)
    if devices is not None:
        plan = _on_devices(plan, devices, "this plan")
    return _weighed(plan, weights, {}, model)


def load_stage(path: str | os.PathLike, index: int, *, device: DeviceLike | None = None,
               weights: Any = None, model: nn.Module | None = None,
               functions: Sequence[Callable] = (), trust_pickle: bool = False) -> Stage:
    """Stage `index` of the plan saved at `path`, with its own weights only (a process running
    one stage loads nothing else), on `device` when given (else the one it was planned for). A
    tensor it shares with an earlier stage is read from that stage's file, or from `weights`
    when given (as `load_plan` reads it, `model` the structure `Init` draws from, and the
    modules of the model's own classes; `functions` and `trust_pickle` as `load_plan` takes)."""
    return load_stage_plan(path, index, device=device, weights=weights, model=model,
                           functions=functions, trust_pickle=trust_pickle)[1]


def load_stage_plan(path: str | os.PathLike, index: int, *, device: DeviceLike | None = None,
                    weights: Any = None, model: nn.Module | None = None,
                    functions: Sequence[Callable] = (),
                    trust_pickle: bool = False) -> tuple[Plan, Stage]:
    """The plan saved at `path` without weights (its wiring, calling convention, chunks and
    schedule: what a process running one stage needs to know of the others), and its stage
    `index` with that stage's own weights, on `device` when given (see `load_stage`)."""
    root, document = _checked(path, index, trust_pickle)
    plan = _load_skeleton(root, document, functions, model)
    if not 0 <= index < len(plan.stages):
        raise PlanFileError(f"the plan at {str(root)!r} has stages 0 to {len(plan.stages) - 1}, "
                            f"not {index}")
    if device is not None:
        plan = _moved(plan, {index: parse_devices(device)[0]}, f"the plan at {str(root)!r}")
    stage = plan.stages[index]
    loaded: _Loaded = {}
    _fill(root, stage, document, loaded, weighed=weights is not None)
    if weights is not None:
        _read_stage(stage, _opened(weights), _non_persistent(plan), _names(plan), loaded,
                    model)
    return plan, stage


def save_stage_weights(plan: Plan, directory: str | os.PathLike, stages: Sequence[int], *,
                       tied: Mapping[tuple[int, str], str] | None = None,
                       write_index: bool = True, max_shard_bytes: int | None = None) -> Path:
    """Write the tensors of `plan`'s stages numbered `stages` (all of them in one process, one
    under torchrun) into `directory` as `fxpipe.weights.save_weights` does: the model's names,
    parameters and persistent buffers only, Hugging Face sharded safetensors, each stage its own
    shards, a tied tensor once; and, with `write_index`, the index of every stage's shards.
    The layout is computed from every stage's names, shapes and dtypes alone (the other stages
    may hold stand-ins on meta), so every rank computes the same one. `tied` names the tensors a
    stage holds that another stage stores, (stage, name) -> the stored name (a saved plan's
    `shared` entries: with stages holding copies on different devices, sameness is not seen).
    """
    skip, tied = _non_persistent(plan), tied or {}
    groups: list[dict[str, torch.Tensor]] = []
    tied_names: dict[str, str] = {}
    for stage in plan.stages:
        group: dict[str, torch.Tensor] = {}
        for name, tensor in _tensors(stage.module):
            if name in skip:
                continue
            if tied.get((stage.index, name), name) != name:
                tied_names[name] = tied[stage.index, name]
            else:
                group.setdefault(name, tensor)
        groups.append(group)
    layout = shard_layout(groups, tied=tied_names,
                          max_shard_bytes=max_shard_bytes or MAX_SHARD_BYTES)
    for s in stages:
        save_weights(groups[s], directory, layout=layout, group=s,
                     write_index=write_index and s == stages[-1])
    return Path(directory)


def stored_names(path: str | os.PathLike) -> dict[tuple[int, str], str]:
    """For each tensor a stage of the plan saved at `path` holds under a name another stage
    (or another name of its own) saves it under, (stage, name) -> that name; read off
    plan.json's `shared` entries."""
    return {(stage, name): first_name
            for stage, refs in enumerate(_document(Path(path))["shared"])
            for name, (_, first_name) in refs.items()}


def shared_tensors(path: str | os.PathLike) -> dict[tuple[int, str], dict[int, str]]:
    """The tensors several stages of the plan saved at `path` hold (tied weights), read off
    plan.json's `shared` entries: each one's first holder `(stage, name)` -> every stage holding
    it -> a name it has there (a stage holding it under several names: its first)."""
    holders: dict[tuple[int, str], dict[int, str]] = {}
    for stage, refs in enumerate(_document(Path(path))["shared"]):
        for name, (first, first_name) in refs.items():
            held = holders.setdefault((first, first_name), {first: first_name})
            held.setdefault(stage, name)
    return {key: held for key, held in holders.items() if len(held) > 1}


def stage_count(path: str | os.PathLike) -> int:
    """How many stages the plan saved at `path` has, read off its plan.json (checked for
    format and versions, no weights read)."""
    return len(_document(Path(path))["stages"])


def planned_device(path: str | os.PathLike, index: int) -> torch.device:
    """The device stage `index` of the plan saved at `path` was planned for, read off its
    plan.json."""
    return torch.device(_document(Path(path))["stages"][index]["device"])


# ---- writing ------------------------------------------------------------------------------------

def _without_weights(plan: Plan) -> bool:
    """Whether some stage of `plan` holds a tensor on meta (shape and dtype, no values)."""
    return any(t.is_meta for stage in plan.stages for _, t in _tensors(stage.module))


def _picklable(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    """`stages` as they pickle without losing what they run: an exported graph's autocast and
    grad-mode regions as module calls (`regions_as_modules`), tensors shared."""
    return tuple(dataclasses.replace(stage, module=regions_as_modules(stage.module))
                 for stage in stages)


class _without_tensors:
    """Inside, `modules` hold empty ("meta") stand-ins for their parameters and buffers (but
    those whose id is in `keep`), so that pickling them writes their structure only; restored
    on exit."""

    def __init__(self, modules: list[nn.Module], keep: set[int] = frozenset()):
        self.modules = modules
        self.keep = keep
        self.saved: list[tuple[dict, str, torch.Tensor]] = []

    def __enter__(self):
        stand_ins: dict[int, torch.Tensor] = {}
        for module in self.modules:
            for owner in module.modules():
                for table in (owner._parameters, owner._buffers):
                    for name, tensor in table.items():
                        if tensor is None or id(tensor) in self.keep:
                            continue
                        if id(tensor) not in stand_ins:
                            stand_ins[id(tensor)] = _stand_in(tensor)
                        self.saved.append((table, name, tensor))
                        table[name] = stand_ins[id(tensor)]
        return self

    def __exit__(self, *exc):
        for table, name, tensor in self.saved:
            table[name] = tensor


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor on meta of `tensor`'s shape and dtype (a Parameter for a Parameter)."""
    empty = torch.empty_like(tensor, device="meta")
    return nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _write_torch(path: Path, obj: Any) -> str:
    torch.save(obj, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- reading ------------------------------------------------------------------------------------

def _load_skeleton(root: Path, document: dict[str, Any], functions: Sequence[Callable] = (),
                   model: nn.Module | None = None) -> Plan:
    """The plan saved in `root`, its stages holding meta stand-ins, their non-persistent
    buffers marked as such (from the manifest), so that they stay out of `state_dict`: rebuilt
    from its data (`plan_format`), or unpickled from a plan of a pickled format (trusted)."""
    if document["format"] in PICKLED_FORMATS:
        plan = regrouped(unpickled(root / PICKLE_FILE))
        vars(plan).setdefault("observed", {})       # saved before plans had it
    else:
        try:
            data = json.loads((root / DATA_FILE).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanFileError(f"{root / DATA_FILE} is not valid JSON ({e})\n"
                                f"save the plan again") from None
        plan = decode_plan(data, functions=functions, model=model,
                           where=f"the plan at {str(root)!r}")
    _mark_non_persistent(plan.stages, {name for entries in document["weights"]["stages"]
                                       for name, entry in entries.items()
                                       if not entry["persistent"]})
    return plan


def _mark_non_persistent(stages: Sequence[Stage], names: set[str]) -> None:
    """Mark the buffers `stages` hold under `names` non-persistent (out of `state_dict`)."""
    for stage in stages:
        for path, owner in stage.module.named_modules(remove_duplicate=False):
            for name in owner._buffers:
                if ".".join(filter(None, (path, name))) in names:
                    owner._non_persistent_buffers_set.add(name)


def _on_devices(plan: Plan, devices: Sequence[DeviceLike], what: str) -> Plan:
    """`plan` with stage `s` on `devices[s]` (`_moved`), once stages sharing a tensor (a tied
    weight) are put on one device."""
    specs = parse_devices(devices)
    if len(specs) != len(plan.stages):
        raise DeviceError(f"devices= names {len(specs)} devices for the {len(plan.stages)} "
                          f"stages of {what}\ngive one per stage")
    moved = _moved(plan, dict(enumerate(specs)), what)
    first_holder: dict[int, tuple[Stage, str]] = {}
    for stage in moved.stages:
        for name, tensor in _tensors(stage.module):
            first, _ = first_holder.setdefault(id(tensor), (stage, name))
            if not same_memory(first.device, stage.device):
                raise DeviceError(
                    f"stages {first.index} and {stage.index} of {what} share the tied {name!r}"
                    f"\nbut devices= puts them on {first.device} and {stage.device}: a "
                    f"tensor lives on one device; give those stages the same one")
    return moved


def _moved(plan: Plan, specs: dict[int, DeviceSpec], what: str) -> Plan:
    """`plan` with stage `s` on `specs[s]` (not filled yet), once the stages put on each device
    fit its memory together."""
    sharing: dict[str, list[int]] = {}
    for s, spec in specs.items():
        sharing.setdefault(spec.name, []).append(s)
    for name, stages in sharing.items():
        need = sum(plan.partition.stages[s].memory_bytes for s in stages)
        memory = min(specs[s].memory_bytes for s in stages)
        if need > memory:
            which = (f"stage {stages[0]}" if len(stages) == 1 else
                     f"stages {', '.join(map(str, stages[:-1]))} and {stages[-1]}")
            raise DeviceError(f"{which} of {what} need"
                              f"{'s' if len(stages) == 1 else ''} {format_bytes(need)}; "
                              f"{name} has {format_bytes(memory)}\nthat is the planned need; give "
                              f"{'it' if len(stages) == 1 else 'them'} a device with more memory, "
                              f"or plan the model again for these devices")
    stages = tuple(dataclasses.replace(stage, device=torch.device(specs[s].name))
                   if s in specs else stage for s, stage in enumerate(plan.stages))
    # A CPU given without a thread count keeps the stage's planned one.
    devices = tuple(d if s not in specs else dataclasses.replace(specs[s], threads=d.threads)
                    if specs[s].threads is None and is_cpu(specs[s].name) and is_cpu(d.name)
                    else specs[s] for s, d in enumerate(plan.partition.devices))
    return dataclasses.replace(plan, stages=stages,
                               partition=dataclasses.replace(plan.partition, devices=devices))


_Loaded = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""Tensors put in stages: id(stand-in) -> (the stand-in, kept alive so its id names no other
tensor; the tensor in its place). A stand-in several stages hold (a tied weight) is read once."""


def _fill(root: Path, stage: Stage, document: dict[str, Any], loaded: _Loaded, *,
          weighed: bool) -> None:
    """Put in stage's stand-ins the tensors the plan's stage files hold (a shared one from its
    holder's file, or from `loaded` when that stage was filled already), but, when `weighed`
    (its weights come from a checkpoint), only non-persistent buffers and constants; then, once
    no stand-in is left, place the stage on its device (tensor constants its code made as it
    loaded, devices its code names). Stand-ins with no saved values stay for `_read_stage`."""
    files: dict[int, dict[str, torch.Tensor]] = {}
    refs, entries = document["shared"][stage.index], document["weights"]["stages"]

    def value(s: int, name: str) -> torch.Tensor | None:
        entry = entries[s][name]
        if not entry["saved"] or (weighed and entry["persistent"]):
            return None
        if s not in files:
            # torch.load restores to "cpu", never to "cpu:1" (one memory: a plan's CPU names)
            where = "cpu" if is_cpu(stage.device) else stage.device
            files[s] = _tensor_file(root / f"stage_{s}.pt", where)
        return files[s][name]

    for qualified, stand_in in _tensors(stage.module):
        if stand_in.is_meta and id(stand_in) not in loaded:
            found = value(*refs.get(qualified, (stage.index, qualified)))
            if found is not None:
                loaded[id(stand_in)] = (stand_in, nn.Parameter(found, stand_in.requires_grad)
                                        if isinstance(stand_in, nn.Parameter) else found)
    _put(stage, loaded)


def _tensor_file(file: Path, where: Any) -> dict[str, torch.Tensor]:
    """A stage file's tensors, read with `weights_only`: one holding more (a pickled object,
    whose loading would run code) is refused."""
    try:
        tensors = torch.load(file, map_location=where, weights_only=True)
    except pickle.UnpicklingError as e:
        raise PlanFileError(f"{file} holds more than tensors\na pickled object, which "
                            f"loading would run: {str(e).splitlines()[0]}\nsave the plan again "
                            f"from the model; load no plan of unknown origin that holds "
                            f"one") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor)
                                                for t in tensors.values()):
        raise PlanFileError(f"{file} holds no tensors by name\nsave the plan again")
    return tensors


def _put(stage: Stage, loaded: _Loaded) -> None:
    """Put `loaded` tensors in place of stage's stand-ins; place the stage on its device once
    none is left."""
    for owner in stage.module.modules():
        for table in (owner._parameters, owner._buffers):
            for name, held in table.items():
                if held is not None and id(held) in loaded and loaded[id(held)][0] is held:
                    table[name] = loaded[id(held)][1]
    if not any(t.is_meta for _, t in _tensors(stage.module)):
        place(stage.module, stage.device)


def _opened(weights: Any) -> Any:
    return open_weights(weights)


def _weighed(plan: Plan, weights: Any, loaded: _Loaded, model: nn.Module | None) -> Plan:
    """`plan`, its stages' stand-ins read from `weights` (`_read_stage`), stage by stage."""
    source, non_persistent, names = _opened(weights), _non_persistent(plan), _names(plan)
    for stage in plan.stages:
        _read_stage(stage, source, non_persistent, names, loaded, model)
    return plan


def _names(plan: Plan) -> dict[int, list[str]]:
    """Every name each tensor of `plan`'s stages has, in any stage, by id: a tied weight's
    names (a checkpoint stores it under one of them)."""
    names: dict[int, list[str]] = {}
    for stage in plan.stages:
        for name, tensor in _tensors(stage.module):
            if name not in names.setdefault(id(tensor), []):
                names[id(tensor)].append(name)
    return names


def _read_stage(stage: Stage, source: Any, non_persistent: set[str],
                names: dict[int, list[str]], loaded: _Loaded, model: nn.Module | None) -> None:
    """Put in stage's stand-ins the tensors `source` (a `fxpipe.weights.Weights`) gives for
    its persistent ones, a tied one under any of its `names`, and those `fxpipe.weights.Init`
    computes for its non-persistent buffers (no checkpoint holds them), read straight to its
    device, each stand-in read once; then place the stage there."""
    like = {name: t for name, t in _tensors(stage.module) if t.is_meta and id(t) not in loaded}
    persistent = {alias: t for name, t in like.items() if name not in non_persistent
                  for alias in names.get(id(t), [name])}
    computed = {name: t for name, t in like.items() if name in non_persistent}
    values = _drawn_by(source, stage, model).read(persistent, stage.device) if persistent else {}
    if computed:
        values.update(_drawn_by(_init_of(source), stage, model).read(computed, stage.device))
    for name, stand_in in like.items():
        if id(stand_in) not in loaded:
            loaded[id(stand_in)] = (stand_in, nn.Parameter(values[name], stand_in.requires_grad)
                                    if isinstance(stand_in, nn.Parameter) else values[name])
    _put(stage, loaded)


def _init_of(source: Any) -> Any:
    """`source` when it initialises (an `Init`), else the model's own initialisation."""
    return source if isinstance(source, Init) else Init()


def _drawn_by(source: Any, stage: Stage, model: nn.Module | None) -> Any:
    """`source`, or for an `Init` given no model (`weights="init"`) one drawing from `model`
    when given (its structure: built on meta is fine), else from the stage's own modules: the
    model's classes where the capture kept them whole (`nn.Linear`, `nn.Embedding`), under
    the model's module paths, so with the values `Init(model)` draws."""
    if not isinstance(source, Init) or source.model is not None or source.build is not None:
        return source
    return Init(stage.module if model is None else model, source.seed)


def _take_weights(plan: Plan, model: nn.Module, root: Path) -> None:
    """Copy `model`'s parameters and buffers into the plan's stages, by the model's names; a
    tensor of the plan in no `state_dict` (a tensor constant of the graph) that the model lacks
    keeps the plan's value."""
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    constants = _non_persistent(plan) - set(state)
    problems = []
    for stage in plan.stages:
        for name, tensor in _tensors(stage.module):
            theirs = state.get(name)
            if theirs is None and name not in constants:
                problems.append(f"{name!r} is not in the model")
            elif theirs is None:
                continue
            elif theirs.shape != tensor.shape or theirs.dtype != tensor.dtype:
                problems.append(f"{name!r} is {tuple(theirs.shape)} {theirs.dtype} in the model, "
                                f"{tuple(tensor.shape)} {tensor.dtype} in the plan")
    if problems:
        raise PlanFileError(f"the plan at {str(root)!r} is for another model\n"
                            f"{'; '.join(problems[:3])}" +
                            (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "") +
                            "\nplan this model, or load the plan without model=")
    with torch.no_grad():
        for stage in plan.stages:
            for name, tensor in _tensors(stage.module):
                if name in state:
                    tensor.copy_(state[name])
