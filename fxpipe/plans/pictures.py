"""Pictures of a plan: the stages and what flows between them (plain SVG), and the graph's nodes
coloured by stage (Graphviz DOT, rendered to SVG when Graphviz's `dot` is installed).

Both use one colour per stage, the same in each picture.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import torch.fx as fx

from fxpipe.passes.cost_model import format_bytes

from fxpipe.passes.capture import module_path

from .plan_data import Plan

COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")


def write_stage_graph(plan: Plan, path: str | Path) -> Path:
    """An SVG of the stages left to right, one colour each, with what each sends to each later
    stage (values and bytes per micro-batch) on the arrows between them."""
    stages, part = plan.stages, plan.partition
    flow = plan.wiring.inference
    width, box_w, box_h, gap = 220 * len(stages) + 40, 160, 70, 60
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{box_h + 200}" '
             f'font-family="sans-serif" font-size="12">',
             '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="8" refY="4" '
             'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#444"/></marker></defs>']
    x_of = [20 + s * (box_w + gap) for s in range(len(stages))]
    for s, stage in enumerate(stages):
        cost = part.stages[s]
        parts.append(f'<rect x="{x_of[s]}" y="60" width="{box_w}" height="{box_h}" rx="6" '
                     f'fill="{COLOURS[s % len(COLOURS)]}" stroke="#333"/>')
        parts.append(f'<text x="{x_of[s] + 8}" y="80" fill="white">stage {s} on '
                     f'{_escape(str(stage.device))}</text>')
        parts.append(f'<text x="{x_of[s] + 8}" y="98" fill="white">{cost.num_nodes} nodes, '
                     f'{cost.time_s * 1e3:.3f} ms</text>')
    row = 0
    for sender, receivers in sorted(flow.sends.items()):
        for receiver, names in sorted(receivers.items()):
            if sender < 0 or receiver < 0:
                continue
            row += 1
            y = 60 + box_h + 18 * row
            x1, x2 = x_of[sender] + box_w // 2, x_of[receiver] + box_w // 2
            parts.append(f'<path d="M{x1},{60 + box_h} L{x1},{y} L{x2},{y} L{x2},{60 + box_h}" '
                         f'fill="none" stroke="#444" marker-end="url(#arrow)"/>')
            label = f"{len(names)} value{'s' * (len(names) != 1)}: {', '.join(names)[:60]}"
            parts.append(f'<text x="{min(x1, x2) + 6}" y="{y - 3}">{_escape(label)}</text>')
    parts.append("</svg>")
    path = Path(path)
    path.write_text("\n".join(parts).replace(f'height="{box_h + 200}"',
                                             f'height="{60 + box_h + 18 * row + 30}"', 1))
    return path


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_node_graph(gm: fx.GraphModule, plan: Plan, path: str | Path) -> Path:
    """The graph's nodes as Graphviz DOT at `path`, each filled with its stage's colour, grouped
    in a cluster per top-level module, the edges that cross stages labelled with their bytes per
    micro-batch; rendered beside it as SVG (same name, .svg) when `dot` is on the PATH."""
    stage_of = plan.partition.stage_of
    clusters: dict[str, list[str]] = defaultdict(list)
    lines = ["digraph fxpipe {", '  rankdir=TB; node [shape=box, style="rounded,filled", '
             'fontname="sans-serif", fontsize=10, fontcolor=white];']
    for n in gm.graph.nodes:
        if n.op in ("output", "get_attr"):
            continue
        s = stage_of.get(n.name)
        colour = "#999999" if s is None else COLOURS[s % len(COLOURS)]
        where = "" if s is None else f"\\nstage {s}"
        top = (module_path(n) or "").split(".")[0]
        clusters[top].append(f'    "{n.name}" [fillcolor="{colour}", label="{n.name}{where}"];')
    for index, (top, members) in enumerate(clusters.items()):
        if top:
            lines += [f'  subgraph cluster_{index} {{', f'    label="{top}";', *members, "  }"]
        else:
            lines += members
    for n in gm.graph.nodes:
        for p in n.all_input_nodes:
            if p.op == "get_attr" or n.op in ("output", "get_attr"):
                continue
            cut = p.name in stage_of and stage_of[p.name] != stage_of.get(n.name)
            cost = p.meta.get("cost")
            label = (f' [label="{format_bytes(cost.out_bytes)}", color="#d62728", penwidth=2]'
                     if cut and cost is not None else "")
            lines.append(f'  "{p.name}" -> "{n.name}"{label};')
    lines.append("}")
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    dot = shutil.which("dot")
    if dot is not None:
        subprocess.run([dot, "-Tsvg", str(path), "-o", str(path.with_suffix(".svg"))],
                       check=False, capture_output=True, timeout=120)
    return path
