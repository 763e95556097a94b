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
import re
import sys
from typing import Sequence, get_args

import fxpipe
from fxpipe.passes.capture import CAPTURE_MODES
from fxpipe.passes.errors import FxpipeError

from .cli.arguments import UsageError, _batch_dims, _devices  # noqa: F401 (tests)
from .cli.commands import (_convert, _diff, _measured_inputs, _plan, _run, _show,  # noqa: F401
                           _token_inputs, weight_shares)
from .planning.options import LinkName, Recompute
from .runtime.schedules import SCHEDULES
from .plans.pictures import COLOURS  # noqa: F401 (COLOURS: tests)


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
    plan.add_argument("--generate", metavar="LENGTH", default=None,
                      help="plan generation instead (a causal LM, --tokens BxS: B sequences, "
                           "prompts prefilled S tokens at a time, LENGTH tokens in all; --chunks "
                           "the lanes, chosen by the plan when left out; --meta plans it "
                           "without the weights); --save writes it for fxpipe.generate.load_generation")
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


if __name__ == "__main__":
    sys.exit(main())
