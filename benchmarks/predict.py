"""Does the plan predict the run? Predicted against measured speed-up, side by side with the model
itself, on this machine's CPU cores.

    python -m benchmarks.predict [--repeats 7] [--training] [--models "README net" vit]

For each model (the README's first model, batch 64; the quickstart's branching CNN, `make demo`'s,
batch 64; and every model of `benchmarks.never_slower`: the residual MLP of the planner issue, a
chain of convolutions, the zoo's ViT, ResNet-50 and DenseNet at "small" size) and each
configuration (2 stages with 4 and 8 micro-batches, a core each on 2 cores; 4 stages with 8,
more stages than cores on 2), fxpipe compiles a pipeline and the table prints the plan's
predicted time per step (a call, or a `train_step` with `--training`), the measured one and how
far apart the two are ("time off": the larger over the smaller), the model run whole with all
cores (forward, or forward and backward), measured in the same interleaved rounds, the speed-up
measured ("measured x": the model over the pipeline), the one the plan claims ("plan says":
`plan.claimed_speedup`, "-" where the plan claims none), whether it claims one and if not why
("claims": "no: cores" where its stages share cores, "no: Python" where a training plan's stages
are mostly Python (its train step's own Python is not priced), "no: unsteady" where its costs or the
model's runs at compile were unsteady), the spreads its steadiness check read (node costs /
the model's runs), how far the claim is from the measurement ("off": the larger over the
smaller) and whether the goal holds ("goal": a claim within 1.25x of the measured speed-up;
"-" where nothing is claimed, which is the rule's other half). The load average is printed
before and after: two cores are easily shared into noise, so run it alone.
"""

from __future__ import annotations

import argparse
import os

import torch
from tabulate import tabulate
from torch import nn

import fxpipe
from fxpipe.plans.report import unclaimed
from benchmarks.compile_time import Net as ReadmeNet     # the README's first model
from benchmarks.pipeline_throughput import build as conv_chain
from benchmarks.pipeline_throughput import WARM_S, side_by_side
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
    """`benchmarks.never_slower`'s first models (it adds the zoo's)."""
    torch.manual_seed(0)
    yield "residual MLP", nn.Sequential(*[Block() for _ in range(8)]).eval(), torch.randn(256, 1024)
    yield "branching CNN", BranchyCNN().eval(), torch.randn(64, 3, 32, 32)
    case = zoo("vit", size="small", batch=32)
    yield "vit", case.model, case.example_inputs[0]


def all_models():
    torch.manual_seed(0)
    yield "README net", ReadmeNet().eval(), torch.randn(64, 32)
    yield from models()
    yield "conv chain", conv_chain(48).eval(), torch.randn(64, 3, 32, 32)
    for name in ("resnet50", "densenet"):
        case = zoo(name, size="small", batch=16)
        yield name, case.model, case.example_inputs[0]


GOAL = 1.25      # a claimed speed-up within this factor of the measured one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--training", action="store_true")
    parser.add_argument("--models", nargs="*", default=None)
    options = parser.parse_args()
    fxpipe.tune_cpu_allocator()
    cores = torch.get_num_threads()
    print(f"load average before: {_load()}", flush=True)
    rows = []
    for name, model, x in all_models():
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
        for stages, chunks in [(2, 4), (2, 8), (4, 8)]:
            pipe = fxpipe.compile(model, ["cpu"] * stages, (x,), chunks=chunks)
            step = ((lambda: pipe.train_step(x, target, nn.functional.mse_loss))
                    if options.training else (lambda: pipe(x)))
            with torch.set_grad_enabled(options.training):
                t = side_by_side({"pipe": step, "all": run_model}, options.repeats)
            plan = pipe.plan
            measured = t["all"] / t["pipe"]
            claimed = plan.claimed_speedup
            off = None if claimed is None else max(claimed, measured) / min(claimed, measured)
            predicted_s = plan.record.predicted_step_s
            rows.append((name, stages, chunks, predicted_s * 1e3, t["pipe"] * 1e3,
                         _apart(predicted_s, t["pipe"]), t["all"] * 1e3, measured,
                         "-" if claimed is None else f"{claimed:.2f}", _claims(plan),
                         f"{plan.record.spread or 0:.0%} / {plan.record.unpipelined_spread or 0:.0%}",
                         "-" if off is None else f"{off:.2f}",
                         "-" if off is None else ("holds" if off <= GOAL else "MISSES")))
            pipe.close()
            print(*rows[-1], flush=True)
    mode = "training (train_step)" if options.training else "inference"
    print(f"load average after: {_load()}")
    print(f"{mode}, {cores} cores; ms per step (median of {options.repeats}, interleaved, after "
          f"{WARM_S} s of warm rounds each)")
    print(tabulate(rows, headers=["model", "stages", "chunks", "predicted", "measured",
                                  "time off", f"model {cores} threads", "measured x",
                                  "plan says", "claims", "spread costs / model", "off", "goal"],
                   floatfmt=".2f"))


def _apart(a: float, b: float) -> float:
    """How far apart two times are: the larger over the smaller."""
    return max(a, b) / min(a, b)


def _claims(plan) -> str:
    """Whether the plan claims a speed-up, and if not, why, in a word."""
    why = unclaimed(plan)
    return ("yes" if not why else "no: cores" if "take turns" in why else
            "no: Python" if "mostly Python" in why else "no: unsteady")


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


if __name__ == "__main__":
    main()
