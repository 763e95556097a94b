"""Why the plan cut where it did: for each boundary between stages, what crosses it and what a
cut one node earlier or later would cost.

    print(pipe.explain())

A boundary `s | s+1` separates the stages up to `s` from those after. The values that cross it are
those produced at or before stage `s` and read after it (a skip connection from stage 0 to stage
3 crosses three boundaries), each with its producer, its readers, its shape and its bytes per
micro-batch. The alternatives move one node across the boundary: the last node of stage `s` that
can go to stage `s+1` (nothing in stage `s` reads it), or the first node of stage `s+1` that can
go to stage `s` (it reads nothing else of stage `s+1`), each priced by the same cost model and
rules as the plan (`stage_costs` with the plan's links and `Memory`: a stage that would have to
recompute pays for what it recomputes, and a moved cut that fits no device's memory says so); the
plan's bottleneck is the least of them when the partition is optimal.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx as fx

from fxpipe.passes.cost_model import (CostGraph, DeviceSpec, LinkFn, Memory, StageCost,
                                      cost_graph, default_link, format_bytes, stage_costs)


def explain(gm: fx.GraphModule, stage_of: dict[str, int], devices: Sequence[DeviceSpec], *,
            training: bool = False, link: LinkFn = default_link,
            memory: Memory = Memory()) -> str:
    """The explanation of a partition `stage_of` of the costed graph `gm`, priced by the
    plan's `link` and `memory` rules (see the module)."""
    graph = cost_graph(gm, training=training, kinds=[d.kind for d in devices])
    assignment = [stage_of.get(graph.names[i], -1) for i in range(len(graph))]
    k = len(devices)
    costs = stage_costs(graph, assignment, devices, link, memory=memory)
    bottleneck = max(c.time_s for c in costs)
    shapes = {n.name: n.meta.get("shapes", ()) for n in gm.graph.nodes}
    lines = [f"bottleneck {bottleneck * 1e3:.3f} ms per micro-batch (stage "
             f"{max(range(k), key=lambda s: costs[s].time_s)})"]
    for s in range(k - 1):
        lines.append(f"\nboundary {s} | {s + 1}: stage {s} on {devices[s].name} "
                     f"{costs[s].time_s * 1e3:.3f} ms | stage {s + 1} on {devices[s + 1].name} "
                     f"{costs[s + 1].time_s * 1e3:.3f} ms")
        crossing = _crossing(graph, assignment, s)
        total = sum(graph.out_bytes[i] for i, _ in crossing)
        lines.append(f"  crossing: {len(crossing)} value{'s' * (len(crossing) != 1)}, "
                     f"{format_bytes(total)} per micro-batch")
        for i, readers in crossing:
            name = graph.names[i]
            where = ", ".join(f"{graph.names[j]} (stage {assignment[j]})" for j in readers)
            shape = " + ".join("x".join(map(str, sh)) or "scalar" for sh in shapes.get(name, ()))
            origin = "input" if graph.is_input[i] else f"stage {assignment[i]}"
            lines.append(f"    {name} ({origin}) -> {where or 'the output'}: "
                         f"{shape or '?'}, {format_bytes(graph.out_bytes[i])}")
        for label, moved in _moves(graph, assignment, s):
            if moved is None:
                lines.append(f"  one node {label}: no node can move")
                continue
            node, trial = moved
            moved_costs = stage_costs(graph, trial, devices, link, memory=memory)
            lines.append(f"  one node {label} ({graph.names[node]} to stage {trial[node]}): "
                         f"stages {moved_costs[s].time_s * 1e3:.3f} | "
                         f"{moved_costs[s + 1].time_s * 1e3:.3f} ms, bottleneck "
                         f"{max(c.time_s for c in moved_costs) * 1e3:.3f} ms"
                         f"{_overflow(moved_costs, devices, (s, s + 1))}")
    return "\n".join(lines)


def _overflow(costs: Sequence[StageCost], devices: Sequence[DeviceSpec],
              stages: Sequence[int]) -> str:
    """What of `stages` needs more memory than its device has, as a clause ("" if all fit)."""
    over = [f"stage {s} needs {format_bytes(costs[s].memory_bytes)} but {devices[s].name} has "
            f"{format_bytes(devices[s].memory_bytes)}"
            for s in stages if costs[s].memory_bytes > devices[s].memory_bytes]
    return f"; does not fit: {', '.join(over)}" if over else ""


def _crossing(graph: CostGraph, stage_of: list[int], s: int) -> list[tuple[int, list[int]]]:
    """The values produced at or before stage `s` (graph inputs included) read after it, each
    with its readers after it."""
    found = []
    for i in range(len(graph)):
        if not graph.is_input[i] and stage_of[i] > s:
            continue
        readers = [j for j in graph.succs[i] if stage_of[j] > s]
        if readers:
            found.append((i, readers))
    return found


def _moves(graph: CostGraph, stage_of: list[int], s: int):
    """The cut one node earlier (stage s's last node that may join s+1) and one node later
    (stage s+1's first node that may join s), as (node, the assignment with it moved)."""
    members = [i for i in graph.compute_nodes if stage_of[i] == s]
    later = [i for i in graph.compute_nodes if stage_of[i] == s + 1]
    earlier = next((i for i in reversed(members) if len(members) > 1 and all(
        stage_of[j] > s for j in graph.succs[i])), None)
    following = next((i for i in later if len(later) > 1 and all(
        graph.is_input[p] or stage_of[p] <= s for p in graph.preds[i])), None)
    result = []
    for label, node, to in (("earlier", earlier, s + 1), ("later", following, s)):
        if node is None:
            result.append((label, None))
        else:
            trial = list(stage_of)
            trial[node] = to
            result.append((label, (node, trial)))
    return result
