"""One stage's sums as a partition grows it (`StageTally`), which `Pricing` reads both its views
from, and the least of several transfer columns (`_least`, the relaxed views' price)."""

from __future__ import annotations

from typing import Sequence

from .memory import Held


class StageTally:
    """One stage's sums, grown value by value: its compute, forward and backward, what it holds
    (`held`), and its transfers both ways the cost model prices them (`Pricing`): `exact_comm_s`
    over the real link per (producer, receiving stage), `relaxed_comm_s` at the cheapest link
    (0 unless asked for: `Pricing.tally`)."""

    __slots__ = ("compute_s", "forward_s", "backward_s", "num_nodes", "param_bytes",
                 "activation_bytes", "saved_bytes", "received_bytes", "sent_once_bytes",
                 "sent_bytes", "sent_new_bytes", "returned_bytes", "kept_sent_bytes",
                 "exact_comm_s", "relaxed_comm_s")

    def __init__(self):
        self.compute_s = self.forward_s = self.backward_s = 0.0
        self.exact_comm_s = self.relaxed_comm_s = 0.0
        self.num_nodes = self.param_bytes = self.activation_bytes = self.saved_bytes = 0
        self.received_bytes = self.sent_once_bytes = self.sent_bytes = 0
        self.sent_new_bytes = self.returned_bytes = self.kept_sent_bytes = 0

    @property
    def held(self) -> Held:
        """What the stage holds as the relaxed views count it (`Held`)."""
        return Held(self.param_bytes, self.activation_bytes, self.saved_bytes,
                    self.received_bytes, self.sent_once_bytes, self.sent_new_bytes,
                    self.returned_bytes, moved_bytes=self.kept_sent_bytes)


def _least(columns: Sequence[list[float]], n: int, empty: float) -> list[float]:
    """The least of `columns` per node (`empty` when there is no column); a column met
    twice (two stages over one link) is read once."""
    distinct = list({id(c): c for c in columns}.values())
    if not distinct:
        return [empty] * n
    return list(map(min, *distinct)) if len(distinct) > 1 else list(distinct[0])
