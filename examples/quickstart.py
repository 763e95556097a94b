"""Quickstart: let fxpipe plan a branching CNN on this machine's CPU cores, then stream it.

    python examples/quickstart.py [--batch 64] [--items 200]

The model has residual blocks and an Inception-like block with parallel branches; fxpipe traces
it, measures every node, and weighs splitting it into balanced stages against running it as it
is (`num_stages="auto"`, `chunks="auto"`): on a few cores a whole batch usually runs fastest as
it is, with all cores' threads, and the plan says so and why. What a pipeline wins there is a
stream: one sample after another, two one-thread stages working on consecutive samples at once,
against the model called on each sample.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import fxpipe


class Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class Branches(nn.Module):
    """Three parallel branches, concatenated: the graph is not a chain."""

    def __init__(self, channels: int):
        super().__init__()
        third = channels // 4
        self.one = nn.Conv2d(channels, third, 1)
        self.three = nn.Sequential(nn.Conv2d(channels, third, 1), nn.ReLU(),
                                   nn.Conv2d(third, third, 3, padding=1))
        self.pool = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), nn.Conv2d(channels, third, 1))
        self.merge = nn.Conv2d(3 * third, channels, 1)

    def forward(self, x):
        return torch.relu(self.merge(torch.cat([self.one(x), self.three(x), self.pool(x)], dim=1)))


class BranchyCNN(nn.Module):
    def __init__(self, channels: int = 48, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels),
                                  nn.ReLU(inplace=True))
        self.body = nn.Sequential(Residual(channels), Branches(channels), Residual(channels),
                                  Branches(channels), Residual(channels), Residual(channels))
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.body(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def samples_per_s(fn, x, repeats: int = 5) -> float:
    fn(x)                                          # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return x.shape[0] / best


def streamed_per_s(fn, items) -> float:
    """Samples per second of `fn` over `items`, one sample each (after one warm-up item)."""
    fn(items[:1])
    start = time.perf_counter()
    fn(items)
    return len(items) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--items", type=int, default=200)
    args = parser.parse_args()

    fxpipe.tune_cpu_allocator()   # glibc keeps freed activations: fair to both sides (docs/devices.md)
    torch.manual_seed(0)
    model = BranchyCNN().eval()
    x = torch.randn(args.batch, 3, 32, 32)
    cores = torch.get_num_threads()

    # 1. A whole batch: the plan weighs pipelines on every core against the model as it is.
    pipe = fxpipe.compile(model, ["cpu"] * cores, example_inputs=(x,), num_stages="auto",
                          chunks="auto")
    print(pipe.plan)
    with torch.no_grad():
        # The same values up to rounding: micro-batches and stages sum in other orders (other
        # kernels, other thread counts), within float32 epsilons of the output's largest value.
        expected = model(x)
        torch.testing.assert_close(pipe(x), expected, rtol=0,
                                   atol=64 * torch.finfo(x.dtype).eps * expected.abs().max().item())
        model_rate, pipe_rate = samples_per_s(model, x), samples_per_s(pipe, x)
    chosen = ("the model as is" if pipe.plan.runs_as_is else
              f"{pipe.plan.record.chosen.config.num_stages} stages x {pipe.plan.chunks} "
              f"micro-batches")
    print(f"\nbatch {args.batch}, {cores} cores: the model {model_rate:.0f} samples/s, the plan's "
          f"choice ({chosen}) {pipe_rate:.0f} samples/s: {pipe_rate / model_rate:.2f}x")
    pipe.close()

    # 2. A stream of single samples: two one-thread stages work on consecutive samples at once.
    items = [torch.randn(1, 3, 32, 32) for _ in range(args.items)]
    with fxpipe.compile(model, ["cpu", "cpu"], example_inputs=(items[0],),
                        threads_per_stage=1) as streaming, torch.no_grad():
        print(f"\n--- the code of stage 1 of the streaming pipeline (print(pipe.stages[1].code))"
              f" ---{streaming.stages[1].code}")
        one_by_one = streamed_per_s(lambda xs: [model(s) for s in xs], items)
        stream = streamed_per_s(lambda xs: list(streaming.stream(xs)), items)
    print(f"a stream of {args.items} single samples: the model called on each "
          f"{one_by_one:.0f} samples/s ({cores} threads), pipe.stream on 2 stages x 1 thread "
          f"{stream:.0f} samples/s: {stream / one_by_one:.2f}x")


if __name__ == "__main__":
    main()
