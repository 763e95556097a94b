"""GraphModule + stage assignment -> one ordinary GraphModule per stage.

Stage `s` is a GraphModule whose placeholders are the values it reads from outside (graph inputs,
values of earlier stages), named as in the original graph, and whose output is the tuple of values
that later stages or the graph's output need. Nodes keep their names, order and `meta`, so
`print(stage.code)` reads like the slice of the model it is. The input graph is not modified.

A `get_attr` node (how export graphs read parameters) is copied into every stage that reads it
on its parameter's device, so those stages hold the parameters they use; a stage on another
device receives it from the parameter's home stage. Higher-order ops' bodies
(sub-GraphModules) go with the stage that calls them, and `place` points the devices written
into ops (`arange(..., device=cpu)`) at the stage's own device. No tensor is ever moved: a stage
holds the model's own parameters and buffers where they already are on its device, and copies
placed there otherwise (`place`).

Grad-mode regions the tracer recorded are written into each stage (`_grad_regions`). Placement
never moves the model's tensors: the modules on the way to a copied tensor are the stage's shallow
copies, so the model's modules keep theirs, and a copied Parameter stays a Parameter, owned by the
pipeline. Copies are remembered per (tensor, device) with the recipe, so a tensor has one copy per
device: tied weights stay tied, and the train and eval pipelines share them (a tensor the two modes
place on different devices has a copy on each, its values carried over when the mode switches). The
pipeline's module holds what the stages hold, under the model's names (`held_by_stages`). Devices
written in graphs (`device=cpu`, `x.to("cuda:1")`) become the stage's. A parameter read
(`get_attr`) is copied into each stage reading it on its home's device (home: the first stage using
it) and sent, like a value, to readers on other devices, so its gradient returns home; a submodule
called from two devices is an error. Measuring on another device than the graph's tensors runs a
copy placed there (`placed_copy`), dropped after. The two modes' stages share the copies;
where they hold different ones, `carry_values` gives the mode switched to the other's values.

Example (two stages of four layers, run one after the other, equal the graph):

>>> import torch
>>> from torch import fx, nn
>>> from fxpipe.passes.codegen import split_stages
>>> gm = fx.symbolic_trace(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]))
>>> stages = split_stages(gm, {"_0": 0, "_1": 0, "_2": 1, "_3": 1}, ["cpu", "cpu"])
>>> stages[0].outputs, stages[1].inputs
(('_1',), ('_1',))
>>> x = torch.randn(2, 4)
>>> (y,) = stages[1].module(*stages[0].module(x))
>>> torch.equal(y, gm(x))
True
"""

from __future__ import annotations

import copy
import types
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from .device import same_memory
from .errors import DeviceError, PartitionError
from .graph_values import attr_value
from .stage import Stage


class StageTracer(fx.Tracer):
    """What rebuilds a stage's graph from its code when a pickled stage is loaded (a GraphModule
    pickles its code, not its graph, and traces the code again): every Python function the code
    calls stays one call, as in the graph, rather than being traced through. Without it
    fxpipe's `seeded` draws were traced through into plain dropout, drawing other numbers, and
    functions the user kept whole with `torch.fx.wrap` were inlined. Buffers are read as graph
    values too: a loaded stage's tensors are empty stand-ins while its code is traced, so an op
    combining a buffer with a constant (`arange(8) * self.offset`) must stay a node, not run."""

    proxy_buffer_attributes = True

    def trace(self, root, concrete_args=None):
        forward = getattr(root, "forward", root)
        self._autowrap_function_ids |= {id(v) for v in getattr(forward, "__globals__", {}).values()
                                         if isinstance(v, types.FunctionType)}
        return super().trace(root, concrete_args)


def split_stages(gm: fx.GraphModule, stage_of: Mapping[str, int],
                 devices: Sequence[str | torch.device], *,
                 send_parameters: bool = False, placed: Placed | None = None) -> list[Stage]:
    """Split `gm` into `len(devices)` stages, stage `s` holding the nodes with `stage_of[n] == s`.

    Every node but placeholders and the output needs a stage, and no node may read a value of a
    later stage. A `get_attr` node needs no stage of its own (given one, it stays there only when
    nothing reads it; a graph output without one comes from the last stage): it is copied into
    each stage that reads it on the device of the parameter's home, the first stage using the
    parameter; stages on other devices receive it from the home stage, like any value, so its
    gradients flow back to the one Parameter (`send_parameters` sends it to every other stage,
    even on the same device). Each stage is `place`d on its device (`placed`: the copies made so
    far, shared across calls); a submodule called by stages on different devices is an error.
    """
    devices = [torch.device(d) for d in devices]
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    _check(nodes, stage_of, len(devices))
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    graph_outputs = set(output.all_input_nodes)
    owner = {n: stage_of.get(n.name, len(devices) - 1) for n in nodes}   # the one that sends it
    home = _homes(gm, nodes, stage_of, owner)
    where = {}                                                           # the stages that hold it
    for n in nodes:
        where[n] = _stages_holding(n, stage_of, owner[n])
        if n.op == "get_attr" and id(attr_value(gm, n.target)) in home:
            h = owner[n] = home[id(attr_value(gm, n.target))]
            local = {s for s in where[n]
                     if same_memory(devices[s], devices[h]) and not send_parameters}
            where[n] = local | ({h} if n in graph_outputs or local != where[n] else set())

    stages = []
    for s, device in enumerate(devices):
        members = [n for n in nodes if s in where[n]]
        inputs = list(dict.fromkeys(p for n in members for p in n.all_input_nodes
                                    if p.op == "placeholder" or s not in where[p]))
        outputs = [n for n in members if owner[n] == s and (n in graph_outputs or any(
            u.op != "output" and stage_of[u.name] not in where[n] for u in n.users))]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for p in inputs:
            env[p] = graph.placeholder(p.name)
            env[p].meta = dict(p.meta)
        for n in members:
            env[n] = graph.node_copy(n, lambda p: env[p])
        _grad_regions(graph)
        graph.output(tuple(env[n] for n in outputs))
        graph._tracer_cls = StageTracer
        module = _own_op_bodies(fx.GraphModule(gm, graph, class_name=f"Stage{s}"))
        stages.append(Stage(s, module, tuple(p.name for p in inputs), tuple(n.name for n in outputs),
                            device))
    _move(stages, {} if placed is None else placed)
    return stages


Placed = dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]]
"""Copies made by `place`: (id of the tensor, device) -> (the tensor, its copy on that device)."""


def place(gm: fx.GraphModule, device: str | torch.device,
          placed: Placed | None = None) -> fx.GraphModule:
    """Make `gm` run on `device`, moving no tensor: modifies `gm` and returns it.

    A parameter or buffer already on `device` stays itself; one elsewhere is replaced in `gm` by
    a copy on `device` (a Parameter stays a Parameter), and every module on the way to it by a
    shallow copy of its own, so a module that `gm` shares with the model keeps the model's
    tensors. `placed` remembers the copies (pass the same dict to several calls), so a tensor
    read by several modules or stages, or placed again, has one copy there: tied weights stay
    tied. Ops that name a device (`arange(8, device=cpu)` in an export graph, `x.to("cuda:1")`,
    `zeros(3, device="cpu")` in an fx graph), in `gm`'s graph and its op bodies, name `device`.
    """
    device = torch.device(device)
    placed = {} if placed is None else placed
    _replace_tensors(gm, lambda t: _placed_tensor(t, device, placed), {id(gm): gm})
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        changed = False
        for n in module.graph.nodes:
            if _named_devices(n):
                n.args, n.kwargs = _map_devices(n, lambda _: device)
                changed = True
        if changed:
            module.recompile()
    return gm


def placed_copy(gm: fx.GraphModule, device: str | torch.device) -> fx.GraphModule:
    """`gm` itself where it runs on `device` as it is; otherwise a copy of it (its own graph,
    same node names and meta) `place`d there, for a pass to run and drop: `gm`, and the model
    whose tensors it holds, stay as they are."""
    device = torch.device(device)
    if all(same_memory(t.device, device) for t in [*gm.parameters(), *gm.buffers()]) and all(
            named == device for m in gm.modules() if isinstance(m, fx.GraphModule)
            for n in m.graph.nodes for named in _named_devices(n)):
        return gm
    copied = _own_op_bodies(fx.GraphModule(gm, _copy_of(gm.graph), class_name=type(gm).__name__))
    copied.meta = dict(gm.meta)
    return place(copied, device)


def held_by_stages(gm: fx.GraphModule, stages: Sequence[Stage]) -> fx.GraphModule:
    """`gm` holding, under each name, the tensor the stages hold under it (a copy where a stage
    was placed away from the tensor): what the pipeline's parameters and buffers are, under the
    model's names. Modifies `gm` (as `place` does: the model keeps its own) and returns it."""
    held = {name: t for stage in stages
            for name, t in [*stage.module.named_parameters(remove_duplicate=False),
                            *stage.module.named_buffers(remove_duplicate=False)]}
    by_id = {id(t): held[name] for name, t in [*gm.named_parameters(remove_duplicate=False),
                                                *gm.named_buffers(remove_duplicate=False)]
             if name in held}
    return _replace_tensors(gm, lambda t: by_id.get(id(t), t), {id(gm): gm})


def carry_values(source: nn.Module, target: nn.Module) -> None:
    """`target`'s tensors given `source`'s values where the two hold other tensors under one
    name (the two modes' stages placed copies of it on different devices), so the mode switched
    to computes with what the other one trained."""
    held = dict([*source.named_parameters(remove_duplicate=False),
                 *source.named_buffers(remove_duplicate=False)])
    with torch.no_grad():
        for name, t in [*target.named_parameters(remove_duplicate=False),
                        *target.named_buffers(remove_duplicate=False)]:
            if name in held and held[name] is not t:
                t.copy_(held[name])


def with_tensors(module: nn.Module,
                 replacement: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """`module` holding `replacement(t)` for each of its tensors `t`: a shallow copy wherever
    one changes (the module itself where none does), so `module` keeps its own."""
    return _replace_tensors(module, replacement, {})


def _replace_tensors(module: nn.Module, replacement: Callable[[torch.Tensor], torch.Tensor],
                     done: dict[int, nn.Module]) -> nn.Module:
    """`module` holding `replacement(t)` for each of its tensors `t`: itself, modified in place
    when it is the root (`done` starts with it), or else a shallow copy where any of its tensors
    (or its children's) is replaced. `done` maps each module seen to its result (shared modules
    stay shared)."""
    root = id(module) in done
    children = {name: done[id(c)] if id(c) in done else _replace_tensors(c, replacement, done)
                for name, c in module._modules.items() if c is not None}
    tensors = {table: {name: replacement(t)
                       for name, t in getattr(module, table).items() if t is not None}
               for table in ("_parameters", "_buffers")}
    same = all(children[k] is module._modules[k] for k in children) and all(
        t is getattr(module, table)[name] for table, new in tensors.items()
        for name, t in new.items())
    result = module
    if not same and not root:
        if isinstance(module, fx.GraphModule):     # its own graph (and class), to rewrite
            result = fx.GraphModule(module, _copy_of(module.graph),
                                    class_name=type(module).__name__)
        else:
            result = type(module).__new__(type(module))
            result.__dict__.update(module.__dict__)
    if not same:       # new dicts: the original module keeps its own
        result.__dict__["_modules"] = {**result._modules, **children}
        for table, new in tensors.items():
            result.__dict__[table] = {**getattr(result, table), **new}
    done[id(module)] = result
    return result


def _placed_tensor(t: torch.Tensor, device: torch.device, placed: Placed) -> torch.Tensor:
    """`t` if it is usable on `device` as it is (`same_memory`), else its one copy there. A meta
    tensor has no values to copy: it stays itself, wherever it is placed (its values are given
    when the stage runs)."""
    if same_memory(t.device, device) or t.is_meta:
        return t
    key = (id(t), device)
    if key not in placed:
        moved = t.detach().to(device)
        moved = (nn.Parameter(moved, requires_grad=t.requires_grad)
                 if isinstance(t, nn.Parameter) else moved.requires_grad_(t.requires_grad))
        placed[key] = (t, moved)      # `t` kept alive: its id names no other tensor
    return placed[key][1]


def _map_devices(n: fx.Node, fn: Callable[[torch.device], object]) -> tuple[tuple, dict]:
    """`n`'s args and kwargs with `fn(device)` for every device they name: a torch.device
    anywhere, or a string given as `device=` or as the device of a `.to(...)` call."""
    args, kwargs = fx.node.map_aggregate(
        (n.args, n.kwargs), lambda v: fn(v) if isinstance(v, torch.device) else v)
    if isinstance(kwargs.get("device"), str) and _names_device(kwargs["device"]):
        kwargs = {**kwargs, "device": fn(torch.device(kwargs["device"]))}
    if n.op == "call_method" and n.target == "to":
        args = tuple(fn(torch.device(a)) if isinstance(a, str) and _names_device(a) else a
                     for a in args)
    return args, kwargs


def _named_devices(n: fx.Node) -> list[torch.device]:
    """The devices `n`'s args and kwargs name (see `_map_devices`)."""
    named: list[torch.device] = []
    _map_devices(n, named.append)
    return named


def _names_device(text: str) -> bool:
    try:
        torch.device(text)
    except RuntimeError:
        return False
    return True


def _copy_of(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph`: the same node names, order and meta (shallow copies), and the same
    code generator, which no pass changes (deep-copying an export graph's pytree specs warns)."""
    copied = fx.Graph(tracer_cls=graph._tracer_cls)
    copied._codegen = graph._codegen
    output, old = copied.graph_copy(graph, {}, return_output_node=True)
    copied.output(output, type_expr=old.type).meta = dict(old.meta)
    return copied


def _own_op_bodies(module: fx.GraphModule) -> fx.GraphModule:
    """`module` with its own copy of each op body (a stateless child GraphModule), which
    `place` may rewrite; returns it."""
    for name, child in module.named_children():
        if isinstance(child, fx.GraphModule) and not _has_state(child):
            setattr(module, name, copy.deepcopy(child))
    return module


def _grad_regions(graph: fx.Graph) -> None:
    """Run nodes traced under an explicit grad mode (`node.meta["grad_enabled"]`, see
    `fxpipe.passes.capture`: `with torch.no_grad():` in forward) in that mode, and the rest in the caller's.

    Each maximal run of nodes with the same explicit mode (reads of parameters join any run)
    becomes, in the stage's code:

        grad_enabled = torch.is_grad_enabled()
        no_grad = torch._C._set_grad_enabled(False)
        ...
        end_no_grad = torch._C._set_grad_enabled(grad_enabled)

    A region that a stage boundary cuts ends with the stage and opens again in the next one.
    """
    runs: list[list] = []                          # [mode, first node, last node]
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        mode = n.meta.get("grad_enabled")
        if runs and runs[-1][0] == mode:
            runs[-1][2] = n
        else:
            runs.append([mode, n, n])
    for mode, first, last in runs:
        if mode is None:
            continue
        region = "enable_grad" if mode else "no_grad"
        with graph.inserting_before(first):
            caller_mode = graph.call_function(torch.is_grad_enabled, name="grad_enabled")
            graph.call_function(torch._C._set_grad_enabled, (mode,), name=region)
        with graph.inserting_after(last):
            graph.call_function(torch._C._set_grad_enabled, (caller_mode,), name=f"end_{region}")


def _stages_holding(n: fx.Node, stage_of: Mapping[str, int], owner: int) -> set[int]:
    """The stages that hold `n`: its own, or for a get_attr, every stage that reads it."""
    if n.op != "get_attr":
        return {stage_of[n.name]}
    readers = {stage_of[u.name] if u.op != "output" else owner for u in n.users}
    return readers or ({stage_of[n.name]} if n.name in stage_of else set())


def _homes(gm: fx.GraphModule, nodes: Sequence[fx.Node], stage_of: Mapping[str, int],
           owner: Mapping[fx.Node, int]) -> dict[int, int]:
    """The home of each parameter and buffer (by id): the first stage that uses it."""
    home: dict[int, int] = {}
    for n in nodes:
        if n.op == "call_module":
            module = gm.get_submodule(n.target)
            for t in list(module.parameters()) + list(module.buffers()):
                home[id(t)] = min(home.get(id(t), stage_of[n.name]), stage_of[n.name])
        elif n.op == "get_attr" and isinstance(attr_value(gm, n.target), torch.Tensor):
            for s in _stages_holding(n, stage_of, owner[n]):
                home[id(attr_value(gm, n.target))] = min(home.get(id(attr_value(gm, n.target)), s), s)
    return home


def _has_state(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _check(nodes: Sequence[fx.Node], stage_of: Mapping[str, int], num_stages: int) -> None:
    for n in nodes:
        if n.name not in stage_of and n.op == "get_attr":
            continue                   # copied into the stages that read it
        if n.name not in stage_of:
            raise PartitionError(f"node {n.name!r} has no stage; every node needs one")
        if not 0 <= stage_of[n.name] < num_stages:
            raise PartitionError(f"node {n.name!r} is in stage {stage_of[n.name]}, "
                                 f"outside 0..{num_stages - 1}")
        for p in n.all_input_nodes:
            if p.op not in ("placeholder", "get_attr") and stage_of[p.name] > stage_of[n.name]:
                raise PartitionError(
                    f"node {n.name!r} reads {p.name!r} from a later stage\nnode {n.name!r} is "
                    f"in stage {stage_of[n.name]}, {p.name!r} in the later stage "
                    f"{stage_of[p.name]}; stages may only pass values forward")


def _move(stages: Sequence[Stage], placed: Placed) -> None:
    """Place every stage on its device (copies in `placed`), refusing to split a shared module."""
    home: dict[int, Stage] = {}
    for stage in stages:
        for name, t in list(stage.module.named_parameters()) + list(stage.module.named_buffers()):
            first = home.setdefault(id(t), stage)
            if not same_memory(first.device, stage.device):
                raise DeviceError(
                    f"{name!r} is used on two devices, {first.device} and {stage.device}\nby "
                    f"stage {first.index} on {first.device} and by stage {stage.index} on "
                    f"{stage.device}, inside a submodule both call: a "
                    f"parameter lives on one device; place those stages on the same device")
    for stage in stages:
        place(stage.module, stage.device, placed)
