"""The command line: plan a model, look at a saved plan, run one.

    python -m fxpipe plan torchvision.models:resnet50 --devices cpu,cpu --input 8x3x224x224
    python -m fxpipe plan mypkg.nets:Net --kwargs '{"width": 64}' --input 16x32 --save plans/net
    python -m fxpipe explain mypkg.nets:Net --input 16x32 --devices cpu,cpu,cpu
    python -m fxpipe show plans/net
    python -m fxpipe diff plans/net plans/net-4
    python -m fxpipe run plans/net --input 16x32

A model is `module:factory`, the factory called with `--kwargs` (JSON) to build it. Inputs are
random tensors of the shapes given (`--input` once per positional input, sizes joined by `x`),
of `--dtype` (integer dtypes draw token ids below 100). Bad input gets one line naming the
problem and exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from typing import Sequence, get_args

import torch

import fxpipe
from fxpipe.passes.errors import FxpipeError

from . import timeline
from .options import LinkName, Recompute
from .pictures import COLOURS, write_node_graph, write_stage_graph  # noqa: F401 (COLOURS: tests)
from .saved import plan_document


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
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"fxpipe {args.name}: error: {first}", file=sys.stderr)
        return 2


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
    show.add_argument("dir")
    show.set_defaults(command=_show, name="show")

    diff = commands.add_parser("diff", help="where two saved plans differ")
    diff.add_argument("first")
    diff.add_argument("second")
    diff.set_defaults(command=_diff, name="diff")

    run = commands.add_parser("run", help="run a saved plan on random inputs; measured "
                                          "against predicted time per stage")
    run.add_argument("dir")
    _inputs(run)
    run.add_argument("--repeats", type=int, default=5, help="timed calls (default: 5)")
    run.set_defaults(command=_run, name="run")
    return parser


def _planning(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="module:factory, e.g. torchvision.models:resnet50")
    parser.add_argument("--devices", default="cpu,cpu",
                        help="comma-separated devices, one per stage (default: cpu,cpu)")
    _inputs(parser)
    parser.add_argument("--kwargs", default="{}", help="the factory's keyword arguments, as JSON")
    parser.add_argument("--chunks", default="1", help="micro-batches per call, or auto")
    parser.add_argument("--stages", default=None, help="number of stages to use, or auto")
    parser.add_argument("--train", action="store_true", help="plan for training (train_step)")
    parser.add_argument("--recompute", choices=get_args(Recompute), default="never",
                        help="recompute activations in training (default: never)")
    parser.add_argument("--optimizer", default="adam",
                        help="the optimizer whose state each training stage holds (default: adam)")
    parser.add_argument("--link", choices=get_args(LinkName), default="default",
                        help="price transfers as hand-offs between threads (default), as copies "
                             "measured here (measure), or as messages between processes, for "
                             "a run under torchrun (gloo)")
    parser.add_argument("--memory", type=float, default=None, metavar="BYTES",
                        help="each device's memory, e.g. 8e9, shared by the stages on it "
                             "(default: a GPU's free memory, CPU unbounded)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _inputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", action="append", required=True, metavar="SHAPE",
                        help="a positional input's shape, e.g. 8x3x224x224 (once per input)")
    parser.add_argument("--dtype", default="float32",
                        help="the inputs' dtype (default: float32; int64 draws token ids)")


# ---- commands -----------------------------------------------------------------------------------

def _plan(args: argparse.Namespace) -> int:
    model = _model(args.model, args.kwargs).train(args.train)
    inputs = _random_inputs(args.input, args.dtype)
    options = {"chunks": _count(args.chunks), "training": args.train,
               "progress": False if args.quiet else None, "recompute": args.recompute,
               "optimizer": args.optimizer, "link": args.link}
    if args.stages is not None:
        options["num_stages"] = _count(args.stages)
    devices = args.devices.split(",")
    if args.memory is not None:
        devices = [fxpipe.DeviceSpec(d, memory_bytes=args.memory) for d in devices]
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
    return 0


def _diff(args: argparse.Namespace) -> int:
    first, second = (plan_document(d) for d in (args.first, args.second))
    lines = []
    for key in ("devices", "chunks", "schedule", "threads", "fxpipe", "torch"):
        if first.get(key) != second.get(key):
            lines.append(f"{key}: {json.dumps(first.get(key))} | {json.dumps(second.get(key))}")
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


def _run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats}: use 1 or more")
    plan = fxpipe.load_plan(args.dir)
    pipe = fxpipe.Pipeline(plan)
    inputs = _random_inputs(args.input, args.dtype)
    with torch.no_grad():
        pipe(*inputs)       # warm-up
        runs = []
        for _ in range(args.repeats):
            pipe(*inputs)
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
    return 0


# ---- reading the command line -------------------------------------------------------------------

def _model(target: str, kwargs: str) -> torch.nn.Module:
    module_name, _, factory_name = target.partition(":")
    if not module_name or not factory_name:
        raise UsageError(f"model {target!r}: write it as module:factory, e.g. "
                         f"torchvision.models:resnet50")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"cannot import {module_name!r} ({e}): is it installed, or on "
                         f"PYTHONPATH?") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise UsageError(f"{module_name!r} has no factory {factory_name!r}")
    try:
        options = json.loads(kwargs)
    except json.JSONDecodeError as e:
        raise UsageError(f"--kwargs {kwargs!r} is not JSON ({e.msg}): e.g. "
                         f"'{{\"num_classes\": 10}}'") from None
    if not isinstance(options, dict):
        raise UsageError(f"--kwargs {kwargs!r}: give a JSON object of keyword arguments")
    try:
        model = factory(**options)
    except Exception as e:       # the factory's own complaint, e.g. a missing argument
        raise UsageError(f"{target}(**{options}) failed: {type(e).__name__}: {e} (pass its "
                         f"arguments with --kwargs)") from None
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{target} returned a {type(model).__name__}, not an nn.Module")
    return model


def _random_inputs(shapes: Sequence[str], dtype_name: str) -> tuple[torch.Tensor, ...]:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"--dtype {dtype_name!r} is not a torch dtype: e.g. float32, "
                         f"bfloat16, int64")
    torch.manual_seed(0)
    inputs = []
    for text in shapes:
        try:
            shape = [int(size) for size in text.lower().split("x")]
        except ValueError:
            shape = []
        if not shape or min(shape) < 1:
            raise UsageError(f"--input {text!r} is not a shape: sizes >= 1 joined by x, "
                             f"e.g. 8x3x224x224")
        inputs.append(torch.randint(0, 100, shape, dtype=dtype) if not dtype.is_floating_point
                      else torch.randn(shape, dtype=dtype))
    return tuple(inputs)


def _count(text: str) -> int | str:
    """A count option as given: a number, or "auto" (and any other text, which the options
    refuse by name)."""
    return int(text) if text.isdigit() else text


def _ms(value) -> str:
    return f"{float(value) * 1e3:.3f} ms"


if __name__ == "__main__":
    sys.exit(main())
