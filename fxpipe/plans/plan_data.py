"""The plan of a pipeline as data: what a Pipeline runs and the record of what was weighed.

`fxpipe.plan` returns a `Plan`, complete, before any Pipeline exists; `Pipeline(plan)` runs it,
`plan.save(path)` writes it, `print(plan)` reads it (`fxpipe.plans.report`). The runtime reads the
stages (`fxpipe.passes.stage.Stage`) and their `Wiring`; nothing here imports a pass's code.

A plan is data, in two parts by one rule (`Plan`): what a Pipeline (or a torchrun stage) reads to
run it (the stages, their `Wiring`, computed once from codegen's stages, the calling convention,
batch and output dimensions, schedule, threads, mode: `Plan.runs`, a pipeline or the model as is)
and `Plan.record`, a `PlanRecord` of what was weighed (the predicted step against the model's
measured time, the configurations considered and why one was chosen, calibration, the check,
every cost measured). `fxpipe.plan` returns it complete (`make_plan`, typed fields); nothing
patches it after. `Pipeline(plan)` runs it; `plan.save(dir)` writes it and `load_plan(dir)` reads
it back in a process without the model's code; `fxpipe.distributed` runs one stage of it per
process; `compile(..., costs=plan)` plans again from its measurements.

`Plan.predict` is the simulated step. `PlanRecord.stand_ins`: a meta plan's tensors timed and
checked on stand-ins (printed as one line by role, in plan.json). `PlanRecord.verify_tolerance`
and its source: what the check compared within (printed after "yes"). `Plan.threads` is read off
`partition.devices`, where each stage's device, threads and memory live once (loading onto other
devices changes them there). In memory only: the costed graph (explain, the node picture) and the
link function. A plan whose stages hold meta tensors is refused by a Pipeline until weights are
given (`refuse_without_weights`). The module is not named plan.py: `fxpipe.plan` is the function.
"""

from __future__ import annotations

import enum
import os
import re
import resource
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch.fx as fx

from fxpipe.passes.cost_model import HostCosts, LinkFn, NodeCost
from fxpipe.passes.errors import DeviceError
from fxpipe.passes.partition import Partition
from fxpipe.passes.signature import Signature
from fxpipe.passes.stage import Stage
from fxpipe.passes.capture import Capture, module_path

from . import saved
from .plan_format import register_types
from .report import describe, unclaimed
from ..runtime.schedules import Slot, async_warmup
from .prediction import predict_slots
from ..runtime.wiring import Wiring


@dataclass(frozen=True)
class Measurement:
    """Every node's cost (by node name) measured in one condition, the calibration applied
    to them (forward and backward factors), what else measuring wrote on each node
    (`annotate_costs.WRITTEN`: its output's shapes, whether a node keeps its output, the state
    it writes) and how long a node holds the interpreter lock, forward and backward, as stages
    on threads share it (`host.lock_held`; None: not measured): what
    `compile(..., costs=plan)` reuses."""

    costs: Mapping[str, NodeCost]
    calibration: tuple[float, float]
    marks: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    lock: tuple[float, float] | None = None


class Runs(enum.Enum):
    """How a plan runs: as a pipeline, or the model as it is (one stage, the whole batch, the
    caller's threads), and then why; the value says it in words."""

    PIPELINE = "a pipeline"
    AS_IS_PREDICTED = "no pipeline was predicted faster"
    AS_IS_MEASURED = "no pipeline was measured faster"
    AS_IS_BUSY = "the machine was too busy to weigh pipelines"


@dataclass(frozen=True)
class PlanRecord:
    """What planning weighed, measured and checked to choose a plan: read by `print(plan)`,
    `plan.json`, explain, `compile(..., costs=plan)` and the speed-up observed in use, never to
    run it (`Plan` says the rule).

    `stage_modules[s]` are the model's modules stage `s` runs, by qualified name, in order: a
    module wholly inside the stage once (numbered siblings as a range, `model.layers.0-3`), one
    that the stage shares with another as `name (part)`, so a stage's ends show in the model.
    """

    verified: str = ""                        # how the plan was checked against the model
    stage_spans: tuple[tuple[str, str], ...] = ()     # first and last node of each stage
    stage_modules: tuple[tuple[str, ...], ...] = ()
    stage_recomputed: tuple[tuple[str, ...], ...] = ()   # nodes recomputed, per stage ("auto")
    predicted_step_s: float | None = None     # one call (or train_step) through the pipeline
    unpipelined_s: float | None = None        # the model run whole, measured at compile
    unpipelined_threads: int = 0
    # How far the model's runs at compile disagreed ((p90 - p10) / median; `measure.Baseline`),
    # and the example's rows: a call of other rows is not compared with it (`observed`).
    unpipelined_spread: float | None = None
    example_rows: int | None = None
    considered: tuple = ()                    # prediction.Candidate: the configurations weighed
    chosen: object = None                     # the one chosen (a prediction.Candidate)
    reason: str = ""                          # why, in words
    # The configurations raced on the example (the shortlist, the model as is last): each
    # one's (prediction.Config, predicted time, least measured time) per batch.
    raced: tuple = ()
    calibration: tuple[float, float] | None = None   # node costs scaled to the graph's own time
    spread: float | None = None               # how unsteady the measurement was
    # What a call costs the process besides the stages, measured on the machine planning
    # (`measure.host_costs`; zeros: not priced): the call's own work, the interpreter lock.
    host: HostCosts = HostCosts()
    # A plan of a model built on the meta device: where the values it was measured and checked
    # on came from (`Weights.where`); its stages hold meta tensors. None for a model's own.
    weights: str | None = None
    # The tensors of such a plan timed and checked on stand-in values (no rule of the model's
    # initialisation writes them, `fxpipe.weights.stand_in_`), by the model's names: running
    # the plan needs their values from a checkpoint.
    stand_ins: tuple[str, ...] = ()
    # The tolerance the outputs were checked within, relative to each output's largest
    # magnitude (None: 16 epsilons of each output's dtype, or not checked), and where it came
    # from (`checks.measured_tolerance`: "the model's own bf16 rounding x4, ...").
    verify_tolerance: float | None = None
    verify_tolerance_source: str = ""
    planning_peak_rss_bytes: int | None = None    # the planning process's peak resident memory
    # Every measurement made, by (the micro-batch's input shapes, device kind, on a worker
    # thread, with backward): what planning again with `compile(..., costs=plan)` reuses.
    measurements: Mapping[tuple, Measurement] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """How a model was split and what a Pipeline runs, with the record of what planning weighed.

    One rule places each field: a field is *what runs* if a Pipeline (or a torchrun stage) reads
    it to run the plan; everything else is `record` (a `PlanRecord`): the predicted and measured
    times, the configurations considered and raced, the calibration, the check and its
    tolerance, every measurement, and what the stages tell a reader (their spans, modules,
    recomputed nodes). The stages' parameter and saved bytes run: `stream_train` refuses by
    them.
    """

    capture: Capture
    partition: Partition
    chunks: int
    # What a Pipeline runs: the stages, their wiring, the model's calling convention, the batch
    # dimension of each graph input and model output leaf, the schedule. Each stage's device,
    # threads and memory are its `partition.devices[s]`, and nowhere else (`threads`).
    stages: tuple[Stage, ...] = ()
    wiring: Wiring | None = None
    signature: Signature | None = None
    batch_dims: Mapping[str, Any] = field(default_factory=dict)
    output_dims: tuple[int | None, ...] | None = None
    schedule: str = "gpipe"
    training: bool | None = None              # the mode the model was planned (and checked) in
    recompute: str = "never"                  # the option: "never", "always" or "auto"
    runs: Runs = Runs.PIPELINE                # how it runs: a pipeline, or the model as is
    link: str = "default"      # transfers priced as: "default", "measure", "gloo", "yours"
    stage_param_bytes: tuple[int, ...] = ()
    stage_saved_bytes: tuple[int, ...] = ()   # what autograd keeps per micro-batch, per stage
    record: PlanRecord = field(default_factory=PlanRecord)    # what was weighed
    # In memory only (a saved plan leaves them out): the costed graph the stages were cut from,
    # holding the stages' tensors under the model's names (a Pipeline's module, what explain()
    # reads), and the link function that priced the transfers.
    graph: fx.GraphModule | None = field(default=None, compare=False, repr=False)
    link_fn: LinkFn | None = field(default=None, compare=False, repr=False)
    # In memory only: what a Pipeline running this plan measured. In its latest call or step
    # tracking memory (`Pipeline.measure_memory`): each stage's peak (`peak_bytes`), whether it
    # trained, and its micro-batches. Over its calls (or train steps, in the plan's mode) of
    # the example's rows: `runs` seen, the times of the latest after the first (`times_s`,
    # whole calls), their median (`step_s`) and the model's time at compile over it (`speedup`).
    # `print(plan)` shows both beside the prediction. Each plan has its own (not passed on by
    # `dataclasses.replace`), and a saved plan keeps it empty.
    observed: dict[str, Any] = field(default_factory=dict, init=False, compare=False,
                                     repr=False)
    # In memory only: the model `load_plan(path, model=...)` was given (its stages took their
    # weights from it), which `pipe.generate` plans generation from; None otherwise.
    model: Any = field(default=None, init=False, compare=False, repr=False)

    def with_record(self, **changes: Any) -> "Plan":
        """This plan with those fields of its record changed (`dataclasses.replace`)."""
        return replace(self, record=replace(self.record, **changes))

    def predict(self, *, training: bool = False) -> list[Slot]:
        """The timeline the cost model predicts for one call (or one `train_step`): the
        timetable the runtime executes, each action taking its stage's predicted time, the
        stages' threads holding the interpreter lock one at a time, after the call's own work
        (`HostCosts`: its last action ends when the call returns)."""
        return predict_slots(self.partition, self.chunks, self.schedule, training,
                             self.wiring.reads_from(training), os.cpu_count(), self.record.host,
                             self.leaves)

    @property
    def leaves(self) -> tuple[int, int]:
        """The leaves a call splits and merges: its graph inputs, and the outputs stages make."""
        return (len(self.signature.placeholders) if self.signature else 0,
                len(self.wiring.output_names) if self.wiring else 0)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan to the directory `path`: `fxpipe.load_plan(path)` reads it back,
        without the model's code (see `fxpipe.plans.saved`)."""
        return saved.save(self, path)

    def with_weights(self, weights: Any, devices: Sequence[Any] | None = None, *,
                     model: Any = None) -> "Plan":
        """This plan with each stage's tensors read from `weights` (a checkpoint, "init"),
        each stage only its own, on its device (or `devices[s]`), non-persistent buffers drawn
        from `model`'s structure: how a plan made from a model built on meta gets its weights
        (see `fxpipe.plans.saved.with_weights`)."""
        return saved.with_weights(self, weights, devices, model=model)

    @property
    def stream_prediction(self) -> tuple[float, float]:
        """What the cost model predicts for `pipe.stream` when each item is the example's
        micro-batch (plan on one sample to stream samples): items per second, one per
        bottleneck stage's forward, and one item's latency through the stages when alone."""
        part = self.partition
        rate = 1 / max(c.forward_step_s for c in part.stages)
        alone = predict_slots(part, 1, "gpipe", False, self.wiring.reads_from(False))
        return rate, max(slot.end_s for slot in alone)

    def stream_train_memory(self, max_staleness: int, window: int = 1) -> tuple[int, ...]:
        """The bytes each stage holds in `stream_train(mode="async", max_staleness=...)`: its
        buffers, its parameters with their gradients and optimizer state (two bytes per
        parameter byte: Adam's; SGD holds less), `max_staleness + 1` stashed copies of its
        parameters (the weight versions items inside may use), and for each item its row holds
        at once (`schedules.async_warmup`) what autograd keeps and the values it receives, each
        item the size of the plan's micro-batch."""
        n = len(self.stages)
        need = []
        for s, stage in enumerate(self.stages):
            params = sum(p.numel() * p.element_size() for p in stage.module.parameters())
            buffers = self.stage_param_bytes[s] - params
            per_item = (self.stage_saved_bytes[s] if self.stage_saved_bytes else 0) + \
                self.partition.stages[s].received_bytes
            need.append(buffers + params * (1 + 1 + 2) + params * (max_staleness + 1) +
                        per_item * async_warmup(s, n, max_staleness, window))
        return tuple(need)

    @property
    def placeholder_dims(self) -> dict[str, Any]:
        """The batch dimension of each graph input, by placeholder (0 where not given)."""
        return {p: self.batch_dims.get(p, 0) for p in self.signature.placeholders}

    @property
    def stage_recompute(self) -> tuple[bool, ...]:
        """Whether each stage recomputes its activations in `train_step`: every stage with
        recompute="always", those the partitioner chose with "auto" (`StageCost.recompute`)."""
        return tuple(self.recompute == "always" or c.recompute for c in self.partition.stages)

    @property
    def speedup(self) -> float | None:
        """The model's measured time over the pipeline's predicted time, per batch."""
        record = self.record
        if not record.predicted_step_s or record.unpipelined_s is None:
            return None
        return record.unpipelined_s / record.predicted_step_s

    @property
    def claimed_speedup(self) -> float | None:
        """`speedup` where the plan stands by it: None where its figures cannot predict the
        run (`unclaimed` says why: stages sharing cores, an unsteady measurement)."""
        return None if unclaimed(self) else self.speedup

    def __str__(self) -> str:
        return describe(self)

    @property
    def runs_as_is(self) -> bool:
        """Whether the plan runs the model as it is (one stage, whole batch, the caller's
        threads): `runs` says why."""
        return self.runs is not Runs.PIPELINE

    @property
    def threads(self) -> tuple[int | None, ...]:
        """Each stage's intra-op threads (None: as its worker starts), read off its device."""
        return tuple(d.threads for d in self.partition.devices[:len(self.stages)])


# A saved plan's names for them.
register_types(Plan=Plan, PlanRecord=PlanRecord, Runs=Runs, Measurement=Measurement,
               HostCosts=HostCosts)


def refuse_without_weights(plan: Plan) -> None:
    """Refuse to run a plan whose stages hold meta tensors (a plan of a model built on the
    meta device, planned without its values): naming one, and how to give them."""
    missing = [(stage.index, name) for stage in plan.stages
               for name, t in [*stage.module.named_parameters(), *stage.module.named_buffers()]
               if t.is_meta]
    if missing:
        (index, name), more = missing[0], len(missing) - 1
        raise DeviceError(
            f"stage {index} holds {name!r}{f' and {more} more tensors' if more else ''} on the "
            f"meta device\nwithout values: the plan was made from a model built on meta, and a "
            f"pipeline needs their values\ngive them first: Pipeline(plan.with_weights('ckpt/')) "
            f"(a safetensors file or directory, a torch file, a state_dict, or 'init' for the "
            f"model's own initialisation), or fxpipe.load_plan(path, weights='ckpt/') for a "
            f"saved plan")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024     # Linux counts KiB


# The latest calls whose median is the speed-up measured in use (`observe`).
OBSERVED_RUNS = 8


def observe(plan: Plan, record: Any, training: bool) -> None:
    """A pipeline's call (or train step) of the example's rows in the plan's mode, recorded
    (`runtime.Run`), counts toward the speed-up measured in use: after the first (which may
    start workers), the latest `OBSERVED_RUNS` calls' median against the model's time at
    compile, into `plan.observed` and the record, beside the speed-up the plan claims."""
    seen, weighed = plan.observed, plan.record
    if (plan.runs_as_is or not weighed.unpipelined_s or record.failed or
            training != bool(plan.training) or record.rows != weighed.example_rows):
        return
    seen["runs"] = seen.get("runs", 0) + 1
    if seen["runs"] == 1:
        return
    times = seen["times_s"] = [*seen.get("times_s", [])[1 - OBSERVED_RUNS:], record.call_s]
    seen["step_s"] = statistics.median(times)
    seen["speedup"] = record.speedup = weighed.unpipelined_s / seen["step_s"]
    record.predicted_speedup = plan.claimed_speedup


def make_plan(capture: Capture, partition: Partition, stages: Sequence[Stage], chunks: int, *,
              wiring: Wiring, signature: Signature, batch_dims: Mapping[str, Any],
              output_dims: tuple[int | None, ...] | None, schedule: str, training: bool,
              recompute: str, runs: Runs, link: str, graph: fx.GraphModule,
              link_fn: LinkFn | None, record: PlanRecord) -> Plan:
    """The plan of `stages` (see `Plan` for each field): what a Pipeline runs besides them, and
    `record`, what was weighed. What the stages tell (their spans, modules, parameter and saved
    bytes) is read off them here."""
    spans = []
    for stage in stages:
        names = [n.name for n in stage.module.graph.nodes if n.op not in ("placeholder", "output")]
        spans.append((names[0], names[-1]) if names else ("", ""))
    param_bytes = tuple(stage_param_bytes(s) for s in stages)
    saved_bytes = tuple(sum(n.meta["cost"].saved_bytes for n in s.module.graph.nodes
                            if n.op not in ("placeholder", "output", "get_attr")
                            and "cost" in n.meta) for s in stages)
    record = replace(record, stage_spans=tuple(spans), stage_modules=stage_modules(stages))
    return Plan(capture, partition, chunks, stages=tuple(stages), wiring=wiring,
                signature=signature, batch_dims=batch_dims, output_dims=output_dims,
                schedule=schedule, training=training, recompute=recompute, runs=runs, link=link,
                stage_param_bytes=param_bytes, stage_saved_bytes=saved_bytes, record=record,
                graph=graph, link_fn=link_fn)


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
