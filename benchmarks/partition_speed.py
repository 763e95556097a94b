"""How long `fxpipe.passes.partition` takes on synthetic DNN-shaped graphs, and how good the result is.

    python -m benchmarks.partition_speed [--nodes 1000 10000 50000] [--stages 2 4 8 16]

Graphs come from `fxpipe.testing.synthetic_graph` (chains, residual and inception blocks,
U-Net skips; one graph per size, seed 0); devices are `cuda:0 .. cuda:k-1` with default links.
Each cell is the best of `--repeats` runs in pure Python on this machine. Prints a table: time,
bottleneck over the certified lower bound, whether the result is proven optimal, and which
method found and proved it.
"""

from __future__ import annotations

import argparse
import sys
import time

from tabulate import tabulate

from fxpipe.testing import synthetic_graph
from fxpipe.passes.cost_model import DeviceSpec
from fxpipe.passes.partition import Method, Partition, partition


def timed(graph, devices, repeats: int) -> tuple[float, Partition]:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = partition(graph, devices)
        best = min(best, time.perf_counter() - start)
    return best, result


def short(method: Method) -> str:
    """The method line without the numbers that make it long."""
    found, proof = method.found_by, method.proof
    if "DP over" in proof:
        proof = "ideal DP" + (" + B&B" if "branch and bound" in proof else "") + \
                (" bands" if "narrow bands" in proof else "")
    elif "compute over speed" in proof:
        proof = "compute/speed"
    return f"{found} | {proof}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 10000, 50000])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    rows = []
    for n in args.nodes:
        graph = synthetic_graph(n, seed=0)
        for k in args.stages:
            devices = [DeviceSpec(f"cuda:{i}") for i in range(k)]
            seconds, result = timed(graph, devices, args.repeats)
            rows.append((n, k, seconds, result.gap, "yes" if result.optimal else "no",
                         short(result.method)))
            print(f"  {n} nodes, {k} stages: {seconds:.3f} s", file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["nodes", "stages", "seconds", "bottleneck / bound",
                                  "proven optimal", "found by | bound from"],
                   floatfmt=(".0f", ".0f", ".3f", ".4f")))


if __name__ == "__main__":
    main()
