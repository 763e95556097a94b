"""Training memory: the plan's prediction against a measured run, and what recomputing costs.

    python -m benchmarks.memory [--repeats 5] [--chunks 4]

For a CNN (a chain of convolutions) and a transformer (nn.TransformerEncoder), each on 2 CPU
stages with GPipe and SGD, fxpipe plans three ways: recompute="never", "always", and "auto" under
a memory cap per device that "never" cannot meet (the first, in steps of 5% down from the fullest
stage it plans). For each,
the first table prints every stage's predicted peak (parameters, gradients, what autograd keeps
per micro-batch in flight) and what it chose; the second, per plan, the memory the first
`train_step` added to the process at its peak, measured (resident high-water mark, in a process
of its own that returns freed memory at once: `fxpipe.testing.memory`) beside the prediction
(the stages' gradients and activations: the weights exist before), and the step's time beside the
model trained whole with all cores, timed in interleaved rounds. Goals: measured within 10% of
predicted; "auto" fits its cap with at most half the extra time of "always". CPU stages share one
process, so the measure is the process's, not each stage's. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

import fxpipe
from benchmarks.pipeline_throughput import side_by_side
from fxpipe.passes.cost_model import DeviceSpec, format_bytes

STAGES = 2


def cnn() -> tuple[nn.Module, torch.Tensor]:
    layers = [nn.Conv2d(3, 32, 3, padding=1), nn.ReLU()]
    for _ in range(5):
        layers += [nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)]
    return nn.Sequential(*layers), torch.randn(32, 3, 32, 32)


def transformer() -> tuple[nn.Module, torch.Tensor]:
    layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False), torch.randn(32, 64, 128)


MODELS = {"cnn": cnn, "transformer": transformer}


def compiled(name: str, recompute: str, cap: float, chunks: int):
    torch.manual_seed(0)
    model, x = MODELS[name]()
    devices = [DeviceSpec("cpu", memory_bytes=cap * STAGES)] * STAGES    # cap per stage
    pipe = fxpipe.compile(model.train(), devices, (x,), chunks=chunks, training=True,
                          optimizer="sgd", recompute=recompute)
    return model, x, pipe


def target_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.zeros_like(model(x))


def measure(name: str, recompute: str, cap: float, chunks: int) -> dict:
    """In this process (started for it): the first train_step's peak memory, and the plan."""
    from fxpipe.testing.memory import peak_bytes, return_freed_memory
    return_freed_memory()
    model, x, pipe = compiled(name, recompute, cap, chunks)
    target = target_of(model, x)
    peak = peak_bytes(lambda: pipe.train_step(x, target, F.mse_loss))
    stages = pipe.plan.partition.stages
    state = [b * 1 for b in pipe.plan.stage_param_bytes]       # the weights, there before
    return {"measured": peak,
            "predicted": sum(c.memory_bytes - w for c, w in zip(stages, state)),
            "stages": [(c.memory_kept_bytes, c.memory_recomputing_bytes, c.memory_bytes,
                        "whole" if whole else f"{len(nodes)} nodes" if nodes else "keep",
                        c.recompute_s)
                       for c, whole, nodes in zip(stages, pipe.plan.stage_recompute,
                                                  pipe.plan.record.stage_recomputed or
                                                  ((),) * len(stages))]}


def least_cap_never_meets(name: str, cap: float, chunks: int) -> float:
    """The first memory per device, in steps of 5% down from `cap`, that no plan keeping every
    activation fits."""
    while True:
        cap *= 0.95
        try:
            compiled(name, "never", cap, chunks)
        except fxpipe.PartitionError:
            return cap


def in_own_process(*args) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--measure",
                          json.dumps(args)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*json.loads(args.measure))))
        return
    stage_rows, rows = [], []
    for name in MODELS:
        never = in_own_process(name, "never", float("inf"), args.chunks)
        cap = least_cap_never_meets(name, max(kept for kept, *_ in never["stages"]), args.chunks)
        plans = {"never": never,
                 "always": in_own_process(name, "always", float("inf"), args.chunks),
                 "auto": in_own_process(name, "auto", cap, args.chunks)}
        pipes = {how: compiled(name, how, cap if how == "auto" else float("inf"), args.chunks)
                 for how in plans}
        model, x, _ = pipes["never"]
        target = target_of(model, x)
        torch.manual_seed(0)
        plain, _ = MODELS[name]()
        plain.train()

        def plain_step():
            F.mse_loss(plain(x), target).backward()
        fns = {"model": plain_step}
        fns.update({how: (lambda p=pipe: p.train_step(x, target, F.mse_loss))
                    for how, (_, _, pipe) in pipes.items()})
        times = side_by_side(fns, args.repeats)
        for how, found in plans.items():
            for s, (kept, recomputing, need, recomputes, extra_s) in enumerate(found["stages"]):
                stage_rows.append((name, how, s, format_bytes(kept), format_bytes(recomputing),
                                   format_bytes(need), recomputes, f"{extra_s * 1e3:.2f}"))
            measured, predicted = found["measured"], found["predicted"]
            rows.append((name, how, format_bytes(cap) if how == "auto" else "none",
                         format_bytes(predicted), format_bytes(measured),
                         f"{measured / predicted:.2f}", f"{times[how] * 1e3:.1f}",
                         f"{times['model'] * 1e3:.1f}", f"{times['model'] / times[how]:.2f}x",
                         f"{(times[how] - times['never']) * 1e3:+.1f}"))
    print(tabulate(stage_rows, headers=["model", "recompute", "stage", "keeping",
                                        "recomputing", "planned", "recomputes",
                                        "+ms/micro-batch"]))
    print()
    print(tabulate(rows, headers=["model", "recompute", "cap/device", "predicted step peak",
                                  "measured", "measured/predicted", "step ms", "model ms",
                                  "speed-up", "vs never ms"]))


if __name__ == "__main__":
    main()
