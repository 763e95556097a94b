"""The command line: plan a model, look at a saved plan, run one.

    python -m fxpipe plan examples.zoo:model --kwargs '{"name": "resnet50"}' --input 8x3x32x32
    python -m fxpipe plan mypkg.nets:Net --kwargs '{"width": 64}' --input 16x32 --save plans/net
    python -m fxpipe plan transformers:AutoModelForCausalLM --config llama/config.json --meta \
        --tokens 1x512 --dtype bf16 --devices cuda:0=80GB,cuda:1=80GB --save plans/llama
    python -m fxpipe explain mypkg.nets:Net --input 16x32 --devices cpu,cpu,cpu
    python -m fxpipe show plans/net
    python -m fxpipe diff plans/net plans/net-4
    python -m fxpipe run plans/net --input 16x32
    python -m fxpipe run plans/llama --weights llama/ --tokens 1x512

A model is `module:factory`, the factory called with `--kwargs` (JSON) to build it; with
`--config FILE`, from that configuration: a Hugging Face factory (an `AutoModel...` class, a
model class) from the `config.json` read from disk (`AutoConfig.from_pretrained`, never a
download), `--kwargs` overriding its entries; any other factory called with the file's JSON
object as keyword arguments, `--kwargs` added. `--meta` builds it with its parameters on the
meta device (shapes, no values: see docs/big-models.md) and its buffers computed on the CPU
(`fxpipe.weights.build_on_meta`: a rotary `inv_freq`, which no checkpoint holds, is kept in
the plan), `--dtype` (bf16, fp16, float32, ...) in that dtype. Inputs are random tensors of
the shapes given (`--input` once per positional input, sizes joined by `x`) of a float
`--dtype`, or token ids (`--tokens BxS`, int64 below the model's vocabulary, the first input;
an integer `--dtype` draws ids below 100 for `--input`). `run` takes a plan's weights from
`--weights CKPT` (a plan made with `--meta` holds none), and its inputs from `--tokens` and
`--input`, else shaped as the plan's example. Devices are comma-separated, each with its memory
if wanted (`cpu:0=400MB`, `cuda:0=80GB`). Bad input gets one line naming the problem and exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence, get_args

import torch
from tabulate import tabulate

import fxpipe
from fxpipe.passes.capture import CAPTURE_MODES
from fxpipe.passes.cost_model import format_bytes
from fxpipe.passes.errors import FxpipeError

from . import timeline
from .options import LinkName, Recompute
from .schedules import SCHEDULES
from .pictures import COLOURS, write_node_graph, write_stage_graph  # noqa: F401 (COLOURS: tests)
from .report import measured_memory
from . import saved
from .saved import plan_document
from .weights import build_on_meta


class UsageError(FxpipeError):
    """A command line that cannot be carried out: an unknown model, shape, dtype or device."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.command(args)
    except BrokenPipeError:          # the reader stopped reading (`| head`)
        sys.stderr.close()
        return 0
    except (FxpipeError, FileNotFoundError) as e:
        # The problem on the error line, the fix (the message's next lines) indented below it.
        first, *rest = _as_flags(str(e)).strip().splitlines() or [type(e).__name__]
        print(f"fxpipe {args.name}: error: {first}", file=sys.stderr)
        for line in rest:
            print(f"  {line}" if line.strip() else "", file=sys.stderr)
        return 2


# The options an error's fix names, as this command line spells them.
_FLAGS = ((re.compile(r"\bbatch_dims=(?=[\s;:,.)]|$)"), "--batch-dims DIM"),
          (re.compile(r"\bbatch_dims="), "--batch-dims "),
          (re.compile(r"\bchunks=(\w+)"), r"--chunks \1"),
          (re.compile(r"\bchunks=(?=[\s;:,.)]|$)"), "--chunks N"),
          (re.compile(r"\bschedule='(\w+)'"), r"--schedule \1"),
          (re.compile(r"\bverify=False\b"), "--no-verify"),
          (re.compile(r"\bnum_stages="), "--stages "),
          (re.compile(r"\bcapture='(\w+)'"), r"--capture \1"),
          (re.compile(r"\bleaf_modules=\[\.\.\.\]"), "--leaf-modules NAME,..."),
          (re.compile(r"\brecompute='(\w+)'"), r"--recompute \1"))


def _as_flags(message: str) -> str:
    """`message` with the Python options its fix names written as this command's flags."""
    for pattern, flag in _FLAGS:
        message = pattern.sub(flag, message)
    return message


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxpipe", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"fxpipe {fxpipe.__version__}")
    commands = parser.add_subparsers(required=True, metavar="command")

    plan = commands.add_parser("plan", help="plan a model and print the plan")
    _planning(plan)
    plan.add_argument("--explain", action="store_true",
                      help="also print, for each cut, what crosses it and why it is there")
    plan.add_argument("--save", metavar="DIR",
                      help="write the plan there (fxpipe show/run read it), with pictures")
    plan.set_defaults(command=_plan, name="plan")

    explain = commands.add_parser("explain", help="plan a model and say, for each cut, what "
                                                  "crosses it and why it is there")
    _planning(explain)
    explain.set_defaults(command=_plan, name="explain", explain=True, save=None)


    show = commands.add_parser("show", help="print a saved plan")
    show.add_argument("dir", help="a saved plan's directory (plan --save DIR)")
    show.set_defaults(command=_show, name="show")

    diff = commands.add_parser("diff", help="where two saved plans differ")
    diff.add_argument("first", help="a saved plan's directory")
    diff.add_argument("second", help="another saved plan's directory")
    diff.set_defaults(command=_diff, name="diff")

    convert = commands.add_parser("convert", help="rewrite a saved plan of format 4 (a "
                                  "pickle: reading it runs its code, so only one you trust) in "
                                  "this format, which holds no code")
    convert.add_argument("old")
    convert.add_argument("new")
    convert.set_defaults(command=_convert, name="convert")

    run = commands.add_parser("run", help="run a saved plan on random inputs; measured "
                                          "against predicted time per stage")
    run.add_argument("dir", help="a saved plan's directory (plan --save DIR)")
    run.add_argument("--weights", metavar="CKPT",
                     help="read each stage's tensors from this checkpoint (a .safetensors file, "
                          "a Hugging Face sharded folder, a torch state_dict file): what a plan "
                          "made on meta (plan --meta) runs with")
    run.add_argument("--input", action="append", metavar="SHAPE",
                     help="a positional input's shape, e.g. 8x3x224x224 (once per input; "
                          "default: the shapes the plan was measured on)")
    run.add_argument("--tokens", metavar="BxS",
                     help="token ids as the first input: B sequences of S, int64 below the "
                          "vocabulary of the embedding the plan reads them with")
    run.add_argument("--dtype", default=None,
                     help="the --input tensors' dtype (default: float32; bf16, fp16; int64 "
                          "draws token ids below 100); without --input, that of the inputs "
                          "that are not token ids (default: as the plan measured them)")
    run.add_argument("--repeats", type=int, default=5, help="timed calls (default: 5)")
    run.set_defaults(command=_run, name="run")
    return parser


def _planning(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="module:factory, e.g. examples.zoo:model (in the "
                                      "repository) or transformers:AutoModelForCausalLM")
    parser.add_argument("--devices", default="cpu,cpu",
                        help="comma-separated devices, one per stage, each with its memory if "
                             "wanted: cpu,cpu (the default), cpu:0=400MB,cpu:1=400MB, "
                             "cuda:0=80GB,cuda:1=80GB")
    _inputs(parser)
    parser.add_argument("--tokens", metavar="BxS",
                        help="token ids as the first input: B sequences of S, int64 below the "
                             "model's vocabulary (its input embedding's size)")
    parser.add_argument("--kwargs", default="{}", help="the factory's keyword arguments, as JSON "
                                                       "(with --config: overriding its entries)")
    parser.add_argument("--config", metavar="FILE",
                        help="build the model from this configuration: a Hugging Face "
                             "config.json (or its directory) for a Hugging Face factory, read "
                             "from disk; a JSON object of keyword arguments for any other")
    parser.add_argument("--meta", action="store_true",
                        help="build the model on the meta device (shapes, no values): planned "
                             "without holding it, saved with a manifest of each stage's tensors")
    parser.add_argument("--chunks", default=None,
                        help="micro-batches per call, or auto (default: 2 per stage, at most "
                             "the batch's rows)")
    parser.add_argument("--batch-dims", default="0", metavar="JSON",
                        help="the batch dimension of the inputs: one for all (1 for a "
                             "sequence-first model), null for none, or one per --input as a "
                             "list, e.g. [1, null] (default: 0)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the check of the stages against the model (accepting what "
                             "micro-batches compute, as for a model normalising over the batch)")
    parser.add_argument("--capture", choices=CAPTURE_MODES, default="auto",
                        help="how to capture the model: torch.fx then torch.export (auto, the "
                             "default), or only one of them")
    parser.add_argument("--leaf-modules", default="", metavar="NAME,...",
                        help="qualified names of submodules to keep whole, as one node each")
    parser.add_argument("--stages", default=None, help="number of stages to use, or auto")
    parser.add_argument("--train", action="store_true", help="plan for training (train_step)")
    parser.add_argument("--schedule", choices=[*SCHEDULES, "auto"], default="gpipe",
                        help="the training schedule (default: gpipe; 1f1b keeps fewer "
                             "micro-batches in flight; auto weighs both)")
    parser.add_argument("--recompute", choices=get_args(Recompute), default="never",
                        help="recompute activations in training (default: never)")
    parser.add_argument("--optimizer", default="adam",
                        help="the optimizer whose state each training stage holds (default: adam)")
    parser.add_argument("--link", choices=get_args(LinkName), default="default",
                        help="price transfers as hand-offs between threads (default), as copies "
                             "measured here (measure), or as messages between processes, for "
                             "a run under torchrun (gloo)")
    parser.add_argument("--memory", default=None, metavar="BYTES",
                        help="each device's memory, e.g. 8e9 or 8GB, shared by the stages on it, "
                             "where --devices gives none (default: a GPU's free memory, CPU "
                             "unbounded)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _inputs(parser: argparse.ArgumentParser) -> None:
    """The planning commands' inputs (run has its own)."""
    parser.add_argument("--input", action="append", metavar="SHAPE",
                        help="a positional input's shape, e.g. 8x3x224x224 (once per input)")
    parser.add_argument("--dtype", default=None,
                        help="a float dtype (bf16, fp16, float32, float64) is the model's and "
                             "its --input tensors'; an integer one (int64) draws token ids below "
                             "100 for --input and leaves the model as built (default: the model "
                             "as built, float32 inputs)")


# ---- commands -----------------------------------------------------------------------------------

def _plan(args: argparse.Namespace) -> int:
    dtype = None if args.dtype is None else _dtype(args.dtype)
    if not args.input and args.tokens is None:
        raise UsageError("no inputs\ngive --tokens BxS (token ids) or --input SHAPE (once per "
                         "positional input)")
    tokens = None if args.tokens is None else _token_shape(args.tokens)
    model_dtype = dtype if dtype is not None and dtype.is_floating_point else None
    model = _model(args.model, args.kwargs, config=args.config, meta=args.meta,
                   dtype=model_dtype).train(args.train)
    inputs = _random_inputs(args.input or [], "float32" if dtype is None else args.dtype)
    if tokens is not None:
        torch.manual_seed(0)
        inputs = (torch.randint(0, _vocabulary(model), tokens), *inputs)
    options = {"chunks": None if args.chunks is None else _count(args.chunks),
               "training": args.train,
               "progress": False if args.quiet else None, "recompute": args.recompute,
               "optimizer": args.optimizer, "link": args.link, "verify": not args.no_verify,
               "schedule": args.schedule,
               "batch_dims": _batch_dims(args.batch_dims), "capture": args.capture,
               "leaf_modules": [name for name in args.leaf_modules.split(",") if name]}
    if args.stages is not None:
        options["num_stages"] = _count(args.stages)
    devices = _devices(args.devices, None if args.memory is None else
                       _size("--memory", args.memory))
    plan = fxpipe.plan(model, devices, inputs, **options)
    if args.name == "plan":
        print(plan)
    if args.explain:
        print(fxpipe.Pipeline(plan).explain())
    if args.save:
        root = plan.save(args.save)
        timeline.write_svg(plan.predict(training=args.train), root / "timeline.svg")
        write_stage_graph(plan, root / "stages.svg")
        write_node_graph(plan.graph, plan, root / "graph.dot")
        print(f"saved to {root}")
    return 0


def _show(args: argparse.Namespace) -> int:
    print(fxpipe.load_plan(args.dir))
    print(weight_shares(plan_document(args.dir)))
    return 0


def _convert(args: argparse.Namespace) -> int:
    new = saved.convert(args.old, args.new)
    print(f"{args.old} converted into {new} (format {saved.FORMAT}, which holds no code)")
    return 0


def weight_shares(document: dict[str, Any]) -> str:
    """Each stage's share of the checkpoint's tensors, from a saved plan's manifest
    (`plan.json`'s `weights`): how many of the model's parameters and persistent buffers the
    stage reads and their bytes (a tensor tied within the stage once; one also held by another
    stage counted in each, and under `shared`), the buffers it computes instead (not in a
    checkpoint), and the whole checkpoint's count and bytes, each tensor once."""
    manifest = document.get("weights") or {}
    stages = manifest.get("stages") or []
    group_of = {(s, name): g for g, group in enumerate(manifest.get("tied", []))
                for s, name in group}
    stages_of: dict[Any, set[int]] = {}
    for (s, name), g in group_of.items():
        stages_of.setdefault(g, set()).add(s)
    rows, everything, saved, persistent = [], {}, 0, 0
    for s, entries in enumerate(stages):
        read, shared, computed = {}, 0, 0
        for name, entry in entries.items():
            if not entry["persistent"]:
                computed += 1
                continue
            key = ("tied", group_of[s, name]) if (s, name) in group_of else (s, name)
            if key in read:
                continue
            read[key] = everything[key] = _nbytes(entry)
            shared += key[0] == "tied" and len(stages_of[key[1]]) > 1
            saved += entry["saved"]
            persistent += 1
        device = document["stages"][s]["device"] if s < len(document.get("stages", [])) else ""
        rows.append((s, device, len(read), format_bytes(sum(read.values())), shared, computed))
    rows.append(("all", "", len(everything), format_bytes(sum(everything.values())), "", ""))
    where = ("the plan's files hold their values" if saved == persistent else
             "the plan holds none of their values: load it with weights= (a checkpoint)"
             if not saved else f"the plan's files hold {saved} of them")
    return "\n".join([
        f"the checkpoint's tensors per stage (the model's parameters and persistent buffers each "
        f"stage reads, and only those; {where}):",
        tabulate(rows, headers=["stage", "device", "tensors", "bytes", "shared", "computed"],
                 colalign=("right", "left", "right", "right", "right", "right"))])


def _nbytes(entry: dict[str, Any]) -> int:
    """The bytes of a manifest entry's tensor."""
    dtype = getattr(torch, entry["dtype"], None)
    size = dtype.itemsize if isinstance(dtype, torch.dtype) else 0
    return math.prod(entry["shape"]) * size


def _diff(args: argparse.Namespace) -> int:
    first, second = (plan_document(d) for d in (args.first, args.second))
    lines = []
    for key in ("devices", "chunks", "schedule", "threads", "fxpipe", "torch"):
        if first.get(key) != second.get(key):
            lines.append(f"{key}: {_shown(key, first.get(key))} | "
                         f"{_shown(key, second.get(key))}")
    a, b = first["partition"], second["partition"]
    for key in ("bottleneck_s", "lower_bound_s"):
        lines.append(f"{key.replace('_s', '')}: {_ms(a[key])} | {_ms(b[key])}")
    moved = [(n, s, b["stage_of"].get(n)) for n, s in a["stage_of"].items()
             if b["stage_of"].get(n) != s]
    only = sorted(set(b["stage_of"]) - set(a["stage_of"]))
    lines.append(f"nodes in another stage: {len(moved)} of {len(a['stage_of'])}")
    lines += [f"  {n}: stage {s} | {'-' if t is None else f'stage {t}'}" for n, s, t in moved[:40]]
    if len(moved) > 40:
        lines.append(f"  ... and {len(moved) - 40} more")
    if only:
        lines.append(f"nodes only in {args.second}: {len(only)}")
    print("\n".join(lines))
    return 0


def _shown(key: str, value: Any) -> str:
    """A saved plan's entry as `diff` prints it: devices by name (with their memory where
    bounded), lists comma-separated, the rest as is."""
    if value is None:
        return "-"
    if key == "devices":
        return ", ".join(d["name"] + ("" if d.get("memory_bytes") in (None, "inf") else
                                      f"={format_bytes(float(d['memory_bytes']))}")
                         for d in value)
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def _run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats}: must be 1 or more")
    if args.weights is None and _without_weights(plan_document(args.dir)):
        raise UsageError(f"the plan at {args.dir} holds no weights\nit was planned on the meta "
                         f"device: pass --weights CKPT, a .safetensors file or a Hugging Face "
                         f"sharded folder")
    plan = fxpipe.load_plan(args.dir, weights=args.weights)
    pipe = fxpipe.Pipeline(plan)
    inputs, keywords = _run_inputs(plan, args)
    with torch.no_grad():
        pipe(*inputs, **keywords)       # warm-up
        runs = []
        for _ in range(args.repeats):
            pipe(*inputs, **keywords)
            runs.append(pipe.last_run)
    print(f"{args.dir}: {plan.partition.num_stages} stages, {plan.chunks} micro-batches, "
          f"median of {args.repeats} calls")
    print(f"{'stage':>5}  {'device':<10} {'predicted ms':>13} {'measured ms':>12}")
    for s, (device, stage) in enumerate(zip(plan.partition.devices, plan.partition.stages)):
        measured = [slot.end_s - slot.start_s for run in runs for slot in run.slots
                    if slot.action.stage == s]
        print(f"{s:>5}  {device.name:<10} {stage.forward_step_s * 1e3:>13.3f} "
              f"{statistics.median(measured) * 1e3:>12.3f}")
    predicted = max((slot.end_s for slot in pipe.predict()), default=0.0)
    print(f"per call: predicted {predicted * 1e3:.3f} ms, measured "
          f"{statistics.median(run.wall_s for run in runs) * 1e3:.3f} ms")
    pipe.measure_memory = True      # one more call, its memory tracked (not timed)
    with torch.no_grad():
        pipe(*inputs, **keywords)
    print("\n".join(measured_memory(plan)))
    pipe.close()
    return 0


def _without_weights(document: dict[str, Any]) -> bool:
    """Whether a saved plan's files lack some of the model's parameters and persistent buffers
    (a plan made on meta: its manifest lists them, unsaved)."""
    stages = (document.get("weights") or {}).get("stages") or []
    return any(entry["persistent"] and not entry["saved"]
               for entries in stages for entry in entries.values())


def _run_inputs(plan: fxpipe.Plan, args: argparse.Namespace
                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`fxpipe run`'s random inputs: `--tokens` (ids below the vocabulary of the embedding the
    plan reads its first input with) then each `--input`; without either, the example's
    (`_measured_inputs`)."""
    if args.input is None and args.tokens is None:
        return _measured_inputs(plan, None if args.dtype is None else _dtype(args.dtype))
    inputs = _random_inputs(args.input or [], args.dtype or "float32")
    if args.tokens is not None:
        vocabularies = _token_inputs(plan)
        first = plan.signature.placeholders[0] if plan.signature.placeholders else None
        if first not in vocabularies:
            raise UsageError("--tokens: the plan reads no token ids with an embedding as its "
                             "first input\ngive its inputs with --input SHAPE --dtype int64")
        torch.manual_seed(0)
        inputs = (torch.randint(0, vocabularies[first], _token_shape(args.tokens)), *inputs)
    return inputs, {}


def _token_inputs(plan: fxpipe.Plan) -> dict[str, int]:
    """The graph inputs the plan reads as token ids (an embedding's indices: `nn.Embedding`,
    `F.embedding`, aten's `embedding`, the input reshaped on the way), each with the number of
    ids its embedding takes."""
    graph_inputs = set(plan.signature.placeholders)
    found: dict[str, int] = {}
    for stage in plan.stages:
        module = stage.module
        for node in module.graph.nodes:
            weight = indices = None
            if node.op == "call_module" and isinstance(module.get_submodule(node.target),
                                                       torch.nn.Embedding):
                weight, indices = module.get_submodule(node.target).weight, node.args[0]
            elif node.op == "call_function" and node.target in (
                    torch.nn.functional.embedding, torch.ops.aten.embedding.default):
                table, indices = (node.args[1], node.args[0]) \
                    if node.target is torch.nn.functional.embedding else node.args[:2]
                if isinstance(table, torch.fx.Node) and table.op == "get_attr":
                    weight = module
                    for part in table.target.split("."):
                        weight = getattr(weight, part)
            for _ in range(4):      # back through a view or reshape of the input
                if not isinstance(indices, torch.fx.Node) or indices.op == "placeholder":
                    break
                indices = indices.args[0] if indices.args else None
            if isinstance(weight, torch.Tensor) and isinstance(indices, torch.fx.Node) and \
                    indices.op == "placeholder" and indices.name in graph_inputs:
                found.setdefault(indices.name, weight.shape[0])
    return found


_FLOATS_BY_SIZE = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16}


def _measured_inputs(plan: fxpipe.Plan, dtype: torch.dtype | None
                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Random inputs shaped as the plan's example: the micro-batch it was measured on, its
    batch dimension times the plan's chunks; token ids below their embedding's vocabulary
    (`_token_inputs`), other tensors of `dtype`, else the float dtype of the bytes the plan
    measured them at (8: float64, 4: float32, 2: bfloat16, 1: bool)."""
    signature = plan.signature
    measured = {key[0]: m for key, m in plan.measurements.items()}
    if len(measured) != 1:
        raise UsageError(f"the plan was measured on {len(measured)} micro-batch sizes\n"
                         f"so its example's is unknown; give its inputs with --tokens BxS or "
                         f"--input SHAPE (once per positional input)")
    (shapes, measurement), = measured.items()
    tensors = [p for i, p in enumerate(signature.placeholders) if i not in signature.constants]
    if len(tensors) != len(shapes) or signature.var_positional or signature.var_keyword:
        raise UsageError("the plan's inputs are not all tensors it was measured on\ngive them "
                         "with --tokens BxS or --input SHAPE (once per positional input)")
    vocabularies = _token_inputs(plan)
    torch.manual_seed(0)
    values: dict[str, Any] = {}
    for name, micro in zip(tensors, shapes):
        shape = list(micro)
        dim = plan.batch_dims.get(name, 0)
        if isinstance(dim, int) and 0 <= dim < len(shape):
            shape[dim] *= plan.chunks
        if name in vocabularies:
            values[name] = torch.randint(0, vocabularies[name], shape)
            continue
        cost = measurement.costs.get(name)
        size = cost.out_bytes // max(math.prod(micro), 1) if cost is not None else 4
        kind = dtype or _FLOATS_BY_SIZE.get(size, torch.bool if size == 1 else torch.float32)
        values[name] = (torch.randn(shape).to(kind) if kind.is_floating_point else
                        torch.randint(0, 2 if kind == torch.bool else 100, shape).to(kind))
    leaves = [signature.constants[i] if i in signature.constants else values[p]
              for i, p in enumerate(signature.placeholders)]
    if signature.in_spec is not None:       # export: the leaves of (args, kwargs)
        inputs, keywords = torch.utils._pytree.tree_unflatten(leaves, signature.in_spec)
        return tuple(inputs), dict(keywords)
    positional = leaves[:signature.positional]
    return tuple(positional), dict(zip(signature.names[signature.positional:],
                                       leaves[signature.positional:]))


# ---- reading the command line -------------------------------------------------------------------

def _model(target: str, kwargs: str, *, config: str | None = None, meta: bool = False,
           dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The model `target` builds: called with `kwargs`, or from `config`, on meta with `meta`,
    in `dtype` (a float dtype) when given."""
    factory = _factory(target)
    options = _json_object("--kwargs", kwargs, "'{\"num_classes\": 10}'")
    builder = _hugging_face_builder(factory) if config is not None else None
    if config is not None and builder is None:
        options = {**_json_object(f"--config {config}", _read(config),
                                  "a JSON object of the factory's keyword arguments"), **options}
    def build() -> Any:
        if builder is not None:
            hf_config = _hugging_face_config(config, options, dtype)
            try:
                return builder(hf_config)
            except Exception as e:       # a configuration the factory does not build
                raise UsageError(f"{target} from --config {config} failed\n"
                                 f"{type(e).__name__}: {_first_line(e)}") from None
        try:
            return factory(**options)
        except Exception as e:       # the factory's own complaint, e.g. a missing argument
            raise UsageError(f"{target}(**{options}) failed\n{type(e).__name__}: "
                             f"{_first_line(e)}\npass its arguments with --kwargs") from None

    with _in_dtype(dtype):
        # On meta, its buffers computed (a rotary inv_freq): the plan keeps them, so that it
        # runs from a checkpoint alone (no checkpoint holds a non-persistent buffer).
        model = build_on_meta(build) if meta else build()
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{target} returned a {type(model).__name__}, not an nn.Module")
    if dtype is not None and any(p.is_floating_point() and p.dtype != dtype
                                 for p in model.parameters()):
        model = model.to(dtype)      # a factory that fixed its own dtype
    return model


def _factory(target: str) -> Any:
    """The callable `module:factory` names."""
    module_name, _, factory_name = target.partition(":")
    if not module_name or not factory_name:
        raise UsageError(f"model {target!r} is not module:factory\nwrite it as "
                         f"module:factory, e.g. torch.nn:TransformerEncoderLayer")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"cannot import {module_name!r} ({e})\nis it installed, or on "
                         f"PYTHONPATH?") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise UsageError(f"{module_name!r} has no factory {factory_name!r}")
    return factory


def _json_object(what: str, text: str, example: str) -> dict[str, Any]:
    """`text` read as a JSON object."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{what} {text if len(text) < 60 else text[:57] + '...'!r} is not "
                         f"JSON ({e.msg})\ne.g. {example}") from None
    if not isinstance(options, dict):
        raise UsageError(f"{what} is not a JSON object\ngive a JSON object of keyword "
                         f"arguments")
    return options


def _read(config: str) -> str:
    """The text of the configuration file `config`."""
    path = Path(config)
    if not path.is_file():
        raise UsageError(f"--config {config}: no such file")
    return path.read_text()


def _hugging_face_builder(factory: Any) -> Any:
    """How a Hugging Face factory builds a model from its configuration (an `AutoModel...`
    class's `from_config`, a model class's `_from_config`), None for any other factory."""
    if callable(getattr(factory, "from_config", None)):
        return factory.from_config
    if isinstance(factory, type) and hasattr(factory, "config_class") and \
            callable(getattr(factory, "_from_config", None)):
        return factory._from_config
    return None


def _hugging_face_config(config: str, overrides: dict[str, Any],
                         dtype: torch.dtype | None) -> Any:
    """The Hugging Face configuration in the file `config` (a config.json, or a directory
    holding one), read from disk, `overrides` set on it, in `dtype` when given."""
    path = Path(config)
    if not (path / "config.json" if path.is_dir() else path).is_file():
        raise UsageError(f"--config {config}: no such file" + (
            " (the directory holds no config.json)" if path.is_dir() else ""))
    from transformers import AutoConfig
    try:
        loaded = AutoConfig.from_pretrained(str(path), local_files_only=True, **overrides)
    except Exception as e:       # not JSON, an unknown model_type
        raise UsageError(f"--config {config}: transformers cannot load it\n"
                         f"{type(e).__name__}: {_first_line(e)}") from None
    if dtype is not None:
        loaded.dtype = dtype
    return loaded


@contextlib.contextmanager
def _in_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Inside, floating tensors are made in `dtype` when given."""
    default = torch.get_default_dtype()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        yield
    finally:
        torch.set_default_dtype(default)


def _dtype(name: str) -> torch.dtype:
    """The torch dtype `name` says: a torch name (bfloat16, float32, int64) or bf16, fp16,
    fp32, fp64."""
    dtype = getattr(torch, DTYPE_NAMES.get(name.lower(), name), None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"--dtype {name!r} is not a torch dtype\ne.g. float32, bf16, "
                         f"fp16, int64")
    return dtype


DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32",
               "f32": "float32", "fp64": "float64", "f64": "float64"}


def _token_shape(text: str) -> tuple[int, int]:
    """`--tokens BxS` as (B, S)."""
    try:
        shape = tuple(int(size) for size in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 2 or min(shape) < 1:
        raise UsageError(f"--tokens {text!r} is not BxS\na batch of B sequences of S tokens, "
                         f"sizes >= 1, e.g. 1x512")
    return shape


def _vocabulary(model: torch.nn.Module) -> int:
    """How many token ids `model` takes: its input embedding's rows (a Hugging Face model's
    `get_input_embeddings()`, else its first `nn.Embedding`), else its config's
    `vocab_size`."""
    embedding = None
    if callable(getattr(model, "get_input_embeddings", None)):
        try:
            embedding = model.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            embedding = None
    if not isinstance(embedding, torch.nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if embedding is not None:
        return embedding.num_embeddings
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    raise UsageError("--tokens: the model has no nn.Embedding (nor config.vocab_size)\n"
                     "nothing says its vocabulary; give its inputs with --input SHAPE --dtype "
                     "int64")


def _devices(text: str, memory: float | None) -> list[str | fxpipe.DeviceSpec]:
    """`--devices`: comma-separated names, each with `=SIZE` (its memory) if wanted; `memory`
    (`--memory`) for those without."""
    devices: list[str | fxpipe.DeviceSpec] = []
    for entry in text.split(","):
        name, given, size = (part.strip() for part in entry.partition("="))
        if not name:
            raise UsageError(f"--devices {text!r}: a device name is missing\ne.g. "
                             f"cpu:0=400MB,cpu:1=400MB")
        bytes_ = _size(f"--devices {entry.strip()!r}:", size) if given else memory
        devices.append(name if bytes_ is None else fxpipe.DeviceSpec(name, memory_bytes=bytes_))
    return devices


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def _size(what: str, text: str) -> float:
    """A memory size: bytes (8e9), or with a unit (400MB, 80GB, 16GiB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match[2] not in _UNITS or not float(match[1]) > 0:
        raise UsageError(f"{what} {text!r} is not a memory size\nbytes > 0, e.g. 8e9, 400MB, "
                         f"80GB or 16GiB")
    return float(match[1]) * _UNITS[match[2]]


def _random_inputs(shapes: Sequence[str], dtype_name: str) -> tuple[torch.Tensor, ...]:
    dtype = _dtype(dtype_name)
    torch.manual_seed(0)
    inputs = []
    for text in shapes:
        try:
            shape = [int(size) for size in text.lower().split("x")]
        except ValueError:
            shape = []
        if not shape or min(shape) < 1:
            raise UsageError(f"--input {text!r} is not a shape\nsizes >= 1 joined by x, "
                             f"e.g. 8x3x224x224")
        inputs.append(torch.randint(0, 100, shape, dtype=dtype) if not dtype.is_floating_point
                      else torch.randn(shape, dtype=dtype))
    return tuple(inputs)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def _batch_dims(text: str) -> Any:
    """--batch-dims: an int or null for every input, or a list of them, one per --input."""
    try:
        dims = json.loads(text)
    except json.JSONDecodeError:
        dims = text
    if dims is None or (isinstance(dims, int) and not isinstance(dims, bool)):
        return dims
    if isinstance(dims, list) and all(d is None or (isinstance(d, int) and not isinstance(d, bool))
                                      for d in dims):
        return dict(enumerate(dims))
    raise UsageError(f"--batch-dims {text!r} is not a dimension\ngive an int (1: every input's "
                     f"dimension 1), null, or a list with one per --input, e.g. [1, null]")


def _count(text: str) -> int | str:
    """A count option as given: a number, or "auto" (and any other text, which the options
    refuse by name)."""
    return int(text) if text.isdigit() else text


def _ms(value) -> str:
    return f"{float(value) * 1e3:.3f} ms"


if __name__ == "__main__":
    sys.exit(main())
