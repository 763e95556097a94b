"""GraphModule + stage assignment -> one ordinary GraphModule per stage.

Stage `s` is a GraphModule whose placeholders are the values it reads from outside (graph inputs,
values of earlier stages), named as in the original graph, and whose output is the tuple of values
that later stages or the graph's output need. Nodes keep their names, order and `meta`, so
`print(stage.code)` reads like the slice of the model it is. The input graph is not modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.fx as fx

from .errors import DeviceError, PartitionError


@dataclass(frozen=True)
class Stage:
    """One stage: its module, the values it reads and the values it sends, by original node name."""

    index: int
    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    device: torch.device


def split_stages(gm: fx.GraphModule, stage_of: Mapping[str, int],
                 devices: Sequence[str | torch.device]) -> list[Stage]:
    """Split `gm` into `len(devices)` stages, stage `s` holding the nodes with `stage_of[n] == s`.

    Every node but placeholders and the output needs a stage, and no node may read a value of a
    later stage. Parameters and buffers move to their stage's device; a parameter shared by stages
    on different devices is an error.
    """
    devices = [torch.device(d) for d in devices]
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    _check(nodes, stage_of, len(devices))
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    graph_outputs = set(output.all_input_nodes)

    stages = []
    for s, device in enumerate(devices):
        members = [n for n in nodes if stage_of[n.name] == s]
        inputs = list(dict.fromkeys(p for n in members for p in n.all_input_nodes
                                    if p.op == "placeholder" or stage_of[p.name] != s))
        outputs = [n for n in members if n in graph_outputs or
                   any(u.op != "output" and stage_of[u.name] != s for u in n.users)]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for p in inputs:
            env[p] = graph.placeholder(p.name)
            env[p].meta = dict(p.meta)
        for n in members:
            env[n] = graph.node_copy(n, lambda p: env[p])
        graph.output(tuple(env[n] for n in outputs))
        module = fx.GraphModule(gm, graph, class_name=f"Stage{s}")
        stages.append(Stage(s, module, tuple(p.name for p in inputs), tuple(n.name for n in outputs),
                            device))
    _move(stages)
    return stages


def _check(nodes: Sequence[fx.Node], stage_of: Mapping[str, int], num_stages: int) -> None:
    for n in nodes:
        if n.name not in stage_of:
            raise PartitionError(f"node {n.name!r} has no stage: every node needs one")
        if not 0 <= stage_of[n.name] < num_stages:
            raise PartitionError(f"node {n.name!r} is in stage {stage_of[n.name]}, "
                                 f"outside 0..{num_stages - 1}")
        for p in n.all_input_nodes:
            if p.op != "placeholder" and stage_of[p.name] > stage_of[n.name]:
                raise PartitionError(
                    f"node {n.name!r} (stage {stage_of[n.name]}) reads {p.name!r} from the later "
                    f"stage {stage_of[p.name]}: stages may only pass values forward")


def _move(stages: Sequence[Stage]) -> None:
    """Move every stage's parameters and buffers to its device, refusing to split a shared one."""
    home: dict[int, Stage] = {}
    for stage in stages:
        for name, t in list(stage.module.named_parameters()) + list(stage.module.named_buffers()):
            first = home.setdefault(id(t), stage)
            if first.device != stage.device:
                raise DeviceError(
                    f"{name!r} is used by stage {first.index} on {first.device} and by stage "
                    f"{stage.index} on {stage.device}: a parameter lives on one device; place "
                    f"those stages on the same device")
    for stage in stages:
        stage.module.to(stage.device)
