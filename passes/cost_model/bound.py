"""The lower bound: no partition onto the devices has a smaller bottleneck (`lower_bound_s`)."""

from __future__ import annotations

import collections
import math
from typing import Sequence

from .graph import CostGraph
from .values import DeviceSpec


def lower_bound_s(graph: CostGraph, devices: Sequence[DeviceSpec]) -> float:
    """No partition onto `devices` has a bottleneck below this.

    The slowest node must run whole on the device it is fastest on. And for any weights
    w_d >= 0 summing to 1, the weighted average of the stages' compute, which is at most the
    bottleneck, is at least sum_i min_d w_d t_i(d): node `i` counts at its cheapest weighted
    device. With w_d proportional to a device's speed (the reciprocal of its total time) this
    is total compute over total speed; when devices of different kinds are faster at different
    nodes, `_best_weights` searches for larger weights' bound.
    """
    nodes = graph.compute_nodes
    if not nodes:
        return 0.0
    # Devices with the same times are interchangeable: one group, its weight shared evenly.
    groups: dict[tuple[float, ...], int] = collections.Counter(
        tuple(map(graph.device_times(d).__getitem__, nodes)) for d in devices)
    columns, counts = list(groups), list(groups.values())
    largest = max(min(column[at] for column in columns) for at in range(len(nodes)))
    return max(largest, _best_weights(columns, counts))


def _weighted_bound(columns: Sequence[Sequence[float]], counts: Sequence[int],
                    share: Sequence[float]) -> float:
    """sum_i min_g share[g] * columns[g][i]: the bound of weights `share[g]` per device of group
    `g` (the shares times the counts sum to 1)."""
    return sum(min(u * t for u, t in zip(share, ts)) for ts in zip(*columns))


def _best_weights(columns: Sequence[Sequence[float]], counts: Sequence[int]) -> float:
    """The bound of good weights: from weights proportional to speed, which are optimal when
    every group's column is a multiple of the others', a few rounds of moving weight between
    two groups, each a search on a concave function of one variable."""
    totals = [sum(column) for column in columns]
    if min(totals) <= 0:
        return 0.0
    norm = sum(c / t for c, t in zip(counts, totals))
    share = [1 / (t * norm) for t in totals]
    best = _weighted_bound(columns, counts, share)
    proportional = all(all(math.isclose(a * totals[0], b * t, rel_tol=1e-9)
                           for a, b in zip(columns[0], column))
                       for column, t in zip(columns, totals))
    if proportional:
        return best
    for _ in range(1 if len(columns) == 2 else 3):    # with two groups one search is exhaustive
        for g in range(len(columns)):
            for h in range(g + 1, len(columns)):
                # Move delta of the total weight from group h to group g (delta may be < 0).
                low, high = -share[g] * counts[g], share[h] * counts[h]

                def moved(delta: float) -> list[float]:
                    u = list(share)
                    u[g] += delta / counts[g]
                    u[h] = max(0.0, u[h] - delta / counts[h])
                    u[g] = max(0.0, u[g])
                    return u

                for _ in range(40):     # ternary search: the bound is concave in delta
                    a, b = low + (high - low) / 3, high - (high - low) / 3
                    if _weighted_bound(columns, counts, moved(a)) < \
                            _weighted_bound(columns, counts, moved(b)):
                        low = a
                    else:
                        high = b
                candidate = moved((low + high) / 2)
                value = _weighted_bound(columns, counts, candidate)
                if value > best:
                    best, share = value, candidate
    return best
