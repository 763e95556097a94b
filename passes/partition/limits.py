"""How much work the exact methods may do: the caller's `Limits`, and the `_Budget` counting it.

Limits keep the exact methods fast in pure Python; beyond them the slicing result stands, with a
weaker bound. They count work, not time, so that results do not depend on the machine's load.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Limits:
    """The partitioner's work limits; the defaults take about a second here at most.

    `ideals`: ideals listed before the exact DP is given up (~0.3 s to list 50,000);
    `prefix_nodes`: nodes up to which each order's slicing is also solved exactly;
    `work`: subset tests + 8 per candidate stage + a stage's node count per recomputation
    choice tried (`cost_model.choose_recomputed`), per device order (~1 s here);
    `device_orders`: device orders `reorder_devices` may try.
    """

    ideals: int = 50_000
    prefix_nodes: int = 3_000
    work: int = 1_000_000
    device_orders: int = 24


class _OverBudget(Exception):
    """The budget ran out: the exact method that spent it stops."""


class _Budget:
    """Counts the exact methods' work (subset tests; 8 per candidate stage) against a limit.

    Work, not time, so that the result does not depend on the machine's load.
    """

    def __init__(self, limit: int):
        self.left = limit
        self.floor = 0

    def spend(self, amount: int) -> None:
        self.left -= amount
        if self.left < self.floor:
            raise _OverBudget

    @contextlib.contextmanager
    def share(self, fraction: float) -> Iterator[None]:
        """Within the block, spend at most `fraction` of what is left."""
        saved = self.floor
        self.floor = max(saved, self.left - int(self.left * fraction))
        try:
            yield
        finally:
            self.floor = saved
