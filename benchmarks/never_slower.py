"""Is a pipeline ever slower than the model? The plan's own choice, measured against the model.

    python -m benchmarks.never_slower [--repeats 7] [--stages 2] [--training] [--load]
                                      [--models NAME ...]

For each model (the residual MLP of the planner issue, the quickstart's branching CNN, a chain of
convolutions, the zoo's ViT, ResNet-50 and DenseNet at "small" size), fxpipe compiles with every choice left
to the plan (`num_stages="auto"`, `chunks="auto"`, `schedule="auto"`) on `--stages` CPU devices,
and the table prints what it chose, the pipeline's measured time per call (per `train_step` with
`--training`) beside the model run whole with all cores, measured in the same interleaved rounds,
and the speed-up the plan predicted ("raced": the plan measured a pipeline predicted faster than
the model as is against it at compile, see docs/choosing.md). Goal: never below 0.95x; where a pipeline pays, the speed-up
predicted. With `--load`, a process of the script's own keeps one core busy while each model is
compiled, and is stopped before the timing: a plan made on a busy machine, run on a quiet one.
Run it alone: two cores are easily shared into noise.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time

import torch
from tabulate import tabulate
from torch import nn

import fxpipe
from benchmarks.pipeline_throughput import build as conv_chain
from benchmarks.pipeline_throughput import side_by_side
from benchmarks.predict import models as predict_models
from examples.zoo import build as zoo


def models():
    yield from predict_models()
    yield "conv chain", conv_chain(48).eval(), torch.randn(64, 3, 32, 32)
    for name in ("resnet50", "densenet"):
        case = zoo(name, size="small", batch=16)
        yield name, case.model, case.example_inputs[0]


@contextlib.contextmanager
def one_core_busy(busy: bool):
    """With `busy`, a process spinning on one core while the block runs."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        yield
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--training", action="store_true")
    parser.add_argument("--load", action="store_true",
                        help="keep one core busy while compiling")
    parser.add_argument("--models", nargs="+", metavar="NAME",
                        help="only these models (names as the table prints them)")
    options = parser.parse_args()
    fxpipe.tune_cpu_allocator()
    cores = torch.get_num_threads()
    rows = []
    for name, model, x in models():
        if options.models and name not in options.models:
            continue
        model.train(options.training)
        start = time.perf_counter()
        with one_core_busy(options.load):
            pipe = fxpipe.compile(model, ["cpu"] * options.stages, (x,), num_stages="auto",
                                  chunks="auto", schedule="auto")
        compile_s = time.perf_counter() - start
        chosen = pipe.plan.record.chosen.config
        if options.training:
            loss = nn.functional.mse_loss
            target = model(x).detach()

            # Each a training step's forward and backward into `.grad`, set to None first
            # (`zero_grad()`), as a training loop runs them.
            def run_model():
                model.zero_grad(set_to_none=True)
                loss(model(x), target).backward()

            def run_pipe():
                pipe.zero_grad(set_to_none=True)
                pipe.train_step(x, target, loss)
            fns = {"pipe": run_pipe, "model": run_model}
        else:
            fns = {"pipe": lambda: pipe(x), "model": lambda: model(x)}
        with torch.set_grad_enabled(options.training):
            t = side_by_side(fns, options.repeats)
        choice = ("the model as is" if pipe.plan.runs_as_is else
                  f"{chosen.num_stages} stages x {chosen.chunks} ({chosen.schedule})")
        # Raced at compile: a pipeline predicted faster than the model as is was measured too.
        choice += " (raced)" if " measured " in pipe.plan.record.reason else ""
        rows.append((name, choice, t["pipe"] * 1e3, t["model"] * 1e3, t["model"] / t["pipe"],
                     pipe.plan.speedup, compile_s))
        print(f"{name}: compiled in {compile_s:.0f} s", flush=True)
    mode = "training (train_step)" if options.training else "inference"
    load = ", compiled with one core busy" if options.load else ""
    print(f"{mode}, {options.stages} CPU devices, {cores} cores{load}; ms per call "
          f"(median of {options.repeats}, interleaved)")
    print(tabulate(rows, headers=["model", "plan chose", "pipeline", f"model {cores} threads",
                                  "measured x", "predicted x", "compile s"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
