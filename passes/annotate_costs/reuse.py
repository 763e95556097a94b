"""`Reuse`: the nodes that repeat a block measured before, run in the first run only (or never,
known from the capture's types), and the values they hand to measured nodes."""

from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.fx as fx

from ..blocks import blocks, meta_types, repeated_blocks, value_type


class Reuse:
    """Which nodes repeat a block measured before (`fxpipe.passes.blocks`), found from the types
    of the first run; a repeat runs in that run only. Values that cross a block's edge are kept
    through the first run (one per block's output: a decoder layer's hidden state), then only
    those a measured node reads from a repeat, handed to it (copied) in later runs.

    With `early` (a graph on meta, where a run draws every weight it reads), and where the
    capture recorded every block node's type (`blocks.meta_types`), the repeats are found from
    those before the first run, and never run: a measured node reading a repeat's value is given
    the value of the node it repeats (the same type), and the repeat's bytes are that node's
    (`CostInterpreter.copy_repeats`). A decoder's first run then computes one layer, not all."""

    def __init__(self, gm: fx.GraphModule, enabled: bool, early: bool = False):
        self.enabled = enabled
        self.types: dict[fx.Node, Hashable] = {}     # value_type of each value of the first run
        self.of: dict[fx.Node, fx.Node] = {}         # a repeat's node -> the node it repeats
        self.kept: dict[fx.Node, Any] = {}
        block = {n: name for name, nodes in (blocks(gm) if enabled else {}).items()
                 for n in nodes}
        self.crossing = {n for n in block if any(block.get(u) != block[n] for u in n.users)}
        recorded = meta_types(gm) if enabled and early else None
        self.of = repeated_blocks(gm, recorded) if recorded is not None else {}
        self.early = bool(self.of)
        # Early: the nodes whose values stand in for a repeat's that a measured node reads.
        self.standing_in = {self.of[n] for n in self.crossing
                            if n in self.of and any(u not in self.of for u in n.users)}

    def ran(self, n: fx.Node, value: Any) -> None:
        """Record a node's value in the first run."""
        if not self.enabled:
            return
        self.types[n] = value_type(value)
        if n in (self.standing_in if self.early else self.crossing):
            self.kept[n] = value

    def found(self, gm: fx.GraphModule) -> None:
        """After the first run: find the repeats, keep only what measured nodes read of them."""
        if self.early:
            return
        if self.enabled:
            self.of = repeated_blocks(gm, self.types)
        self.kept = {n: v for n, v in self.kept.items()
                     if n in self.of and any(u not in self.of for u in n.users)}

    def skips(self, n: fx.Node) -> bool:
        return n in self.of

    def value(self, n: fx.Node) -> Any:
        return _clone(self.kept.get(self.of[n] if self.early else n))


def _clone(value: Any) -> Any:
    return fx.node.map_aggregate(value, lambda v: v.clone() if isinstance(v, torch.Tensor) else v)
