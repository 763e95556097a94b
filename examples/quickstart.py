"""Quickstart: pipeline a branching CNN across CPU "devices" and compare its throughput.

    python examples/quickstart.py [--stages 2] [--chunks 8] [--batch 64]

The model has residual blocks and an Inception-like block with parallel branches; fxpipe traces
it, measures every node, splits it into balanced stages and runs them as a pipeline.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    fxpipe.tune_cpu_allocator()   # glibc keeps freed activations: fair to both sides (docs/devices.md)
    torch.manual_seed(0)
    model = BranchyCNN().eval()
    x = torch.randn(args.batch, 3, 32, 32)
    pipe = fxpipe.compile(model, ["cpu"] * args.stages, example_inputs=(x,), chunks=args.chunks)

    print(pipe.plan)
    print(f"\n--- the code of stage 1 (print(pipe.stages[1].code)) ---{pipe.stages[1].code}")

    with torch.no_grad():
        # The same values up to rounding: micro-batches and stages sum in other orders (other
        # kernels, other thread counts), within float32 epsilons of the output's largest value.
        expected = model(x)
        torch.testing.assert_close(pipe(x), expected, rtol=0,
                                   atol=64 * torch.finfo(x.dtype).eps * expected.abs().max().item())
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        one_thread = samples_per_s(model, x)
        torch.set_num_threads(threads)
        all_threads = samples_per_s(model, x)
        pipelined = samples_per_s(pipe, x)
    print(f"throughput, batch {args.batch}, {args.chunks} micro-batches, {threads} cores:")
    print(f"  model, 1 thread:              {one_thread:8.1f} samples/s")
    print(f"  model, {threads} threads:              {all_threads:8.1f} samples/s")
    print(f"  fxpipe, {args.stages} stages x 1 thread:  {pipelined:8.1f} samples/s  "
          f"({pipelined / one_thread:.2f}x one thread, {pipelined / all_threads:.2f}x {threads} threads)")


if __name__ == "__main__":
    main()
