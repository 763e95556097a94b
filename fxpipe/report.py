"""What a user reads: the plan of a pipeline, as a table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tabulate import tabulate

from passes.codegen import Stage
from passes.partition import Partition
from passes.trace import Capture


@dataclass(frozen=True)
class Plan:
    """How a model was split: how it was captured, the partition, and what each stage holds."""

    capture: Capture
    partition: Partition
    chunks: int
    stage_spans: tuple[tuple[str, str], ...]     # first and last node of each stage
    stage_param_bytes: tuple[int, ...]
    verified: str

    def table(self) -> str:
        rows = []
        for s, cost in enumerate(self.partition.stages):
            first, last = self.stage_spans[s]
            rows.append((s, self.partition.devices[s].name, cost.num_nodes, f"{first} .. {last}",
                         cost.time_s * 1e3, self.stage_param_bytes[s] / 1e6, cost.sent_bytes))
        return tabulate(rows, headers=["stage", "device", "nodes", "runs", "predicted ms",
                                       "params MB", "bytes sent"], floatfmt=".3f")

    def __str__(self) -> str:
        p = self.partition
        proof = "proven optimal" if p.optimal else f"within {p.gap:.2f}x of the lower bound"
        return "\n".join([
            f"fxpipe plan: {p.num_stages} stages, {self.chunks} micro-batches, captured by "
            f"{self.capture}",
            self.table(),
            f"bottleneck {p.bottleneck_s * 1e3:.3f} ms per micro-batch, lower bound "
            f"{p.lower_bound_s * 1e3:.3f} ms ({proof})",
            f"outputs checked against the model: {self.verified}",
        ])


def make_plan(capture: Capture, partition: Partition, stages: Sequence[Stage], chunks: int,
              verified: str) -> Plan:
    spans = []
    for stage in stages:
        names = [n.name for n in stage.module.graph.nodes if n.op not in ("placeholder", "output")]
        spans.append((names[0], names[-1]) if names else ("", ""))
    param_bytes = tuple(
        sum(t.numel() * t.element_size() for t in list(s.module.parameters()) + list(s.module.buffers()))
        for s in stages)
    return Plan(capture, partition, chunks, tuple(spans), param_bytes, verified)
