"""What each command does (`plan` and `explain`, `show`, `diff`, `convert`, `run`), and what it
prints beyond the plan: a saved plan's checkpoint share per stage, `run`'s inputs."""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

import torch
from tabulate import tabulate

import fxpipe
from fxpipe.passes.cost_model import format_bytes

from ..plans import saved
from .. import timeline
from ..plans.pictures import write_node_graph, write_stage_graph
from ..plans.report import measured_memory
from ..plans.saved import plan_document
from .arguments import (UsageError, _batch_dims, _count, _devices, _dtype, _model, _ms,
                        _random_inputs, _size, _token_shape, _vocabulary)


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
    if getattr(args, "generate", None) is not None:
        return _plan_generation(args, model, devices, tokens, options)
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


def _plan_generation(args: argparse.Namespace, model: torch.nn.Module, devices: list,
                     tokens: tuple[int, int] | None, options: dict[str, Any]) -> int:
    """`plan --generate LENGTH`: the generation plan (`fxpipe.generate`) of B sequences of up
    to LENGTH tokens, prompts prefilled S at a time (`--tokens BxS`), `--chunks` lanes (left
    out or "auto": chosen by the plan, `fxpipe.planning.generation`);
    printed, and saved with `--save` (`fxpipe.generate.load_generation` reads it). With
    `--meta`, the model is built on meta and planned without being held (its KV caches too:
    shapes only, each stage's bytes printed); saved, the plans hold no weights."""
    from ..generate import plan_generation, save_generation
    if tokens is None or args.input or args.train:
        raise UsageError("--generate plans a causal LM's generation on its token ids\n"
                         "give --tokens BxS (B sequences, prompts prefilled S tokens at a "
                         "time), without --input or --train")
    length = _count(args.generate)
    if not isinstance(length, int) or length <= tokens[1]:
        raise UsageError(f"--generate {args.generate}: not more tokens than the prompt's\n"
                         f"give the tokens in all (prompt and new), more than {tokens[1]}")
    kept = ("chunks", "progress", "link", "verify", "capture", "leaf_modules", "num_stages")
    options = {k: v for k, v in options.items() if k in kept}
    lanes = options.pop("chunks")
    generation = plan_generation(model.eval(), devices, rows=tokens[0], prompt=tokens[1],
                                 length=length, lanes=lanes, **options)
    try:
        print(generation)
        if args.save:
            print(f"saved to {save_generation(generation, args.save)}")
    finally:
        generation.close()
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
    measured = {key[0]: m for key, m in plan.record.measurements.items()}
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
