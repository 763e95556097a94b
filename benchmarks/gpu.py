"""On a GPU: the plan's choice and the pipeline's time against the model run whole on that GPU.

    python -m benchmarks.gpu [--repeats 10] [--training] [--models "residual MLP" vit]

For each model (the residual MLP of the planner issue, the zoo's ViT and ResNet-50 at "small"
size, at GPU-sized batches), with the model and its input on `cuda:0`, fxpipe compiles onto
`cuda:0` twice (two stages sharing the GPU, 4 micro-batches, as fixed), onto the same with every
choice left to the plan (`num_stages="auto"`, `chunks="auto"`, `schedule="auto"`), and onto
`cuda:0` beside a CPU stage (auto: the heterogeneous plan). The table prints, per configuration,
what runs, the measured time per call (per `train_step` with `--training`) beside the model run
whole on the GPU in the same interleaved rounds, their ratio, and the plan's predicted time.
Every timed call ends with the GPU's work done (`torch.cuda.synchronize`). Without CUDA it says
so and exits.
"""

from __future__ import annotations

import argparse
import copy

import torch
from tabulate import tabulate
from torch import nn

import fxpipe
from benchmarks.pipeline_throughput import side_by_side
from benchmarks.predict import Block
from examples.zoo import build as zoo

GPU = "cuda:0"


def models():
    torch.manual_seed(0)
    yield "residual MLP", nn.Sequential(*[Block() for _ in range(8)]), torch.randn(2048, 1024)
    for name, batch in (("vit", 128), ("resnet50", 64)):
        case = zoo(name, size="small", batch=batch)
        yield name, case.model, case.example_inputs[0]


def synced(fn):
    def run():
        fn()
        torch.cuda.synchronize()
    return run


CONFIGS = {
    "2 stages on the GPU, 4 chunks": (["cuda:0"] * 2, dict(chunks=4)),
    "2 stages on the GPU, auto": (["cuda:0"] * 2, dict(num_stages="auto", chunks="auto",
                                                         schedule="auto")),
    "GPU + CPU, auto": (["cuda:0", "cpu"], dict(num_stages="auto", chunks="auto",
                                                 schedule="auto")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--training", action="store_true")
    parser.add_argument("--models", nargs="*", default=None)
    options = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here; nothing measured")
        return
    fxpipe.tune_cpu_allocator()
    loss = nn.functional.mse_loss
    rows = []
    for name, model, x in models():
        if options.models and name not in options.models:
            continue
        model, x = copy.deepcopy(model).to(GPU).train(options.training), x.to(GPU)
        target = model(x).detach()
        params = [p for p in model.parameters() if p.requires_grad]

        def run_model():
            if options.training:
                torch.autograd.grad(loss(model(x), target), params)
            else:
                model(x)
        for config, (devices, choices) in CONFIGS.items():
            pipe = fxpipe.compile(model, devices, (x,), training=options.training, **choices)
            step = ((lambda: pipe.train_step(x, target, loss)) if options.training
                    else (lambda: pipe(x)))
            with torch.set_grad_enabled(options.training):
                t = side_by_side({"pipe": synced(step), "model": synced(run_model)},
                                 options.repeats)
            plan = pipe.plan
            runs = ("the model as is" if plan.runs_as_is else
                    f"{len(plan.stages)} stages x {plan.chunks} ({plan.schedule}): "
                    + ", ".join(d.kind for d in plan.partition.devices))
            rows.append((name, config, runs, t["pipe"] * 1e3, t["model"] * 1e3,
                         t["model"] / t["pipe"], plan.record.predicted_step_s * 1e3))
    mode = "training (train_step)" if options.training else "inference"
    print(f"{mode} on {torch.cuda.get_device_name(0)}; ms per call, median of "
          f"{options.repeats}, interleaved, each ending with the GPU's work done")
    print(tabulate(rows, headers=["model", "asked", "runs", "pipeline", "model on GPU",
                                  "speed-up", "predicted"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
