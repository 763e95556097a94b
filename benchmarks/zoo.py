"""Every real architecture through `fxpipe.compile`: how it was captured, split, and if it matches.

    python -m benchmarks.zoo [--size small] [--stages 4] [--chunks 4] [--batch 8]
                             [--capture auto] [--models resnet50 llama ...]

The zoo's vision models (examples/zoo) and, when `transformers` is installed, Hugging Face
GPT-2, BERT, T5, Llama, Mistral and DistilBERT built from small configs (random weights, no
network). Each is compiled onto `--stages` CPU stages and called once on its example.

Columns: the model; the nodes of its captured graph (ops, parameters not counted); the capture
path (`fx`, `fx+leaves`, `export`); the stages; the predicted bottleneck of one micro-batch over
the partitioner's lower bound (1.00 is optimal); the bytes crossing stages per micro-batch; the
wall time of `fxpipe.compile` (capture, costs, partition, codegen, the output check); whether the
pipeline's output equals the model's (largest absolute difference).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch
import torch.utils._pytree as pytree
from tabulate import tabulate

import fxpipe
from examples.zoo import ZOO, build
from examples.zoo.hf import HF_MODELS, build_hf

def largest_difference(actual, expected) -> float:
    pairs = zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected))
    return max((float((a - e).abs().max()) for a, e in pairs if isinstance(e, torch.Tensor)),
               default=0.0)


def row(name: str, model, args: tuple, kwargs: dict, options: argparse.Namespace) -> list:
    start = time.perf_counter()
    try:
        pipe = fxpipe.compile(model, ["cpu"] * options.stages, args, kwargs,
                              chunks=options.chunks, capture=options.capture)
    except fxpipe.FxpipeError as error:
        return [name, "", "failed", "", "", "", "", str(error).splitlines()[0][:60]]
    compile_s = time.perf_counter() - start
    with torch.no_grad():
        difference = largest_difference(pipe(*args, **kwargs), model(*args, **kwargs))
    plan = pipe.plan.partition
    capture = pipe.plan.capture
    ops = sum(n.op not in ("placeholder", "output", "get_attr") for n in pipe.module.graph.nodes)
    return [name, ops, str(capture.method) + (f" ({', '.join(capture.leaves)})" if capture.leaves else ""),
            plan.num_stages, f"{plan.bottleneck_s / plan.lower_bound_s:.2f}",
            sum(s.sent_bytes for s in plan.stages), f"{compile_s:.1f}",
            f"yes ({difference:.0e})" if difference < 1e-3 else f"NO ({difference:.0e})"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "full"])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--capture", default="auto", choices=["auto", "fx", "export"])
    parser.add_argument("--models", nargs="*", help="zoo or Hugging Face model names (all)")
    options = parser.parse_args()
    try:
        import transformers  # noqa: F401
        hf = list(HF_MODELS)
    except ImportError:
        hf = []
    names = options.models or [*ZOO, *hf]
    torch.set_num_threads(1)            # stages share the cores; one intra-op thread each
    warnings.filterwarnings("ignore")
    rows = []
    for name in names:
        if name in ZOO:
            case = build(name, size=options.size, batch=options.batch)
            model, args, kwargs = case.model, case.example_inputs, case.example_kwargs
        else:
            (model, kwargs), args = build_hf(name, options.size, options.batch), ()
        rows.append(row(name, model, args, kwargs, options))
        print(f"  {name}: done", file=sys.stderr, flush=True)
    print(f"fxpipe.compile on {options.stages} CPU stages, {options.chunks} micro-batches, "
          f"batch {options.batch}, zoo size {options.size!r}, capture={options.capture!r}")
    print(tabulate(rows, headers=["model", "nodes", "capture", "stages", "bottleneck / bound",
                                  "bytes crossing", "compile s", "matches"],
                   colalign=("left", "right", "left", "right", "right", "right", "right", "left"),
                   disable_numparse=True))


if __name__ == "__main__":
    main()
