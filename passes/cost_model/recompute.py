"""Recomputing part of a stage's forward: the stage's nodes as the choice reads them
(`StageNodes`), what a set of recomputed nodes keeps (`stage_memory`), and the greedy choice of
the nodes that make a stage fit (`choose_recomputed`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, NamedTuple, Sequence

from .graph import CostGraph
from .memory import Held, Memory


@dataclass(frozen=True)
class Choice:
    """What a stage recomputes: node names, the time that adds per micro-batch, and what the
    stage keeps per micro-batch in flight and while one micro-batch is recomputed."""

    nodes: tuple[str, ...]
    extra_s: float
    kept_bytes: int          # per micro-batch in flight
    transient_bytes: int     # one micro-batch's recomputed activations, during its backward


class StageNodes(NamedTuple):
    """One stage's nodes in graph order, what choosing the ones it recomputes reads
    (`stage_nodes`): per node its name, its forward time on the stage's device, what it saves
    for its backward and what its output weighs, whether it may be recomputed, the stage's nodes
    it reads whose output no node keeps (a recomputed run reading one keeps it), the stage's
    nodes reading it, and whether anything outside the stage reads it (a later stage, the
    output). Nodes are indices into the stage."""

    names: tuple[str, ...]
    fwd_s: tuple[float, ...]
    saved_bytes: tuple[int, ...]
    out_bytes: tuple[int, ...]
    recomputable: tuple[bool, ...]
    unkept_inputs: tuple[tuple[int, ...], ...]
    readers: tuple[tuple[int, ...], ...]
    read_outside: tuple[bool, ...]


def stage_nodes(graph: CostGraph, members: Sequence[int], forward: Sequence[float],
                moved: Collection[int] = ()) -> StageNodes:
    """The `StageNodes` of the stage of `graph`'s nodes `members` (in order), forward times
    `forward` per graph node; the nodes in `moved` keep their output for a later stage in the
    same memory, which takes it over (not saved here: `Held.moved_bytes`)."""
    local = {i: at for at, i in enumerate(members)}
    return StageNodes(
        tuple(graph.names[i] for i in members), tuple(forward[i] for i in members),
        tuple(graph.saved_bytes[i] - (graph.out_bytes[i] if i in moved else 0)
              for i in members), tuple(graph.out_bytes[i] for i in members),
        tuple(graph.recomputable[i] for i in members),
        tuple(tuple(local[p] for p in graph.preds[i] if p in local and not graph.output_kept[p])
              for i in members),
        tuple(tuple(local[j] for j in graph.succs[i] if j in local) for i in members),
        tuple(graph.to_output[i] or any(j not in local for j in graph.succs[i])
              for i in members))


def stage_memory(nodes: StageNodes, recomputed: Collection[str]) -> Choice:
    """What the stage keeps when the nodes named in `recomputed` are recomputed (see `Choice`).

    A recomputed node keeps nothing of its own; each maximal run of consecutive recomputed
    nodes is one checkpoint, which keeps what enters the run (unless a node keeps it already),
    while the nodes reading what leaves the run keep that; the transient is the largest run's
    saved bytes, alive while that run is recomputed."""
    chosen = [name in recomputed for name in nodes.names]
    kept = sum(b for b, c in zip(nodes.saved_bytes, chosen) if not c)
    transient = extra = 0.0
    for run in _runs(chosen):
        entering = {p for i in run for p in nodes.unkept_inputs[i] if p not in run}
        leaving = {i for i in run if nodes.read_outside[i] or
                   any(r not in run for r in nodes.readers[i])}
        kept += sum(nodes.out_bytes[i] for i in entering | leaving)
        transient = max(transient, sum(nodes.saved_bytes[i] for i in run))
        extra += sum(nodes.fwd_s[i] for i in run)
    return Choice(tuple(n for n, c in zip(nodes.names, chosen) if c), extra, int(kept),
                  int(transient))


def _runs(chosen: Sequence[bool]) -> list[range]:
    """The maximal runs of consecutive chosen positions."""
    runs, start = [], None
    for at, c in enumerate([*chosen, False]):
        if c and start is None:
            start = at
        elif not c and start is not None:
            runs.append(range(start, at))
            start = None
    return runs


RECOMPUTE_WINDOW = 4      # the longest run of nodes weighed as one step of `choose_recomputed`
RECOMPUTE_LARGEST = 400   # stages with more candidates recompute whole, rather than search


def choose_recomputed(nodes: StageNodes, *, memory: Memory, stage: int, held: Held,
                      capacity: float, spend: Callable[[int], None] | None = None
                      ) -> Choice | None:
    """The nodes of stage `stage` (holding `held`: its parameters, received and sent values) to
    recompute so that it fits `capacity` by `memory`'s rule (`Memory.need_partial`: what the
    nodes it keeps save per micro-batch in flight, and one micro-batch's recomputed run).
    Greedy: each step adds the run of up to `RECOMPUTE_WINDOW` consecutive candidates that
    frees the most bytes per second of forward it adds (a node alone often frees nothing: its
    neighbours keep its input and output), until the stage fits. None when no step frees more,
    or on a stage too large to search. `spend`, when given, is told the work of each choice
    tried (the stage's node count), and may raise to stop the search."""
    def need(choice: Choice) -> float:
        return memory.need_partial(stage, held, choice.kept_bytes, choice.transient_bytes)

    candidates = [name for name, ok in zip(nodes.names, nodes.recomputable) if ok]
    if len(candidates) > RECOMPUTE_LARGEST:
        return None
    chosen: set[str] = set()
    choice = stage_memory(nodes, chosen)
    while need(choice) > capacity:
        best, best_rate = None, 0.0
        free = [name for name in candidates if name not in chosen]
        for i in range(len(free)):
            for j in range(i + 1, min(i + RECOMPUTE_WINDOW, len(free)) + 1):
                if spend is not None:
                    spend(len(nodes.names))
                trial = stage_memory(nodes, chosen | set(free[i:j]))
                rate = (need(choice) - need(trial)) / max(trial.extra_s - choice.extra_s, 1e-9)
                if rate > best_rate:
                    best, best_rate = trial, rate
        if best is None:
            return None
        chosen, choice = set(best.nodes), best
    return choice
