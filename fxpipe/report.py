"""What a user reads: the plan of a pipeline, as a table."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from tabulate import tabulate

from fxpipe.passes.annotate_costs import UNSTEADY
from fxpipe.passes.cost_model import NodeCost, format_bytes
from fxpipe.passes.codegen import Stage
from fxpipe.passes.partition import Partition
from fxpipe.passes.signature import Signature
from fxpipe.passes.trace import Capture, module_path

from .wiring import Wiring


@dataclass(frozen=True)
class Measurement:
    """Every node's cost (by node name) measured in one condition, and the calibration applied
    to them (forward and backward factors): what `compile(..., costs=plan)` reuses."""

    costs: Mapping[str, NodeCost]
    calibration: tuple[float, float]


# What `Plan.link` says transfers were priced as.
LINKS = {"default": "hand-offs between threads of one process (link='default')",
         "measure": "copies measured on this machine (link='measure')",
         "gloo": "messages between processes over gloo (link='gloo')",
         "yours": "your link function"}


@dataclass(frozen=True)
class Plan:
    """How a model was split: how it was captured, the partition, and what each stage holds.

    `stage_modules[s]` are the model's modules stage `s` runs, by qualified name, in order: a
    module wholly inside the stage once (numbered siblings as a range, `model.layers.0-3`), one
    that the stage shares with another as `name (part)`, so a stage's ends show in the model.
    """

    capture: Capture
    partition: Partition
    chunks: int
    stage_spans: tuple[tuple[str, str], ...]     # first and last node of each stage
    stage_param_bytes: tuple[int, ...]
    verified: str
    stage_modules: tuple[tuple[str, ...], ...] = ()
    predicted_step_s: float | None = None     # one call (or train_step) through the pipeline
    unpipelined_s: float | None = None        # the model run whole, measured at compile
    unpipelined_threads: int = 0
    considered: tuple = ()                    # search.Candidate: the configurations weighed
    chosen: object = None                     # the one chosen (a search.Candidate)
    reason: str = ""                          # why
    calibration: tuple[float, float] | None = None   # node costs scaled to the graph's own time
    spread: float | None = None               # how unsteady the measurement was
    # What a Pipeline runs: the stages, their wiring, the model's calling convention, the batch
    # dimension of each graph input and model output leaf, the schedule, each stage's threads.
    stages: tuple[Stage, ...] = ()
    wiring: Wiring | None = None
    signature: Signature | None = None
    batch_dims: Mapping[str, Any] = field(default_factory=dict)
    output_dims: tuple[int | None, ...] | None = None
    schedule: str = "gpipe"
    threads: tuple[int | None, ...] = ()
    training: bool | None = None              # the mode the model was planned (and checked) in
    recompute: str = "never"                  # the option: "never", "always" or "auto"
    stage_saved_bytes: tuple[int, ...] = ()   # what autograd keeps per micro-batch, per stage
    stage_recomputed: tuple[tuple[str, ...], ...] = ()   # nodes recomputed, per stage ("auto")
    link: str = "default"      # what transfers were priced as: "default", "measure", "gloo", "yours"
    # Every measurement made, by (the micro-batch's input shapes, device kind, on a worker
    # thread, with backward): what planning again with `compile(..., costs=plan)` reuses.
    measurements: Mapping[tuple, Measurement] = field(default_factory=dict)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan to the directory `path`: `fxpipe.load_plan(path)` reads it back,
        without the model's code (see `fxpipe.saved`)."""
        from .saved import save
        return save(self, path)

    @property
    def stream_prediction(self) -> tuple[float, float]:
        """What the cost model predicts for `pipe.stream` when each item is the example's
        micro-batch (plan on one sample to stream samples): items per second, one per
        bottleneck stage's forward, and one item's latency through the stages when alone."""
        from .search import predict_slots
        part = self.partition
        rate = 1 / max(c.forward_step_s for c in part.stages)
        alone = predict_slots(part, 1, "gpipe", False, self.wiring.reads_from(False))
        return rate, max(slot.end_s for slot in alone)

    @property
    def stage_recompute(self) -> tuple[bool, ...]:
        """Whether each stage recomputes its activations in `train_step`: every stage with
        recompute="always", those the partitioner chose with "auto" (`StageCost.recompute`)."""
        return tuple(self.recompute == "always" or c.recompute for c in self.partition.stages)

    @property
    def speedup(self) -> float | None:
        """The model's measured time over the pipeline's predicted time, per batch."""
        if not self.predicted_step_s or self.unpipelined_s is None:
            return None
        return self.unpipelined_s / self.predicted_step_s

    def table(self) -> str:
        rows = []
        for s, cost in enumerate(self.partition.stages):
            first, last = self.stage_spans[s]
            modules = self.stage_modules[s] if self.stage_modules else ()
            runs = ", ".join(modules) if modules else f"{first} .. {last}"
            rows.append((s, self.partition.devices[s].name, cost.num_nodes, runs,
                         cost.time_s * 1e3, self.stage_param_bytes[s] / 1e6, cost.sent_bytes))
        return tabulate(rows, headers=["stage", "device", "nodes", "runs", "predicted ms",
                                       "params MB", "bytes sent"], floatfmt=".3f",
                        maxcolwidths=[None, None, None, 64, None, None, None])

    def __str__(self) -> str:
        p = self.partition
        proof = "proven optimal" if p.optimal else f"within {p.gap:.2f}x of the lower bound"
        return "\n".join([
            f"fxpipe plan: {_count(p.num_stages, 'stage')}, {_count(self.chunks, 'micro-batch')}, "
            f"captured by {self.capture}",
            self.table(),
            f"bottleneck {p.bottleneck_s * 1e3:.3f} ms per micro-batch, lower bound "
            f"{p.lower_bound_s * 1e3:.3f} ms ({proof}); values priced as {LINKS[self.link]}",
            *self._measurement(),
            *self._activations(),
            *self._comparison(),
            *self._choice(),
            f"outputs checked against the model: {self.verified}",
        ])

    def _measurement(self) -> list[str]:
        """How the costs were measured: their spread, and the calibration to the graph's own
        time; a warning when the measurement was unsteady."""
        if self.calibration is None:
            return []
        forward, backward = self.calibration
        scaled = f"x{forward:.2f} forward" + (f", x{backward:.2f} backward"
                                             if backward != 1.0 else "")
        steady = self.spread is None or self.spread <= UNSTEADY
        lines = [f"node costs: measured one by one (spread {self.spread or 0:.0%}, "
                 f"{'steady' if steady else 'unsteady'}), scaled ({scaled}) to the time of the "
                 f"whole graph measured as a stage runs it"]
        if not steady:
            lines.append("warning: the costs were unsteady: another process may be using the "
                         "cores; compile again when the machine is quiet")
        return lines

    def _activations(self) -> list[str]:
        """In training: each stage's memory at the schedule's peak of micro-batches in flight,
        keeping its activations and recomputing them, and what it does."""
        if not self.training or not any(self.stage_saved_bytes):
            return []
        from .search import in_flight
        part = self.partition
        peaks = in_flight(True, self.schedule, self.chunks, part.num_stages)
        some = self.stage_recomputed or ((),) * part.num_stages
        rows = [(s, n, format_bytes(c.memory_kept_bytes), format_bytes(c.memory_recomputing_bytes),
                 format_bytes(d.memory_bytes), format_bytes(c.memory_bytes),
                 f"recomputes its forward (+{c.recompute_s * 1e3:.3f} ms per micro-batch)"
                 if recompute else
                 f"recomputes {_count(len(nodes), 'node')}: {', '.join(nodes[:4])}"
                 f"{', ...' if len(nodes) > 4 else ''} (+{c.recompute_s * 1e3:.3f} ms per "
                 f"micro-batch)" if nodes else "keeps its activations")
                for s, (n, c, d, recompute, nodes) in enumerate(
                    zip(peaks, part.stages, part.devices, self.stage_recompute, some))]
        return [f"memory in training (parameters, gradients, optimizer state, and what autograd "
                f"keeps per micro-batch in flight; recompute='{self.recompute}'):",
                tabulate(rows, headers=["stage", "in flight", "keeping", "recomputing",
                                        "device has", "planned", "chosen"])]

    def _comparison(self) -> list[str]:
        """The pipeline's predicted time per batch against the model's own, and a warning
        when the pipeline is predicted to lose."""
        if self.speedup is None:
            return []
        model = (f"{self.unpipelined_s * 1e3:.3f} ms measured (whole batch, "
                 f"{_count(self.unpipelined_threads, 'thread')})")
        if self.runs_as_is:
            return [f"per batch: the model as is, {model}: no pipeline was predicted faster, "
                    f"so the one stage runs the whole batch on the caller's thread"]
        lines = [f"per batch: pipeline {self.predicted_step_s * 1e3:.3f} ms predicted, model "
                 f"unpipelined {model}: {self.speedup:.2f}x"]
        if self.speedup < 1:
            lines.append("warning: the pipeline is predicted slower than the model run whole: "
                         "let the plan choose (num_stages='auto', chunks='auto'), or run the "
                         "model without fxpipe")
        return lines

    @property
    def runs_as_is(self) -> bool:
        """Whether the plan chose the model as it is (one stage, whole batch, the caller's
        threads) because no pipeline was predicted faster."""
        return bool(self.considered) and self.chosen is self.considered[-1] and \
            self.reason.startswith("no pipeline")

    def _choice(self) -> list[str]:
        """The configurations weighed (when more than one) and why this one was chosen."""
        if len(self.considered) < 2:
            return []
        rows = []
        for c in self.considered:
            as_is = c is self.considered[-1] and self.reason.startswith("no pipeline")
            rows.append(("*" if c is self.chosen else "", c.config.num_stages, c.config.chunks,
                         c.config.schedule, c.config.threads,
                         "-" if c.predicted_s is None else f"{c.predicted_s * 1e3:.3f}",
                         c.memory_bytes / 1e6,
                         "the model as is, measured" if as_is else c.problem))
        return ["configurations considered (predicted time per batch):",
                tabulate(rows, headers=["", "stages", "chunks", "schedule", "threads",
                                        "predicted ms", "memory MB", ""], floatfmt=".3f",
                         maxcolwidths=[None] * 7 + [60]),
                f"chosen: {self.reason}"]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('h') else 's'}"


def make_plan(capture: Capture, partition: Partition, stages: Sequence[Stage], chunks: int,
              verified: str, **run: Any) -> Plan:
    """The plan of `stages`; `run` holds what a Pipeline runs besides them (`Plan`'s fields)."""
    spans = []
    for stage in stages:
        names = [n.name for n in stage.module.graph.nodes if n.op not in ("placeholder", "output")]
        spans.append((names[0], names[-1]) if names else ("", ""))
    param_bytes = tuple(stage_param_bytes(s) for s in stages)
    saved_bytes = tuple(sum(n.meta["cost"].saved_bytes for n in s.module.graph.nodes
                            if n.op not in ("placeholder", "output", "get_attr")
                            and "cost" in n.meta) for s in stages)
    return Plan(capture, partition, chunks, tuple(spans), param_bytes, verified,
                stage_modules(stages), stages=tuple(stages), stage_saved_bytes=saved_bytes, **run)


def stage_param_bytes(stage: Stage) -> int:
    """The bytes of a stage's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in
               list(stage.module.parameters()) + list(stage.module.buffers()))


def stage_modules(stages: Sequence[Stage]) -> tuple[tuple[str, ...], ...]:
    """The modules each stage runs (see `Plan`), from the module path each node records."""
    chains = [[_ancestors(module_path(n)) for n in stage.module.graph.nodes
               if n.op not in ("placeholder", "output", "get_attr")] for stage in stages]
    total = Counter(p for stage in chains for chain in stage for p in chain)
    listed = []
    for stage in chains:
        here = Counter(p for chain in stage for p in chain)
        names: dict[str, None] = {}
        for chain in stage:
            whole = [p for p in chain if here[p] == total[p]]
            if chain:
                names[whole[0] if whole else f"{chain[-1]} (part)"] = None
        listed.append(_ranges(list(names)))
    return tuple(listed)


def _ancestors(path: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`, `a.b.c`]; the top level (``) has none."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _ranges(names: list[str]) -> tuple[str, ...]:
    """Numbered siblings in a row as one range: `layers.0, layers.1, layers.2` -> `layers.0-2`."""
    out: list[tuple[str, int, int] | str] = []
    for name in names:
        match = re.fullmatch(r"(?:(.*)\.)?([0-9]+)", name)
        if match and out and isinstance(out[-1], tuple) and out[-1][0] == match[1] \
                and out[-1][2] + 1 == int(match[2]):
            out[-1] = (match[1], out[-1][1], int(match[2]))
        elif match:
            out.append((match[1], int(match[2]), int(match[2])))
        else:
            out.append(name)
    return tuple(item if isinstance(item, str) else
                 (f"{item[0]}." if item[0] else "") + f"{item[1]}" +
                 (f"-{item[2]}" if item[2] > item[1] else "")
                 for item in out)
