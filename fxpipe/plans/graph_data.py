"""Stages as data: what a saved plan holds of its GraphModules, rebuilt without running its code.

A GraphModule pickles as its generated code, and unpickling runs code: whoever writes a plan's
directory would choose what `load_plan` runs. A plan of format 5 holds each stage instead as
data (JSON), and `decode_module` rebuilds it node by node (`torch.fx.Graph`), resolving every
name it reads only through closed tables:

- call_function targets: ATen ops (`torch.ops.aten.<op>.<overload>`) and the two higher-order
  ops of autocast and grad-mode regions; the tensor functions torch lets fx record
  (`torch.overrides.get_overridable_functions`: `torch.relu`, `torch.nn.functional.linear`,
  `torch.Tensor.add`), no dunders; `operator`'s arithmetic, comparisons and item access;
  `math`; `getattr` of a public tensor attribute (`x.shape`); `torch.is_grad_enabled`, the grad
  switch fxpipe's grad regions call, and fxpipe's `seeded`. A function the user kept whole
  (`torch.fx.wrap`) is named by `module.qualname` and taken from `functions=` at load, never
  imported. call_method targets: public `Tensor` methods.
- get_attr and call_module targets: the plan's own parameters, buffers and submodules only.
- modules: `torch.nn`'s own classes (`torch.nn.Linear`, by that name; `torch.nn.Module` for a
  plain holder) rebuilt from their attributes (plain data) and the plan's tensors; fxpipe's
  `Region` and `Recomputed`; GraphModules (op bodies) as graphs. A module of another class
  (kept whole by capture "fx+leaves") is taken from `model=` at load, under its name there.
- values (node arguments, module attributes, tree specs): None, bools, numbers, strings,
  tuples, lists, dicts, slices, dtypes, devices, layouts, memory formats, functions of the
  table above, and the dataclasses and enums of the caller's `types` (by the names it gives).

Tensors are no part of it: a module record names each of its tensors by an index into the
plan's table of tensors (shape, dtype, whether a Parameter), made as meta stand-ins here and
filled from the stage files (`weights_only`). Nothing here imports a module by a name it reads.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import keyword
import math
import operator
import re
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled

from fxpipe.passes.capture.regions import Region
from fxpipe.passes.codegen import StageTracer
from fxpipe.passes.errors import PlanFileError
from fxpipe.passes.randomness import seeded
from fxpipe.passes.recompute import Recomputed
from fxpipe.passes.signature import VarArgsCodeGen

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_OPERATOR = ("add sub mul truediv floordiv mod pow matmul neg pos abs invert not_ and_ or_ xor "
             "lshift rshift eq ne lt le gt ge getitem setitem contains is_ is_not truth index "
             "iadd isub imul itruediv ifloordiv imod ipow imatmul iand ior ixor ilshift irshift "
             "concat").split()
_NAMESPACES = {torch: "torch", torch.Tensor: "torch.Tensor", torch.nn.functional:
               "torch.nn.functional", torch.linalg: "torch.linalg", torch.fft: "torch.fft",
               torch.special: "torch.special"}
_HIGHER_ORDER = {"wrap_with_autocast": wrap_with_autocast,
                 "wrap_with_set_grad_enabled": wrap_with_set_grad_enabled}
_OUR_MODULES: dict[str, type] = {"fxpipe.Region": Region, "fxpipe.Recomputed": Recomputed}
_MODULE_KEYS = frozenset(vars(nn.Module()))     # nn.Module's own state: tensors, hooks, children
_table: dict[str, Callable] = {}
_names: dict[int, str] = {}


def _plain(name: str) -> bool:
    """A name that is an identifier and no dunder (`__class__`, `__globals__`)."""
    return bool(_IDENTIFIER.match(name)) and not keyword.iskeyword(name) and \
        not name.startswith("__")


def functions() -> dict[str, Callable]:
    """The functions a plan's nodes may call by name: the closed table (see the docstring)."""
    if not _table:
        for space, listed in torch.overrides.get_overridable_functions().items():
            prefix = _NAMESPACES.get(space)
            for fn in listed if prefix else ():
                name = getattr(fn, "__name__", "")
                if _plain(name) and callable(fn) and getattr(space, name, None) is fn:
                    _table.setdefault(f"{prefix}.{name}", fn)
        _table.update({f"operator.{name}": getattr(operator, name) for name in _OPERATOR})
        _table.update({f"math.{name}": getattr(math, name) for name in dir(math)
                       if not name.startswith("_") and callable(getattr(math, name))})
        _table.update({"getattr": getattr, "torch.is_grad_enabled": torch.is_grad_enabled,
                       "torch._C._set_grad_enabled": torch._C._set_grad_enabled,
                       "fxpipe.seeded": seeded,      # fx's check of an input fixed to None:
                       "torch.fx._assert_is_none": torch.fx._symbolic_trace._assert_is_none})
        _table.update({f"torch.{name}": getattr(torch, name) for name in dir(torch)
                       if name.startswith("sym_") and callable(getattr(torch, name))})
        _table.update({f"torch.ops.higher_order.{name}": op for name, op in _HIGHER_ORDER.items()})
        for name, fn in _table.items():
            _names.setdefault(id(fn), name)
    return _table


def function_name(fn: Callable) -> str:
    """How a plan names `fn`: its name in the table, an ATen op's `torch.ops.aten.add.Tensor`,
    or for any other function (one the user kept whole) `module.qualname`."""
    functions()
    if id(fn) in _names:
        return _names[id(fn)]
    if isinstance(fn, torch._ops.OpOverload):
        return f"torch.ops.{fn.namespace}.{fn._opname}.{fn._overloadname}"
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return f"torch.ops.{fn._qualified_op_name.replace('::', '.')}"
    return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', repr(fn))}"


def resolve_function(name: str, given: Mapping[str, Callable]) -> Callable:
    """The function a plan names `name`: from the table, an ATen op, or one given at load
    (`functions=`, by `function_name`); anything else is refused, naming it."""
    table = functions()
    if name in table:
        return table[name]
    parts = name.split(".")
    if parts[:3] == ["torch", "ops", "aten"] and len(parts) in (4, 5) and \
            all(_IDENTIFIER.match(p) for p in parts[3:]):
        # An op's name may be a dunder (`aten.__and__`): the op registry answers it, and what
        # is no op (`aten.__class__`) is refused by type.
        try:
            op = getattr(torch.ops.aten, parts[3])
            op = getattr(op, parts[4]) if len(parts) == 5 else op
        except (AttributeError, RuntimeError):
            op = None
        if type(op) is not (torch._ops.OpOverload if len(parts) == 5 else
                            torch._ops.OpOverloadPacket):
            raise PlanFileError(f"the plan calls {name}, which is no ATen op of this torch"
                                f"\nsave the plan again with this torch")
        return op
    if name in given:
        return given[name]
    if parts[:2] == ["torch", "ops"]:
        raise PlanFileError(f"the plan calls {name}, an op outside ATen\na plan names no "
                            f"custom op, nor higher-order ops but autocast and grad-mode "
                            f"regions\nplan the model with ATen's ops")
    raise PlanFileError(
        f"the plan calls {name}, which is no torch op a plan may call\nif it is your own "
        f"function kept whole in the graph (torch.fx.wrap), pass it: fxpipe.load_plan(path, "
        f"functions=[{parts[-1]}]); a plan holds no code, and names only torch's ops")


# ---- values ------------------------------------------------------------------------------------

_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values()
           if isinstance(v, torch.dtype)}
_LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
            if isinstance(v, torch.layout)}
_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
            if isinstance(v, torch.memory_format)}


class Codec:
    """Values to JSON data and back. `types`: the dataclasses and enums a value may hold, by
    the names the data calls them (the caller's, not Python paths); `given`: functions (and
    classes) given at load by `function_name`; `nodes`: a graph's nodes so far, by name."""

    def __init__(self, types: Mapping[str, type] = {}, given: Mapping[str, Any] = {}):
        self.types = dict(types)
        self.type_names = {cls: name for name, cls in self.types.items()}
        self.given = dict(given)
        self.nodes: dict[str, fx.Node] | None = None

    def encode(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, str)) and not isinstance(v, enum.Enum):
            return v
        if isinstance(v, enum.Enum):
            return {"enum": self._type_name(v), "value": self.encode(v.value)}
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return v if math.isfinite(v) else {"float": repr(v)}
        if isinstance(v, fx.Node):
            return {"node": v.name}
        if isinstance(v, torch.dtype):
            return {"dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"device": str(v)}
        if isinstance(v, torch.layout):
            return {"layout": str(v).removeprefix("torch.")}
        if isinstance(v, torch.memory_format):
            return {"memory_format": str(v).removeprefix("torch.")}
        if isinstance(v, torch.Size):
            return {"size": [int(d) for d in v]}
        if isinstance(v, slice):
            return {"slice": [self.encode(v.start), self.encode(v.stop), self.encode(v.step)]}
        if v is Ellipsis:
            return {"ellipsis": True}
        if isinstance(v, complex):
            return {"complex": [v.real, v.imag]}
        if isinstance(v, pytree.TreeSpec):
            return {"spec": self._encode_spec(v)}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {"data": self._type_name(v), "fields": {
                f.name: self.encode(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return [self.encode(x) for x in v]
        if isinstance(v, list):
            return {"list": [self.encode(x) for x in v]}
        if isinstance(v, dict):
            return {"dict": [[self.encode(k), self.encode(x)] for k, x in v.items()]}
        if isinstance(v, (set, frozenset)):
            return {"set": [self.encode(x) for x in v]}
        if callable(v) and not isinstance(v, (type, nn.Module)):
            return {"fn": function_name(v)}
        raise PlanFileError(f"a saved plan cannot hold {v!r} (a {type(v).__qualname__})\n"
                            f"it holds data only: numbers, strings, containers, dtypes, "
                            f"devices, torch's functions")

    def _type_name(self, v: Any) -> str:
        if type(v) not in self.type_names:
            raise PlanFileError(f"this plan holds a {type(v).__qualname__}, which a saved plan "
                                f"cannot write as data")
        return self.type_names[type(v)]

    def decode(self, d: Any) -> Any:
        if d is None or isinstance(d, (bool, int, float, str)):
            return d
        if isinstance(d, list):
            return tuple(self.decode(x) for x in d)
        if not isinstance(d, dict) or not d:
            raise PlanFileError(f"a saved plan holds no value like {d!r}")
        tag, body = next(iter(d.items()))
        try:
            return self._decode(tag, body, d)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise PlanFileError(f"a saved plan holds no value like {d!r} ({e})") from None

    def _decode(self, tag: str, body: Any, d: dict) -> Any:
        if tag == "list":
            return [self.decode(x) for x in body]
        if tag == "dict":
            return {self.decode(k): self.decode(x) for k, x in body}
        if tag == "set":
            return {self.decode(x) for x in body}
        if tag == "node":
            if self.nodes is None or body not in self.nodes:
                raise PlanFileError(f"a node of the plan reads {body!r}, no earlier node")
            return self.nodes[body]
        if tag == "float":
            return float(body)
        if tag in ("dtype", "layout", "memory_format"):
            return {"dtype": _DTYPES, "layout": _LAYOUTS, "memory_format": _FORMATS}[tag][body]
        if tag == "device":
            return torch.device(body)
        if tag == "size":
            return torch.Size([int(n) for n in body])
        if tag == "slice":
            return slice(*(self.decode(x) for x in body))
        if tag == "ellipsis":
            return Ellipsis
        if tag == "complex":
            return complex(*body)
        if tag == "spec":
            return self._decode_spec(body)
        if tag == "fn":
            return resolve_function(body, self.given)
        if tag in ("enum", "data"):
            cls = self.types.get(body)
            if cls is None:
                raise PlanFileError(f"the plan holds a {body!r}, no type a plan holds")
            if tag == "enum":
                return cls(self.decode(d["value"]))
            init = {f.name for f in dataclasses.fields(cls) if f.init}
            fields = d["fields"]
            if set(fields) - init:
                raise PlanFileError(f"a {body} of the plan has no field "
                                    f"{sorted(set(fields) - init)[0]!r}")
            return cls(**{name: self.decode(x) for name, x in fields.items()})
        raise PlanFileError(f"a saved plan holds no value like {d!r}")

    # Tree specs: `[type, context, children]`, a leaf as null; a type by name: the containers,
    # a namedtuple's class by name and fields (rebuilt alike where not given), torch's
    # structseqs (`torch.return_types.max`), or a class registered with torch's pytree (a
    # Hugging Face ModelOutput) found among those registered by `module.qualname`.
    _CONTAINERS = {"tuple": tuple, "list": list, "dict": dict,
                   "OrderedDict": collections.OrderedDict, "deque": collections.deque}

    def _encode_spec(self, spec: pytree.TreeSpec) -> Any:
        if spec.is_leaf():
            return None
        children = [self._encode_spec(c) for c in spec.children()]
        names = {cls: name for name, cls in self._CONTAINERS.items()}
        if spec.type in names:
            return [names[spec.type], self.encode(spec.context), children]
        if spec.type is collections.namedtuple:
            cls = spec.context
            return [{"namedtuple": f"{cls.__module__}.{cls.__qualname__}",
                     "fields": list(cls._fields)}, None, children]
        return [{"class": f"{spec.type.__module__}.{spec.type.__qualname__}"},
                self.encode(spec.context), children]

    def _decode_spec(self, d: Any) -> pytree.TreeSpec:
        if d is None:
            return pytree.treespec_leaf()
        kind, context, children = d
        children = [self._decode_spec(c) for c in children]
        if isinstance(kind, str):
            return pytree.TreeSpec(self._CONTAINERS[kind], self.decode(context), children)
        if "namedtuple" in kind:
            name, fields = kind["namedtuple"], [str(f) for f in kind["fields"]]
            cls = self.given.get(name) or collections.namedtuple(name.split(".")[-1], fields)
            return pytree.TreeSpec(collections.namedtuple, cls, children)
        name = kind["class"]
        cls = self.given.get(name) or next(
            (t for t in pytree.SUPPORTED_NODES if f"{t.__module__}.{t.__qualname__}" == name),
            None)
        if cls is None:
            module = name.rpartition(".")[0]
            raise PlanFileError(
                f"the plan's inputs or outputs hold a {name}, a class unknown here\nit is "
                f"registered with torch's pytree as its module is imported\nimport {module} "
                f"before loading the plan, or pass the class: fxpipe.load_plan(path, "
                f"functions=[{name.split('.')[-1]}])")
        return pytree.TreeSpec(cls, self.decode(context), children)


# ---- modules and graphs --------------------------------------------------------------------------

def module_class_name(module: nn.Module) -> str:
    """How a plan names a module's class: `torch.nn.Linear` for torch.nn's own, `fxpipe.Region`
    for fxpipe's, `GraphModule`, or `module.qualname` for any other (the model's own)."""
    cls = type(module)
    if isinstance(module, fx.GraphModule):
        return "GraphModule"
    ours = {c: n for n, c in _OUR_MODULES.items()}
    if cls in ours:
        return ours[cls]
    if _torch_nn_class(f"torch.nn.{cls.__name__}") is cls:
        return f"torch.nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _torch_nn_class(name: str) -> type | None:
    """The torch.nn module class called `name` (`torch.nn.Linear`), else None."""
    short = name.removeprefix("torch.nn.")
    if short == name or not _plain(short):
        return None
    cls = vars(nn).get(short)
    if isinstance(cls, type) and issubclass(cls, nn.Module) and (
            cls is nn.Module or cls.__module__.startswith("torch.nn.modules.")):
        return cls
    return None


def encode_module(module: nn.Module, tensor_index: Callable[[torch.Tensor], int],
                  codec: Codec) -> dict[str, Any]:
    """`module` as data: its class by name, its tensors by index (`tensor_index`), its children,
    and its graph (a GraphModule) or attributes (plain data); a module of a class from outside
    torch.nn and fxpipe is recorded by class and tensors only, to be taken from the model."""
    record: dict[str, Any] = {
        "class": module_class_name(module),
        "parameters": {n: None if t is None else tensor_index(t)       # None: `bias=False`
                       for n, t in module._parameters.items()},
        "buffers": {n: None if t is None else tensor_index(t) for n, t in module._buffers.items()},
        "persistent": [n for n in module._buffers if n not in module._non_persistent_buffers_set],
        "training": module.training}
    if not _rebuilt(record["class"]):        # the model's own: its tensors only
        record["tensors"] = {n: tensor_index(t) for n, t in _all_tensors(module)}
        return record
    record["children"] = {n: encode_module(child, tensor_index, codec)
                          for n, child in module._modules.items() if child is not None}
    if isinstance(module, fx.GraphModule):
        record["graph"] = encode_graph(module.graph, codec)
        record["name"] = type(module).__name__
        return record
    attributes = {}
    for name, value in vars(module).items():
        if name not in _MODULE_KEYS:
            try:
                attributes[name] = codec.encode(value)
            except PlanFileError:         # a value no data holds (LSTM's list of its weights)
                return {**record, "children": {}, "tensors": {
                    n: tensor_index(t) for n, t in _all_tensors(module)},
                    "class": f"{type(module).__module__}.{type(module).__qualname__}"}
    record["attributes"] = attributes
    return record


def _rebuilt(class_name: str) -> bool:
    return class_name == "GraphModule" or class_name in _OUR_MODULES or \
        _torch_nn_class(class_name) is not None


def _all_tensors(module: nn.Module):
    for path, owner in module.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    yield ".".join(filter(None, (path, name))), tensor


def encode_graph(graph: fx.Graph, codec: Codec) -> dict[str, Any]:
    """A graph as data: its nodes in order, `[op, name, target, args, kwargs]`, each target a
    name (a function's by `function_name`), and its code generator's `*args` placeholders."""
    codegen = graph._codegen
    if type(codegen) not in (fx.graph.CodeGen, VarArgsCodeGen):
        raise PlanFileError(f"a stage's code comes from {type(codegen).__qualname__}\na saved "
                            f"plan holds graphs whose code fx writes itself")
    nodes = []
    for n in graph.nodes:
        target = function_name(n.target) if n.op == "call_function" else n.target
        nodes.append([n.op, n.name, target, codec.encode(tuple(n.args)),
                      codec.encode(dict(n.kwargs))])
    return {"nodes": nodes, "stars": dict(getattr(codegen, "stars", {}))}


def decode_module(record: Mapping[str, Any], tensors: Sequence[torch.Tensor], path: str,
                  codec: Codec, model: nn.Module | None, where: str) -> nn.Module:
    """The module `record` describes (at `path` in its stage, the model's name), its tensors
    `tensors[i]` as the record indexes them; a module of the model's own class taken from
    `model`, its tensors replaced by those of the plan (see `encode_module`)."""
    name = record["class"]
    if not _rebuilt(name):
        return _from_model(record, tensors, path, model, where)
    if name == "GraphModule":
        module: nn.Module = fx.GraphModule(nn.Module(), fx.Graph(), _checked_name(record["name"]))
    elif name in _OUR_MODULES:
        module = _OUR_MODULES[name].__new__(_OUR_MODULES[name])
        nn.Module.__init__(module)
    else:
        cls = _torch_nn_class(name)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
    for key, value in record.get("attributes", {}).items():
        if not _plain(key) or key in _MODULE_KEYS or callable(getattr(type(module), key, None)):
            raise PlanFileError(f"{where}: module {path or '(the stage)'} sets {key!r}\nno "
                                f"attribute may be set so: a dunder, a method, nn.Module's "
                                f"own state")
        module.__dict__[key] = codec.decode(value)
    module.training = bool(record["training"])
    for table, kind in ((module._parameters, "parameters"), (module._buffers, "buffers")):
        for key, i in record[kind].items():
            table[_part(key, where)] = None if i is None else tensors[i]
    module._non_persistent_buffers_set.update(set(record["buffers"]) -
                                              set(record["persistent"]))
    for key, child in record["children"].items():
        module._modules[_part(key, where)] = decode_module(
            child, tensors, ".".join(filter(None, (path, key))), codec, model, where)
    if name == "GraphModule":
        graph = decode_graph(record["graph"], module, codec, where)
        try:
            module.graph = graph              # writes and compiles its code
        except (RuntimeError, SyntaxError) as e:
            raise PlanFileError(f"{where}: a graph of the plan does not compile\n"
                                f"{type(e).__name__}: {e}") from None
    return module


def _checked_name(name: str) -> str:
    if not _plain(name):
        raise PlanFileError(f"a stage's graph module is called {name!r}, no identifier")
    return name


def _part(name: str, where: str) -> str:
    """A module's child or tensor name: an identifier or digits (`layers.0`), no dunder."""
    if not (_plain(name) or name.isdigit() and name.isascii()):
        raise PlanFileError(f"{where}: {name!r} names no attribute a module may hold")
    return name


def _from_model(record: Mapping[str, Any], tensors: Sequence[torch.Tensor], path: str,
                model: nn.Module | None, where: str) -> nn.Module:
    """The model's module at `path`, of the recorded class, holding the plan's tensors."""
    name = record["class"]
    if model is None:
        raise PlanFileError(
            f"{where} calls {path!r}, a {name} kept whole\na plan holds no code, so a module "
            f"of the model's own class comes from the model\npass the model (built on meta is "
            f"fine): fxpipe.load_plan(path, model=model), after importing "
            f"{name.rpartition('.')[0]}")
    try:
        theirs = model.get_submodule(path)
    except AttributeError:
        theirs = None
    if theirs is None or f"{type(theirs).__module__}.{type(theirs).__qualname__}" != name:
        raise PlanFileError(f"{where}: the model's {path!r} is "
                            f"{'missing' if theirs is None else type(theirs).__qualname__}"
                            f"\nthe plan keeps a {name} whole there; pass the model the plan "
                            f"was made of")
    held = dict(_all_tensors(theirs))
    if set(held) != set(record["tensors"]):
        raise PlanFileError(f"{where}: the model's {path!r} holds other tensors than the plan's"
                            f"\npass the model the plan was made of")
    # Copy the module, not its tensors: each becomes the plan's stand-in of the same name.
    memo = {id(t): tensors[record["tensors"][n]] for n, t in held.items()}
    copied = copy.deepcopy(theirs, memo)
    copied.train(bool(record["training"]))
    return copied


def decode_graph(data: Mapping[str, Any], module: nn.Module, codec: Codec,
                 where: str) -> fx.Graph:
    """The graph `data` describes, each target resolved through the closed tables, get_attr and
    call_module only of `module`'s own tensors and submodules."""
    graph = fx.Graph(tracer_cls=StageTracer)
    if data["stars"]:
        stars = {_part(k, where): v for k, v in data["stars"].items()}
        if set(stars.values()) - {"*", "**"}:
            raise PlanFileError(f"{where}: a placeholder is starred otherwise than * or **")
        graph.set_codegen(VarArgsCodeGen(stars))
    codec.nodes = {}
    try:
        for op, name, target, args, kwargs in data["nodes"]:
            target, args = _target(op, target, module, codec, where), codec.decode(args)
            if target is getattr and not (len(args) in (2, 3) and isinstance(args[1], str) and
                                          _plain(args[1]) and not args[1].startswith("_")):
                raise PlanFileError(f"{where} reads the attribute {args[1:2]!r}\na plan "
                                    f"reads public attributes of values only (x.shape)")
            node = graph.create_node(op, target, args, codec.decode(kwargs), name=name)
            if node.name != name:
                raise PlanFileError(f"{where}: {name!r} is no node name a graph may hold")
            codec.nodes[name] = node
    finally:
        codec.nodes = None
    try:
        graph.lint()
    except RuntimeError as e:
        raise PlanFileError(f"{where}: a graph of the plan is malformed\n{e}") from None
    return graph


def _target(op: str, target: str, module: nn.Module, codec: Codec, where: str) -> Any:
    if op == "call_function":
        return resolve_function(target, codec.given)
    if op == "call_method":
        if not (_plain(target) and not target.startswith("_") and
                callable(getattr(torch.Tensor, target, None))):
            raise PlanFileError(f"{where} calls the method {target!r}\nwhich is no public "
                                f"method of a tensor")
        return target
    if op in ("placeholder", "output"):
        if op == "placeholder" and not _plain(target):
            raise PlanFileError(f"{where} takes {target!r}, no name an input may have")
        return target
    if op in ("get_attr", "call_module"):
        owner: Any = module
        for part in target.split("."):
            owner = _own(owner, _part(part, where))
            if owner is None:
                raise PlanFileError(f"{where} reads {target!r}, not the plan's own\na plan "
                                    f"reads only its own parameters, buffers and submodules")
        if op == "call_module" and not isinstance(owner, nn.Module):
            raise PlanFileError(f"{where} calls {target!r}, which is no submodule")
        return target
    raise PlanFileError(f"{where} holds a node of kind {op!r}, which no graph has")


def _own(owner: Any, name: str) -> Any:
    if not isinstance(owner, nn.Module):
        return None
    for table in (owner._parameters, owner._buffers, owner._modules):
        if table.get(name) is not None:
            return table[name]
    return None
