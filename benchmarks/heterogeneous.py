"""Devices of two speeds: does the faster one get more work, and do the stages take what the plan
says?

    python -m benchmarks.heterogeneous [--devices cpu/2,cpu/1] [--repeats 7]

Each device is `cpu/N` (a CPU stage with N intra-op threads) or `cuda:N`. fxpipe measures every
node on each distinct kind of device (a CPU kind per thread count, each GPU), partitions on those
per-node, per-device costs, and the table prints, per stage: its device, its share of the
model's nodes, the plan's predicted time per micro-batch and the measured one (the median
forward action of that stage over the runs, from `pipe.last_run`). Default devices: a CPU stage with all cores
but one and one with a single thread (three cores or more), or `cuda:0,cpu` when a GPU is here.
On two cores, `cpu/2,cpu/1` asks for more threads than cores: the plan slows both by their share.
Run it alone.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from tabulate import tabulate

import fxpipe
from benchmarks.predict import models
from fxpipe.runtime.schedules import Phase


def parse(text: str) -> list[fxpipe.DeviceSpec]:
    specs = []
    for entry in text.split(","):
        name, _, threads = entry.partition("/")
        specs.append(fxpipe.DeviceSpec(name, threads=int(threads) if threads else None))
    return specs


def default_devices() -> str:
    if torch.cuda.is_available():
        return "cuda:0,cpu"
    cores = os.cpu_count() or 1
    return f"cpu/{max(1, cores - 1)},cpu/1"


def stage_rows(pipe, x, repeats: int) -> list[tuple]:
    """Per stage: its device kind, nodes, predicted and measured forward time per micro-batch."""
    measured: dict[int, list[float]] = {}
    with torch.no_grad():
        pipe(x)
        for _ in range(repeats):
            pipe(x)
            for slot in pipe.last_run.slots:
                if slot.action.phase is Phase.FORWARD:
                    measured.setdefault(slot.action.stage, []).append(slot.end_s - slot.start_s)
    plan = pipe.plan.partition
    return [(s, device.kind, cost.num_nodes, cost.time_s * 1e3,
             statistics.median(measured.get(s, [0.0])) * 1e3)
            for s, (cost, device) in enumerate(zip(plan.stages, plan.devices))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default=default_devices())
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=8)
    options = parser.parse_args()
    fxpipe.tune_cpu_allocator()
    devices = parse(options.devices)
    rows = []
    for name, model, x in models():
        pipe = fxpipe.compile(model, devices, (x,), chunks=options.chunks)
        rows += [(name, *row) for row in stage_rows(pipe, x, options.repeats)]
    print(f"devices {options.devices}, {options.chunks} micro-batches; ms per micro-batch "
          f"(median forward action over {options.repeats} runs)")
    print(tabulate(rows, headers=["model", "stage", "device kind", "nodes",
                                  "predicted ms", "measured ms"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
