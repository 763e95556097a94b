"""Partition quality on the zoo's real architectures: fxpipe against the peers' split policies.

    python -m benchmarks.partition_quality [--size tiny] [--stages 2 4 8] [--repeats 5]

Each zoo model (ResNet-50, Inception, DenseNet, MobileNet, U-Net, ViT and Swin transformers) is
traced and its nodes timed on this CPU (`annotate_costs`); the stages are planned for k GPUs
(`cuda:0 .. cuda:k-1`, default links: 20 GB/s, 10 us). Every policy is priced by the same cost
model (`cost_model.stage_costs`): compute plus transfers, one per (producer, receiving stage).

Peers, reimplemented on the same costs as contiguous splits of the graph's node order:
- nodes:  equal node counts per stage (DeepSpeed `partition_method="uniform"`);
- params: equal parameter bytes per stage (DeepSpeed `"parameters"`, PiPPy
          `split_into_equal_size`): a stage ends where the running total passes s/k of the whole;
- time:   least largest compute per stage (torchgpipe `balance_by_time`, its block partition).

Columns: bottleneck / fxpipe's lower bound for each policy (1.000 is optimal), whether fxpipe's
is proven optimal, fxpipe's win over the best peer (how much longer that peer's bottleneck is),
and the MB crossing stages per micro-batch (each value counted once per receiving stage).

With `--independent`, every policy plans on one measurement and is priced on a second,
independent one (the same graph timed again): what a plan is worth when the run does not see
the costs it was planned on. The ratios are then to the optimum of the second measurement
(fxpipe's partition of it), so noise in the first shows as a ratio above 1 for every policy.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from tabulate import tabulate

from examples.zoo import ZOO, build
from fxpipe.passes.annotate_costs import annotate_costs
from fxpipe.passes.cost_model import CostGraph, DeviceSpec, cost_graph
from fxpipe.passes.partition import evaluate, partition
from fxpipe.passes.capture import trace

PEERS = ("nodes", "params", "time")


def split_by_weight(weights: list[float], k: int) -> list[int]:
    """Stage of each item: stage s ends at the first item where the running total reaches
    (s + 1) / k of the whole, keeping one item at least per stage."""
    total = sum(weights)
    stages, done, stage = [], 0.0, 0
    for position, w in enumerate(weights):
        left = len(weights) - position
        if stage < k - 1 and (left <= k - 1 - stage or
                              position and total and done >= total * (stage + 1) / k):
            stage += 1
        stages.append(stage)
        done += w
    return stages


def split_min_max(weights: list[float], k: int) -> list[int]:
    """Stage of each item: the contiguous split with the least largest sum (exact DP, O(k n^2);
    ties: earliest cuts), as torchgpipe's block partition computes it."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for end in range(s, n - (k - s) + 1):
            for start in range(s - 1, end):
                value = max(best[s - 1][start], prefix[end] - prefix[start])
                if value < best[s][end]:
                    best[s][end], cut[s][end] = value, start
    stages, end = [0] * n, n
    for s in range(k, 0, -1):
        start = cut[s][end]
        stages[start:end] = [s - 1] * (end - start)
        end = start
    return stages


def peer_split(graph: CostGraph, policy: str, k: int) -> list[int]:
    nodes = graph.compute_nodes
    weights = {"nodes": [1.0] * len(nodes), "params": [graph.param_bytes[i] for i in nodes],
               "time": [graph.time_s[i] for i in nodes]}[policy]
    stages = (split_min_max if policy == "time" else split_by_weight)(weights, k)
    stage_of = [-1] * len(graph)
    for i, s in zip(nodes, stages):
        stage_of[i] = s
    return stage_of


def crossing_mb(graph: CostGraph, stage_of: list[int]) -> float:
    """Bytes moved between stages, each value once per receiving stage (driver I/O excluded)."""
    total = 0
    for i in graph.compute_nodes:
        receivers = {stage_of[j] for j in graph.succs[i]} - {stage_of[i]}
        total += graph.out_bytes[i] * len(receivers)
    return total / 1e6


def costed(name: str, size: str, repeats: int, times: int = 1) -> list[CostGraph]:
    """The model's graph costed `times` times, each measurement on its own."""
    case = build(name, size=size, batch=4)
    gm = trace(case.model, case.example_inputs, case.example_kwargs)
    graphs = []
    for _ in range(times):
        annotate_costs(gm, case.example_inputs, case.example_kwargs, device="cpu",
                       repeats=repeats)
        graphs.append(cost_graph(gm))
    return graphs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "small", "full"))
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=[m for m in ZOO if m != "dynamic"])
    parser.add_argument("--independent", action="store_true",
                        help="plan on one measurement, price on a second, independent one")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rows, losses = [], []
    for name in args.models:
        graphs = costed(name, args.size, args.repeats, 2 if args.independent else 1)
        graph, priced = graphs[0], graphs[-1]     # planned on, priced on
        for k in args.stages:
            devices = [DeviceSpec(f"cuda:{i}") for i in range(k)]
            ours = partition(graph, devices)
            stage_of = [ours.stage_of.get(n, -1) for n in graph.names]
            ours_s = evaluate(priced, stage_of, devices).bottleneck_s
            peers = {p: peer_split(graph, p, k) for p in PEERS}
            theirs = {p: evaluate(priced, s, devices).bottleneck_s for p, s in peers.items()}
            best_peer = min(theirs.values())
            if ours_s > best_peer * (1 + 1e-9):
                losses.append(f"{name} k={k}")
            bound = (partition(priced, devices).bottleneck_s if args.independent
                     else ours.lower_bound_s)
            rows.append((name, len(graph.compute_nodes), k, ours_s / bound,
                         *(theirs[p] / bound for p in PEERS),
                         "yes" if ours.optimal else "no",
                         f"{(best_peer / ours_s - 1) * 100:+.1f}%",
                         crossing_mb(graph, stage_of),
                         *(crossing_mb(graph, peers[p]) for p in PEERS)))
            print(f"  {name} k={k} done", file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["model", "nodes", "k", "fxpipe", "nodes", "params", "time",
                                  "proven", "win vs best peer", "MB fxpipe", "MB nodes",
                                  "MB params", "MB time"],
                   floatfmt=(".0f", ".0f", ".0f", ".3f", ".3f", ".3f", ".3f", "", "",
                             ".2f", ".2f", ".2f", ".2f")))
    print("\nbottleneck / " + ("the optimum of an independent second measurement"
                               if args.independent else "lower bound per policy (fxpipe's bound)")
          + ", MB crossing stages per micro-batch")
    if losses:
        print(f"fxpipe is slower than a peer on: {', '.join(losses)}")
    else:
        print(f"fxpipe is at least as fast as every peer on all {len(rows)} rows")


if __name__ == "__main__":
    main()
