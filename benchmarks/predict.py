"""Does the plan predict the run? Predicted against measured time per call, side by side with the
model itself, for inference on this machine's CPU cores.

    python benchmarks/predict.py [--repeats 7]

For each model (the residual MLP of the planner issue: 8 blocks of LayerNorm, Linear 1024->2048,
GELU, Linear 2048->1024, batch 256; and the quickstart's branching CNN) and each stage count and
chunk count, fxpipe compiles a pipeline (each CPU stage with the cores shared evenly, costs measured
with those threads) and the table prints the plan's predicted time per call, the measured one, the
error, and the model run whole with 1 thread and with all cores, measured in the same rounds.
"speed-up" is the model with all cores over the pipeline, measured; "plan says" is the same ratio
as the plan predicts it (it warns below 1). Run it alone: two cores are easily shared into noise.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from tabulate import tabulate
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fxpipe  # noqa: E402
from benchmarks.pipeline_throughput import side_by_side  # noqa: E402
from examples.quickstart import BranchyCNN  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int = 1024):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def models():
    torch.manual_seed(0)
    yield "residual MLP", nn.Sequential(*[Block() for _ in range(8)]).eval(), torch.randn(256, 1024)
    yield "branching CNN", BranchyCNN().eval(), torch.randn(64, 3, 32, 32)


def with_threads(n: int, fn):
    def run():
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            fn()
        finally:
            torch.set_num_threads(before)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    options = parser.parse_args()
    fxpipe.tune_cpu_allocator()
    cores = torch.get_num_threads()
    rows = []
    for name, model, x in models():
        for stages, chunks in [(1, 1), (2, 1), (2, 4), (2, 8)]:
            pipe = fxpipe.compile(model, ["cpu"] * stages, (x,), chunks=chunks)
            with torch.no_grad():
                t = side_by_side({"pipe": lambda: pipe(x), "one": with_threads(1, lambda: model(x)),
                           "all": with_threads(cores, lambda: model(x))}, options.repeats)
            predicted = pipe.plan.predicted_step_s
            rows.append((name, stages, chunks, predicted * 1e3, t["pipe"] * 1e3,
                         100 * (predicted - t["pipe"]) / t["pipe"], t["one"] * 1e3,
                         t["all"] * 1e3, t["all"] / t["pipe"], pipe.plan.speedup))
    print(f"inference, {cores} cores; ms per call (median of {options.repeats})")
    print(tabulate(rows, headers=["model", "stages", "chunks", "predicted", "measured", "err %",
                                  "model 1 thread", f"model {cores} threads", "speed-up",
                                  "plan says"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
