"""Does the plan predict the run? Predicted against measured time per step, side by side with the
model itself, on this machine's CPU cores.

    python -m benchmarks.predict [--repeats 7] [--training] [--models "residual MLP" vit]

For each model (the residual MLP of the planner issue: 8 blocks of LayerNorm, Linear 1024->2048,
GELU, Linear 2048->1024, batch 256; the quickstart's branching CNN; the zoo's ViT at "small"
size, batch 32), each stage count (1, 2, 4) and chunk count, fxpipe compiles a pipeline (each CPU
stage with the cores shared evenly, costs measured with those threads on the thread it runs on)
and the table prints the plan's predicted time per step (a call, or a `train_step` with
`--training`), the measured one, the error, and the model run whole with 1 thread and with all
cores (forward, or forward and backward), measured in the same interleaved rounds. "speed-up" is
the model with all cores over the pipeline, measured; "plan says" is the same ratio as the plan
predicts it. More stages than cores share cores: the plan does not model that. Run it alone: two
cores are easily shared into noise.
"""

from __future__ import annotations

import argparse

import torch
from tabulate import tabulate
from torch import nn

import fxpipe
from benchmarks.pipeline_throughput import side_by_side
from examples.quickstart import BranchyCNN
from examples.zoo import build as zoo


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
    case = zoo("vit", size="small", batch=32)
    yield "vit", case.model, case.example_inputs[0]


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
    parser.add_argument("--training", action="store_true")
    parser.add_argument("--models", nargs="*", default=None)
    options = parser.parse_args()
    fxpipe.tune_cpu_allocator()
    cores = torch.get_num_threads()
    rows = []
    for name, model, x in models():
        if options.models and name not in options.models:
            continue
        model.train(options.training)
        target = model(x).detach()
        params = [p for p in model.parameters() if p.requires_grad]

        def run_model():
            if options.training:
                torch.autograd.grad(nn.functional.mse_loss(model(x), target), params)
            else:
                model(x)
        for stages, chunks in [(1, 1), (2, 1), (2, 4), (2, 8), (4, 8)]:
            pipe = fxpipe.compile(model, ["cpu"] * stages, (x,), chunks=chunks)
            step = ((lambda: pipe.train_step(x, target, nn.functional.mse_loss))
                    if options.training else (lambda: pipe(x)))
            with torch.set_grad_enabled(options.training):
                t = side_by_side({"pipe": step, "one": with_threads(1, run_model),
                                  "all": with_threads(cores, run_model)}, options.repeats)
            predicted = pipe.plan.predicted_step_s
            rows.append((name, stages, chunks, predicted * 1e3, t["pipe"] * 1e3,
                         100 * (predicted - t["pipe"]) / t["pipe"], t["one"] * 1e3,
                         t["all"] * 1e3, t["all"] / t["pipe"], pipe.plan.speedup))
    mode = "training (train_step)" if options.training else "inference"
    print(f"{mode}, {cores} cores; ms per step (median of {options.repeats})")
    print(tabulate(rows, headers=["model", "stages", "chunks", "predicted", "measured", "err %",
                                  "model 1 thread", f"model {cores} threads", "speed-up",
                                  "plan says"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
