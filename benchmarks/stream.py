"""Streaming one sample at a time: `pipe.stream` on 2 stages against the model called per sample.

    python -m benchmarks.stream [--items 200] [--models "branching CNN" vit]

For each model (the quickstart's branching CNN, the zoo's ViT at "small" size), at batch 1, side
by side in one run: the model called on one sample after another with 1 thread and with all
cores' threads, and `pipe.stream` over the same samples on 2 CPU stages of one thread each.
Throughput is samples/s over the whole stream; latency is each sample's time from being taken to
its output (median and 95th percentile). At batch 1 intra-op threads scale poorly, which is where
two stages working on consecutive samples pay. Run it alone: two cores are easily shared into
noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from tabulate import tabulate

import fxpipe
from benchmarks.predict import BranchyCNN
from examples.zoo import build as zoo


def models():
    torch.manual_seed(0)
    yield "branching CNN", BranchyCNN().eval(), torch.randn(1, 3, 32, 32)
    case = zoo("vit", size="small", batch=1)
    yield "vit", case.model, case.example_inputs[0]


def one_by_one(model, items, threads: int) -> tuple[float, list[float]]:
    """Samples/s and per-sample latencies of the model called on each item in turn."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        latencies = []
        start = time.perf_counter()
        for x in items:
            began = time.perf_counter()
            model(x)
            latencies.append(time.perf_counter() - began)
        return len(items) / (time.perf_counter() - start), latencies
    finally:
        torch.set_num_threads(before)


def streamed(pipe, items) -> tuple[float, list[float]]:
    """Samples/s and per-sample latencies (taken by the pipeline to output) of `pipe.stream`."""
    taken: list[float] = []

    def source():
        for x in items:
            taken.append(time.perf_counter())
            yield x

    latencies = []
    start = time.perf_counter()
    for i, _ in enumerate(pipe.stream(source())):
        latencies.append(time.perf_counter() - taken[i])
    return len(items) / (time.perf_counter() - start), latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--models", nargs="*", default=None)
    options = parser.parse_args()
    fxpipe.tune_cpu_allocator()
    cores = os.cpu_count() or 1
    rows, predicted = [], []
    for name, model, x in models():
        if options.models and name not in options.models:
            continue
        pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), threads_per_stage=1, progress=False)
        items = [torch.randn_like(x) for _ in range(options.items)]
        with torch.no_grad():
            runs = {"model, 1 thread": lambda: one_by_one(model, items, 1),
                    f"model, {cores} threads": lambda: one_by_one(model, items, cores),
                    "fxpipe stream, 2 stages x 1 thread": lambda: streamed(pipe, items)}
            for run in runs.values():       # warm-up
                run()
            results = {label: run() for label, run in runs.items()}
        rate, latency = pipe.plan.stream_prediction
        predicted.append((name, rate, latency * 1e3))
        base = results["model, 1 thread"][0]
        best = results[f"model, {cores} threads"][0]
        for label, (rate, latencies) in results.items():
            latencies.sort()
            rows.append((name, label, rate, rate / base, rate / best,
                         statistics.median(latencies) * 1e3,
                         latencies[int(0.95 * (len(latencies) - 1))] * 1e3))
    print(f"batch 1, {options.items} samples, {cores} cores")
    print(tabulate(rows, headers=["model", "run", "samples/s", "x 1 thread", f"x {cores} threads",
                                  "latency p50 ms", "latency p95 ms"], floatfmt=".2f"))
    print("\nthe plan's prediction for the stream (pipe.plan.stream_prediction):")
    print(tabulate(predicted, headers=["model", "samples/s", "latency alone ms"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
