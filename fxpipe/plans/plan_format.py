"""A plan as data: what `plan_data.json` holds (format 5), written and read without pickle.

The plan's own fields, its partition, wiring, calling convention, costs and measurements are
written as JSON by `fxpipe.plans.graph_data.Codec`: each dataclass or enum under a name of this
module's table (`Plan`, `Partition`, `StageCost`...), never a Python module path, so plans stay
readable when fxpipe's modules move; each of its stages as `graph_data` writes modules and
graphs; its tensors as a table of shapes and dtypes (their values are in the stage files).
Reading builds only the types of that table, through their constructors, and checks each of
the signature's size rules (evaluated on the inputs of every call) against a closed grammar.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import pickle
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from fxpipe.passes.errors import PlanFileError
from fxpipe.passes.signature import SizeRule, rule_names
from fxpipe.passes.stage import Stage

from .graph_data import Codec, decode_module, encode_module, function_name
from .report import cost_sources

# `Plan` in annotations is `plan_data.Plan`: plan_data writes and reads its plans here, so this module
# names the type and never imports it (the import runs one way, `tests/test_layers.py`).

_SCHEMA = "fxpipe-plan"       # what plan_data.json says it is
FORMAT = 5
PICKLED_FORMATS = (4,)      # plans holding a pickle: loaded only with trust_pickle=True
PLAN_FILE, DATA_FILE, PICKLE_FILE = "plan.json", "plan_data.json", "plan.pt"


_REGISTERED: dict[str, type] = {}


def register_types(**types: type) -> None:
    """Add types a plan holds under the names given: how plan_data gives `Plan`, `PlanRecord`,
    `Runs` and `Measurement` as it is imported (importing it here would import this module back)."""
    _REGISTERED.update(types)


def _types() -> dict[str, type]:
    """The dataclasses and enums a plan holds, by the names plan_data.json gives them."""
    from fxpipe.passes.capture.frontend import Capture, Method as CaptureMethod
    from fxpipe.passes.cost_model import DeviceSpec, Memory, NodeCost, StageCost
    from fxpipe.passes.partition.result import DeviceOrders, Method, Partition
    from fxpipe.passes.signature import Constant, Signature

    from .prediction import Candidate, Config
    from ..runtime.wiring import Flow, Wiring
    return {**_REGISTERED, "Capture": Capture,
            "CaptureMethod": CaptureMethod, "Partition": Partition, "PartitionMethod": Method,
            "DeviceOrders": DeviceOrders, "Memory": Memory, "DeviceSpec": DeviceSpec,
            "StageCost": StageCost, "NodeCost": NodeCost, "Signature": Signature,
            "Constant": Constant, "SizeRule": SizeRule, "Wiring": Wiring, "Flow": Flow,
            "Candidate": Candidate, "Config": Config}


def encode_plan(plan: Plan) -> dict[str, Any]:
    """`plan` as JSON data: its fields (but the in-memory graph and link function), its stages
    as modules and graphs, and the table of the tensors they hold (each tensor once)."""
    codec = Codec(_types())
    table: list[dict[str, Any]] = []
    index: dict[int, int] = {}

    def tensor_index(t: torch.Tensor) -> int:
        if id(t) not in index:
            index[id(t)] = len(table)
            table.append({"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                          "parameter": isinstance(t, nn.Parameter),
                          "requires_grad": t.requires_grad})
        return index[id(t)]

    stages = [{"index": s.index, "inputs": list(s.inputs), "outputs": list(s.outputs),
               "device": str(s.device), "module": encode_module(s.module, tensor_index, codec)}
              for s in plan.stages]
    # One object of fields, the record's beside the rest, as format 5 has always held them.
    fields = {f.name: codec.encode(getattr(plan, f.name)) for f in dataclasses.fields(plan)
              if f.init and f.name not in ("stages", "graph", "link_fn", "record")}
    fields.update({f.name: codec.encode(getattr(plan.record, f.name))
                   for f in dataclasses.fields(plan.record)})
    return {"schema": _SCHEMA, "plan": fields, "stages": stages, "tensors": table,
            "functions": sorted(_user_functions(plan))}


def _user_functions(plan: Plan) -> set[str]:
    """The functions the stages call that are no torch op: the user's, given back at load."""
    from .graph_data import functions
    known = set(functions())
    return {name for stage in plan.stages for m in stage.module.modules()
            if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
            if n.op == "call_function" and not (name := function_name(n.target)) in known
            and not name.startswith("torch.ops.")}


def decode_plan(data: Mapping[str, Any], *, functions: Iterable[Callable] = (),
                model: nn.Module | None = None, where: str = "the plan") -> Plan:
    """The plan `data` describes (see `encode_plan`), its stages holding meta stand-ins of its
    tensors; functions the user kept whole come from `functions`, modules of the model's own
    classes from `model`."""
    if not isinstance(data, dict) or data.get("schema") != _SCHEMA:
        raise PlanFileError(f"{where} holds no fxpipe plan data\nsave the plan again")
    given = {function_name(fn): fn for fn in functions}
    for cls in functions:         # a namedtuple or pytree class given by its class name
        if isinstance(cls, type):
            given[f"{cls.__module__}.{cls.__qualname__}"] = cls
    missing = [name for name in data.get("functions", ()) if name not in given]
    if missing:
        short = ", ".join(name.rpartition(".")[2] for name in missing)
        raise PlanFileError(
            f"{where} calls {', '.join(missing)}, kept whole\na plan holds no code of the "
            f"functions torch.fx.wrap kept whole in its graph\npass "
            f"{'them' if len(missing) > 1 else 'it'}: fxpipe.load_plan(path, "
            f"functions=[{short}])")
    codec = Codec(_types(), given)
    try:
        tensors = [_stand_in(entry) for entry in data["tensors"]]
        stages = tuple(Stage(int(s["index"]), decode_module(
            s["module"], tensors, "", codec, model, f"stage {s['index']} of {where}"),
            tuple(map(str, s["inputs"])), tuple(map(str, s["outputs"])),
            torch.device(s["device"])) for s in data["stages"])
        fields = {name: codec.decode(value) for name, value in data["plan"].items()}
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise PlanFileError(f"{where} holds malformed plan data ({type(e).__name__}: {e})"
                            f"\nsave the plan again") from None
    plan_type, record_type = _types()["Plan"], _types()["PlanRecord"]
    recorded = {f.name for f in dataclasses.fields(record_type)}
    unknown = sorted(set(fields) - recorded -     # the record's fields sit beside the rest
                     ({f.name for f in dataclasses.fields(plan_type)} - {"record"}))
    if unknown:
        raise PlanFileError(f"{where} holds fields no plan has: {unknown}")
    signature = fields.get("signature")
    for rule in getattr(signature, "size_rules", ()):
        check_rule(rule.code, where)
    record = record_type(**{name: fields.pop(name) for name in recorded & set(fields)})
    return plan_type(**fields, stages=stages, record=record)


def _stand_in(entry: Mapping[str, Any]) -> torch.Tensor:
    from .graph_data import _DTYPES
    empty = torch.empty([int(n) for n in entry["shape"]], dtype=_DTYPES[entry["dtype"]],
                        device="meta")
    if entry["parameter"]:
        return nn.Parameter(empty, bool(entry["requires_grad"]))
    return empty.requires_grad_(bool(entry["requires_grad"]))


# A size rule is Python evaluated on every call's inputs (`SizeRule.holds`): only this grammar.
_RULE_NODES = (ast.Expression, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Constant,
               ast.Name, ast.Subscript, ast.Call, ast.Attribute, ast.Load, ast.And, ast.Or,
               ast.Not, ast.USub, ast.UAdd, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv,
               ast.Mod, ast.Pow, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


@functools.cache
def _rule_calls() -> frozenset[str]:
    """The functions a size rule may call (read once: naming them imports sympy)."""
    return frozenset({"max", "min", "abs", *(name for name, v in rule_names().items()
                                             if callable(v) and not name.startswith("_"))})


def check_rule(code: str, where: str) -> None:
    """Refuse a size rule that is more than arithmetic and comparisons of the inputs' sizes
    (`args[0].size()[1] % 8 == 0`), `math.` and `torch.sym_` functions, max, min and abs."""
    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError:
        tree = None
    for node in ast.walk(tree) if tree is not None else ():
        ok = isinstance(node, _RULE_NODES) and (
            not isinstance(node, ast.Constant) or type(node.value) in (int, float, bool)) and (
            not isinstance(node, ast.Name) or
            node.id in _rule_calls() | {"args", "math", "torch"}
        ) and (not isinstance(node, ast.Attribute) or node.attr == "size" or (
            isinstance(node.value, ast.Name) and not node.attr.startswith("_") and (
                node.value.id == "math" or node.attr.startswith("sym_"))))
        if not ok:
            break
    else:
        if tree is not None:
            return
    raise PlanFileError(f"{where} holds the size rule {code!r}\nwhich is more than a "
                        f"condition on the inputs' sizes\nsave the plan again")


# ---- plan.json: what a person reads, and the manifest of the stages' tensors --------------------

def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `module` by qualified name, shared ones under each name."""
    for path, owner in module.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    yield ".".join(filter(None, (path, name))), tensor


def _non_persistent(plan: Plan) -> set[str]:
    """The names of the tensors `plan`'s stages hold that are not in the model's `state_dict`:
    non-persistent buffers and constants the graph reads. Read off the costed graph, which
    holds the model's state as the model does, else (a loaded plan) off the stages' modules,
    marked at load from the manifest."""
    if plan.graph is not None:
        state = plan.graph.state_dict(keep_vars=True)
        return {name for stage in plan.stages for name, _ in _tensors(stage.module)
                if name not in state}
    return {".".join(filter(None, (path, name))) for stage in plan.stages
            for path, owner in stage.module.named_modules(remove_duplicate=False)
            for name in owner._non_persistent_buffers_set}


def manifest(plan: Plan) -> dict[str, Any]:
    """Which tensors each stage of `plan` holds, as plan.json's `weights` entry writes them:
    per stage, each parameter and buffer by the model's name with its shape, dtype, whether it
    is a parameter, whether it is persistent (in the model's `state_dict`, so a checkpoint
    holds it; a non-persistent buffer is computed by its module), and whether the stage files
    hold its values (a tensor on meta has none); and the tied ones, one tensor held under
    several names or by several stages, as lists of `[stage, name]`."""
    non_persistent = _non_persistent(plan)
    holders: dict[int, list[list]] = {}
    stages = []
    for stage in plan.stages:
        entries = {}
        for name, tensor in _tensors(stage.module):
            holders.setdefault(id(tensor), []).append([stage.index, name])
            entries[name] = {"shape": list(tensor.shape),
                             "dtype": str(tensor.dtype).removeprefix("torch."),
                             "parameter": isinstance(tensor, nn.Parameter),
                             "persistent": name not in non_persistent,
                             "saved": not tensor.is_meta}
        stages.append(entries)
    return {"stages": stages, "tied": [held for held in holders.values() if len(held) > 1]}


def _description(plan: Plan) -> dict[str, Any]:
    """What the plan was computed from and what it decided, as JSON data."""
    part = plan.partition
    costs: dict[str, dict[str, Any]] = {}
    for stage in plan.stages:
        for node in stage.module.graph.nodes:
            measured = node.meta.get("costs") or (
                {"": node.meta["cost"]} if "cost" in node.meta else {})
            for kind, cost in measured.items():
                costs.setdefault(node.name, {})[kind] = dataclasses.asdict(cost)
    return {
        "capture": {"method": str(plan.capture.method), "leaves": list(plan.capture.leaves),
                    "training": plan.capture.training, "reason": plan.capture.reason},
        "devices": [dataclasses.asdict(d) for d in part.devices],
        "chunks": plan.chunks, "schedule": plan.schedule, "threads": list(plan.threads),
        "link": plan.link,
        "partition": {"stage_of": dict(part.stage_of), "bottleneck_s": part.bottleneck_s,
                      "lower_bound_s": part.lower_bound_s, "optimal": part.optimal,
                      "method": str(part.method or ""),
                      "stages": [dataclasses.asdict(c) for c in part.stages]},
        "predicted_step_s": plan.record.predicted_step_s,
        "unpipelined_s": plan.record.unpipelined_s,
        "weights_source": plan.record.weights, "stand_ins": list(plan.record.stand_ins),
        "verified": plan.record.verified, "verify_tolerance": plan.record.verify_tolerance,
        "verify_tolerance_source": plan.record.verify_tolerance_source,
        "planning_peak_rss_bytes": plan.record.planning_peak_rss_bytes,
        "stages": [{"index": s.index, "device": str(s.device), "inputs": list(s.inputs),
                    "outputs": list(s.outputs)} for s in plan.stages],
        "wiring": {"producer": dict(plan.wiring.producer),
                   "graph_outputs": list(plan.wiring.output_names)},
        "costs": costs, "cost_sources": cost_sources(plan),
    }


def _content_digest(document: dict[str, Any]) -> str:
    """The SHA-256 of a plan.json document's content (as JSON reads it back), its own `sha256`
    entry left out: indifferent to how the file is laid out, changed by any edit of a value."""
    content = {key: value for key, value in document.items() if key != "sha256"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _finite(value: Any) -> Any:
    """`value` with every infinite or NaN float written as a string ("inf"): JSON has none."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# ---- plan.json, read: the checks of every load ---------------------------------------------------

def versions() -> dict[str, str]:
    """The versions a plan is saved with and must be loaded with."""
    try:
        ours = importlib.metadata.version("fxpipe")
    except importlib.metadata.PackageNotFoundError:     # run from a source tree
        ours = "unknown"
    return {"fxpipe": ours, "torch": torch.__version__}


def _checked(path: str | os.PathLike, index: int | None,
             trust_pickle: bool = False) -> tuple[Path, dict[str, Any]]:
    """The plan's directory and `plan.json`, once the files a load reads are there and
    unchanged (all of them, or those stage `index` needs) and the versions match."""
    root = Path(path)
    document = _document(root, trust_pickle=trust_pickle)
    needed = dict(document["files"])
    if index is not None:
        holders = {holder for holder, _ in document["shared"][index].values()} | {index} \
            if index < len(document["shared"]) else set()
        needed = {name: digest for name, digest in needed.items()
                  if not name.startswith("stage_") or name.endswith(".py") or
                  int(name[6:].split(".")[0]) in holders}
    for name, digest in needed.items():
        file = root / name
        if not file.is_file():
            raise PlanFileError(f"the plan at {str(root)!r} is missing {name}\n"
                                f"save the plan again")
        if hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            raise PlanFileError(f"{name} in the plan at {str(root)!r} changed since it was saved"
                                f"\nits SHA-256 differs from plan.json's; save the plan "
                                f"again rather than editing its files")
    return root, document


def plan_document(path: str | os.PathLike) -> dict[str, Any]:
    """`plan.json` of the plan saved at `path`, checked as a load checks it (there, readable,
    of this format or format 4, whose pickle it leaves unread, unchanged) but saved by any
    versions of fxpipe and torch: what `fxpipe diff` compares, plans from other versions
    included."""
    return _document(Path(path), same_versions=False, trust_pickle=True)


def _document(root: Path, *, same_versions: bool = True,
              trust_pickle: bool = False) -> dict[str, Any]:
    """`plan.json` of the plan at `root`, once it is there, readable, of this format (or, with
    `trust_pickle`, a pickled one), saved by the versions running (unless not `same_versions`)
    and unchanged."""
    if not (root / PLAN_FILE).is_file():
        raise PlanFileError(f"no saved plan at {str(root)!r}: {PLAN_FILE} is missing\n"
                            f"save one with pipe.plan.save(path)")
    try:
        document = json.loads((root / PLAN_FILE).read_text())
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{root / PLAN_FILE} is not valid JSON ({e})\n"
                            f"save the plan again") from None
    if document.get("format") in PICKLED_FORMATS and not trust_pickle:
        raise PlanFileError(
            f"the plan at {str(root)!r} is of format {document['format']}, a pickle\nloading "
            f"its {PICKLE_FILE} runs whatever code its directory holds\nconvert it once, if "
            f"you trust it: fxpipe.plans.saved.convert(old, new) or `fxpipe convert old new`; or "
            f"load it with trust_pickle=True")
    if document.get("format") != FORMAT and document.get("format") not in PICKLED_FORMATS:
        raise PlanFileError(f"{root / PLAN_FILE} has format {document.get('format')!r}, this "
                            f"fxpipe reads format {FORMAT}\nsave the plan again with it")
    running = versions() if same_versions else {}
    differ = [f"{name} {document.get(name)} (saved) against {version} (running)"
              for name, version in running.items() if document.get(name) != version]
    if differ:
        raise PlanFileError(f"the plan at {str(root)!r} was saved by other versions\n"
                            f"{'; '.join(differ)}\nplan the model again with these versions")
    if document.get("sha256") != _content_digest(document):
        raise PlanFileError(f"{root / PLAN_FILE} changed since the plan was saved\n"
                            f"its content no longer matches its sha256; plan.json describes the "
                            f"plan that runs, "
                            f"which is read from {DATA_FILE} and the stage files, so an edit "
                            f"would not take effect\nsave the plan again to change it "
                            f"(fxpipe.plan(model, ...).save(path)), or restore the saved file")
    return document


def unpickled(file: Any) -> Any:
    """What a pickle of a trusted plan (format 4) holds, its classes found where they live now."""
    with warnings.catch_warnings():     # torch's own pytree specs warn as they unpickle
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
        return torch.load(file, weights_only=False, pickle_module=_OLD_PATHS_PICKLE)


def regrouped(plan: Any) -> Any:
    """A plan unpickled from format 4, its fields as a plan has them now: the record of what
    was weighed, pickled among the rest before plans held it apart, moved into `record`."""
    state = vars(plan)
    if "record" not in state:
        record_type = _types()["PlanRecord"]
        names = {f.name for f in dataclasses.fields(record_type)}
        state["record"] = record_type(**{name: state.pop(name) for name in names & set(state)})
    return plan


# Where the modules a pickled plan (format 4) names live since fxpipe/ was grouped by layer.
MOVED_MODULES = {f"fxpipe.{old}": f"fxpipe.{new}" for old, new in (
    ("plan_data", "plans.plan_data"), ("saved", "plans.saved"), ("report", "plans.report"),
    ("plan_format", "plans.plan_format"), ("graph_data", "plans.graph_data"),
    ("explain", "plans.explain"), ("pictures", "plans.pictures"), ("search", "planning.search"),
    ("options", "planning.options"), ("measure", "planning.measure"),
    ("prepare", "planning.prepare"), ("reference", "planning.reference"),
    ("progress", "planning.progress"), ("checks", "planning.checks"),
    ("schedules", "runtime.schedules"), ("wiring", "runtime.wiring"),
    ("microbatch", "runtime.microbatch"), ("devices", "runtime.devices"))}


class _OldPaths(pickle.Unpickler):
    """Unpickles a format-4 plan, whose classes are named by the modules they lived in then."""

    def find_class(self, module: str, name: str) -> Any:
        for before, now in MOVED_MODULES.items():
            if module == before or module.startswith(before + "."):
                module = now + module[len(before):]
                break
        return super().find_class(module, name)


# What torch.load takes as its pickle module: `pickle`, reading the old paths.
_OLD_PATHS_PICKLE = types.SimpleNamespace(__name__="pickle", Unpickler=_OldPaths,
                                          load=lambda file, **kw: _OldPaths(file, **kw).load())
