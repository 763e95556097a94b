"""Streaming one sample at a time: `pipe.stream` on 2 stages against the model called per sample.

    python -m benchmarks.stream [--items 200] [--models "branching CNN" vit]
    python -m benchmarks.stream --train [--items 2000] [--picture stream_train.svg]

For each model (the quickstart's branching CNN, the zoo's ViT at "small" size), at batch 1, side
by side in one run: the model called on one sample after another with 1 thread and with all
cores' threads, and `pipe.stream` over the same samples on 2 CPU stages of one thread each.
Throughput is samples/s over the whole stream; latency is each sample's time from being taken to
its output (median and 95th percentile). At batch 1 intra-op threads scale poorly, which is where
two stages working on consecutive samples pay. Run it alone: two cores are easily shared into
noise.

With `--train`, learning on a drifting stream instead (a regression target that rotates a
quarter turn over the stream): the model trained one item at a time (SGD) on 1 and on all
cores' threads, `pipe.stream_train` in windows of 4 and 16 items (the exact mode) and in the
asynchronous mode (a step per item or per 4 items, gradients up to one step stale) on 2
one-thread stages, all
from the same weights; samples/s, the loss over the last tenth of the stream (and against the
exact mode's in windows of 4), and the loss over the stream drawn into `--picture` (an SVG).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time

import torch
from tabulate import tabulate
from torch.nn import functional as F

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


def drifting(model, x, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` items shaped like `x`, each with a target that is a fixed linear map of the item,
    turned from one map to another (a quarter turn) as the stream goes on."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        width = model(x).shape[-1]
    start, end = (torch.randn(x[0].numel(), width, generator=g) / x[0].numel() ** 0.5
                  for _ in range(2))
    items = []
    for i in range(count):
        angle = math.pi / 2 * i / count
        item = torch.randn(x.shape, generator=g)
        items.append((item, item.flatten(1) @ (math.cos(angle) * start + math.sin(angle) * end)))
    return items


def trained_per_item(model, items, threads: int, lr: float) -> tuple[float, list[float]]:
    """Samples/s and each item's loss of the model trained by SGD on one item after another."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        losses = []
        start = time.perf_counter()
        for x, target in items:
            opt.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return len(items) / (time.perf_counter() - start), losses
    finally:
        torch.set_num_threads(before)


def trained_in_windows(pipe, items, window: int, lr: float, mode: str = "exact"
                       ) -> tuple[float, list[float]]:
    """Samples/s and each item's loss (its window's) of `pipe.stream_train`."""
    opt = torch.optim.SGD(pipe.parameters(), lr=lr)
    losses: list[float] = []
    start = time.perf_counter()
    for loss in pipe.stream_train(items, F.mse_loss, opt, window=window, mode=mode):
        losses.extend([loss.item()] * min(window, len(items) - len(losses)))
    return len(items) / (time.perf_counter() - start), losses


def loss_picture(curves: dict[str, list[float]], title: str, width: int = 720,
                 height: int = 240) -> str:
    """An SVG of each run's loss over the stream (a running mean over 1/50 of it), one colour
    per run, on a shared log scale."""
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    smooth = {}
    for label, losses in curves.items():
        span = max(1, len(losses) // 50)
        smooth[label] = [sum(losses[max(0, i - span):i + 1]) / len(losses[max(0, i - span):i + 1])
                         for i in range(len(losses))]
    low = math.log10(max(1e-12, min(min(v) for v in smooth.values())))
    high = math.log10(max(max(v) for v in smooth.values()))
    high = high if high > low else low + 1

    def point(i: int, n: int, value: float) -> str:
        y = (high - math.log10(max(value, 1e-12))) / (high - low) * (height - 40) + 30
        return f"{40 + i / max(1, n - 1) * (width - 60):.1f},{y:.1f}"

    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 20 * len(curves)}" font-family="sans-serif" font-size="12">',
             f'<text x="40" y="18">{title}: loss over the stream (log scale)</text>']
    for k, (label, values) in enumerate(smooth.items()):
        colour = colours[k % len(colours)]
        points = " ".join(point(i, len(values), v) for i, v in enumerate(values))
        lines.append(f'<polyline fill="none" stroke="{colour}" points="{points}"/>')
        lines.append(f'<text x="40" y="{height + 15 + 20 * k}" fill="{colour}">{label}</text>')
    return "\n".join(lines + ["</svg>"])


def train(options, cores: int) -> None:
    """The `--train` benchmark (see the module's docstring)."""
    rows, pictures = [], []
    for name, model, x in models():
        if options.models and name not in options.models:
            continue
        model.train()
        items = drifting(model, x, options.items)
        runs = {"model per item, 1 thread": lambda m, xs: trained_per_item(m, xs, 1, options.lr),
                f"model per item, {cores} threads":
                    lambda m, xs: trained_per_item(m, xs, cores, options.lr)}
        for window in (4, 16):
            runs[f"stream_train window {window}, 2 stages x 1 thread"] = (
                lambda m, xs, w=window: trained_in_windows(
                    fxpipe.compile(m, ["cpu", "cpu"], (x,), threads_per_stage=1, training=True,
                                   progress=False), xs, w, options.lr))
        for window in (1, 4):
            runs[f"stream_train async window {window}, 2 stages x 1 thread"] = (
                lambda m, xs, w=window: trained_in_windows(
                    fxpipe.compile(m, ["cpu", "cpu"], (x,), threads_per_stage=1, training=True,
                                   progress=False), xs, w, options.lr, mode="async"))
        for run in runs.values():       # warm-up, on copies
            run(copy.deepcopy(model), items[:32])
        results = {label: run(copy.deepcopy(model), items) for label, run in runs.items()}
        base = results["model per item, 1 thread"][0]
        best = results[f"model per item, {cores} threads"][0]
        tail = max(1, options.items // 10)
        exact = sum(results["stream_train window 4, 2 stages x 1 thread"][1][-tail:]) / tail
        for label, (rate, losses) in results.items():
            last = sum(losses[-tail:]) / tail
            rows.append((name, label, rate, rate / base, rate / best, last, last / exact))
        pictures.append(loss_picture({label: losses for label, (_, losses) in results.items()},
                                     name))
    print(f"batch 1, {options.items} samples of a drifting stream, SGD lr={options.lr}, "
          f"{cores} cores")
    print(tabulate(rows, headers=["model", "run", "samples/s", "x 1 thread", f"x {cores} threads",
                                  "loss, last tenth", "x window 4's"], floatfmt=".3g"))
    if options.picture:
        with open(options.picture, "w") as f:
            f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="720" '
                    f'height="{360 * len(pictures)}">' + "".join(
                f'<g transform="translate(0,{k * 360})">{p}</g>' for k, p in enumerate(pictures))
                + "</svg>")
        print(f"\nthe loss over the stream: {options.picture}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=None,
                        help="samples in the stream (default 200; 2000 with --train)")
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--train", action="store_true",
                        help="learning on a drifting stream (pipe.stream_train)")
    parser.add_argument("--lr", type=float, default=1e-3, help="SGD's learning rate (--train)")
    parser.add_argument("--picture", default="stream_train.svg",
                        help="where --train draws the loss over the stream")
    options = parser.parse_args()
    fxpipe.tune_cpu_allocator()
    cores = os.cpu_count() or 1
    if options.train:
        options.items = options.items or 2000
        return train(options, cores)
    options.items = options.items or 200
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
