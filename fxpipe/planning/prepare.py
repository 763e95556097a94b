"""Planning in three steps, so that one capture serves every plan made of it.

- `prepare`, once per mode (and per example shapes): the captured graph functionalized, its
  random ops seeded, the model's own time measured, and a `Costs` that measures each
  configuration's node costs once. A `Prepared` is never split or placed.
- `weigh`: every configuration the options leave open, costed, partitioned and predicted
  (`fxpipe.planning.search`); the one to build, why, and all those considered. With several
  micro-batch counts on a number of stages, the fewest and the most are measured, those between
  weighed on node costs fitted between them (`Costs.fitted`: affine in rows), and one chosen so
  is measured and weighed again before it is kept; where its prediction moved by over
  `FIT_TOLERANCE`, every size is measured. The model as is takes its own measured time, its
  nodes those a pipeline measured at its rows, scaled to that time (`Costs.as_is`).
- `realize(prepared, candidate)`: a `Plan` of one candidate, made on a copy of the prepared
  graph (split to balance, cut into stages, placed), checked against the model's runs on the
  example (`fxpipe.planning.checks`), which are made once per micro-batch count and kept.

`fxpipe.planning.build` conducts them: it races realized plans
(`fxpipe.planning.measure.race`), and retries with the whole batch where micro-batches cannot
compute what the model does, on the same
`Prepared`. `benchmarks/compile_time.py` times each step.

The model runs only before placement: capture's check, its time as is and the reference runs
(outputs per micro-batch, output batch dimensions, batch independence, whether it draws random
numbers) all happen before any stage is placed; then the placed stages are checked, each stage's
micro-batches in turn on the caller's thread (`Runtime.in_order`: the runtime's own executor and
transport, no worker threads), against those reference outputs.

Planning from the meta device. A model no device holds is planned without ever being held:
`weights=` (a `fxpipe.weights` source; None draws values as the model initialises them) gives
values by the model's names, and every place planning runs something runs it node by node on them
(`fxpipe.passes.materialize`). Why a callback taking the meta tensors (`read(like, device)`) and
not names: the graph knows each tensor's shape, dtype and ties; `Recipe.materialize` renames them
to the model's first name for each tensor, so a tied weight is read once whichever module asks.
Values are dropped after each node and freed memory handed back to the system
(`release_freed_memory`: glibc's per-thread arenas would otherwise keep every layer's), so planning
grows by about one layer plus a fixed overhead, whatever the model's size (tests/test_meta_plan.py
measures it).

Capture on meta: fx traces meta as it is; export runs on meta inputs, then `place` names the
inputs' device again in the graph; where that fails or keeps an enabled autocast region, export
runs again on fake tensors of the planned device type (the model's meta tensors swapped for fakes
while it runs, the graph then given the model's own tensors back). Planning never needs an init
rule: where none of the model's writes a tensor (a norm holding `torch.ones(d)` without
`reset_parameters()`), `Init(stand_ins=True)` gives a stand-in of the right shape, dtype and scale
(`weights.stand_in_`), drawn under a seed of its own (from its name) so that every read, the
model's modules and the stages alike, gets the same values; `Recipe.stand_ins` names them (those
drawn, and those of the same role, which `Tiled` repeats) in `PlanRecord.stand_ins`. Loading
with `"init"` still refuses them by name.

Which run reads what on meta. Trace's eager output check cannot run on meta: compile's check runs
streamed instead (`checks.streamed`: the model's own forward on a structural copy whose modules get
their own tensors in a forward pre-hook, against the stages run node by node on the same source); a
forward that reads another module's tensor directly cannot run so, and the plan says `verified: no
(why)`. Drawing a model's initialisation costs about 7 ns an element on a CPU core (minutes for an
8B model, per run), so only the check draws every weight. Timing nodes reads `Recipe.plausible`:
drawn values (`Init`) tiled per role (`Tiled`), a role's first read drawn in full and the rest
copied at memory speed; real ones where a checkpoint is given. Functionalize's probe (which values
share memory) runs on `unfilled` weights: nothing drawn, and a large weight that is only read never
becomes resident (on failure, plausible ones). The outputs' batch dimensions without the check come
from the graph run on meta (shapes alone); where that cannot tell, from plausible values. The model
as is cannot run anywhere: no baseline, no "as is" candidate, and node costs are not calibrated
against a whole run. The plan's stages hold the meta tensors themselves (`place` leaves a meta
tensor as it is): `Pipeline(plan)` refuses them until weights are given
(`plan_data.refuse_without_weights`).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.annotate_costs import measurement_spread
from fxpipe.passes.codegen import carry_values, held_by_stages, split_stages
from fxpipe.passes.cost_model import Memory
from fxpipe.passes.device import same_memory
from fxpipe.passes.functionalize import GraphRunFailed, functionalize
from fxpipe.passes.graph_values import tensors
from fxpipe.passes.materialize import release_freed_memory, unfilled
from fxpipe.passes.partition import Partition
from fxpipe.passes.randomness import seed_random_ops
from fxpipe.passes.recompute import checkpoint_regions
from fxpipe.passes.signature import signature_of
from fxpipe.passes.stage import Stage

from ..runtime import microbatch
from . import search
from .checks import Reference, holding, meta_reference, reference_of, streamed_stages, verify
from .host import priced_link
from .measure import Baseline, Costs
from .options import placeholder_dims
from ..plans.plan_data import Plan, PlanRecord, Runs, make_plan
from .reference import copied
from ..runtime.wiring import Wiring

if TYPE_CHECKING:
    from .recipe import Recipe

PreparedKey = tuple[bool, tuple[tuple[int, ...], ...]]   # (the mode, the example's shapes)


@dataclass(frozen=True)
class Prepared:
    """One mode's captured model, ready to weigh and realize any configuration of: made once
    (`prepare`), read by every plan made of it, never split or placed itself (`realize` works
    on a copy). What only planning needs of the model's runs is in `kept`, dropped once the
    mode's plan is made."""

    key: PreparedKey
    model: nn.Module                  # the model, as given
    mode: bool                        # the mode it was captured in (`model.training` then)
    held: nn.Module | None            # the other mode's pipeline's tensors, or None
    gm: fx.GraphModule                # functionalized, random ops seeded
    training: bool                    # backward costs measured, stages balanced on them
    costs: Costs
    baseline: Baseline | None         # the model's own time, sampled (None: built on meta)
    kept: Kept = field(default_factory=lambda: Kept(), repr=False)

    @property
    def unpipelined_s(self) -> float | None:
        """The model's own time: the median of its runs so far."""
        return None if self.baseline is None else self.baseline.seconds

    @property
    def unpipelined_spread(self) -> float | None:
        return None if self.baseline is None else self.baseline.spread

    @property
    def checked(self) -> nn.Module:
        """What plans are checked and raced against: the model, or the model holding `held`'s
        values (copies where they are elsewhere: `checks.holding`), made once."""
        if self.kept.checked is None:
            self.kept.checked = self.model if self.held is None else \
                holding(self.model, self.held)
        return self.kept.checked


@dataclass
class Kept:
    """What planning a mode keeps while it makes its plans (`Prepared.kept`), dropped after:
    the model it checks them against, and the model's runs on the example they are compared
    with, by micro-batch count and stage devices (`_reference`)."""

    checked: nn.Module | None = None
    references: dict[tuple, tuple[Reference, str]] = field(default_factory=dict)

    def drop(self) -> None:
        self.checked = None
        self.references.clear()


def key_of(recipe: Recipe, mode: bool) -> PreparedKey:
    """What a `Prepared` is made for: the mode and the example's shapes (other shapes, the
    decode steps of generation, would be prepared beside it)."""
    return mode, tuple(tuple(t.shape) for t in tensors((recipe.args, recipe.kwargs)))


def prepare(recipe: Recipe, model: nn.Module, gm: fx.GraphModule,
            held: nn.Module | None = None) -> Prepared:
    """`gm` (captured from `model` in its current mode) made ready to plan, kept in
    `recipe.prepared` under its mode and shapes. With `held` (the other mode's pipeline's
    tensors), plans compute with its values, and are checked against the model holding them."""
    o = recipe.options
    training = model.training if o.training is None else o.training
    # The model's own time, sampled between the stages' measurements; a model on meta cannot
    # run whole anywhere.
    baseline = Baseline(model, recipe, training) if recipe.materialize is None else None
    chunks = o.chunks if isinstance(o.chunks, int) else 1    # the fewest weighed on one stage
    first_args, first_kwargs = microbatch.split((recipe.args, recipe.kwargs), chunks,
                                                recipe.input_dims)[0]
    _functionalize(gm, recipe, first_args, first_kwargs)
    seed_random_ops(gm)   # dropout & co draw from each micro-batch's seed
    prepared = Prepared(key_of(recipe, model.training), model, model.training, held, gm,
                        training, Costs(gm, recipe, training,
                                        **({"between": baseline.sample} if baseline else {})),
                        baseline)
    recipe.prepared[prepared.key] = prepared
    return prepared


def _functionalize(gm: fx.GraphModule, recipe: Recipe, args: tuple, kwargs: dict) -> None:
    """`functionalize` on the example's first micro-batch. A model on meta runs there on
    unfilled weights (which values share memory does not depend on theirs: nothing drawn, a
    large weight never resident), or, where a node fails on them, on plausible ones. The run
    keeps every value it made until the pass ends: their memory is handed back after."""
    try:
        if recipe.materialize is not None:
            try:
                functionalize(gm, copied(args), copied(kwargs),
                              materialize=unfilled(recipe.materialize))
                return
            except GraphRunFailed:     # the values' fault, not the graph's own: plausible ones
                pass
        functionalize(gm, copied(args), copied(kwargs), materialize=recipe.plausible)
    finally:
        release_freed_memory()


def weigh(prepared: Prepared, recipe: Recipe, *, pipelines: bool = True,
          whole_batch: bool = False
          ) -> tuple[search.Candidate, str, tuple[search.Candidate, ...]]:
    """Every configuration the options leave open, costed, partitioned and predicted; the one
    to build, why, and all those considered (the model as is last, when it was one). Without
    `pipelines`, the model as is alone; with `whole_batch`, one micro-batch only (the model
    mixes or reduces the batch)."""
    o, costs, training = recipe.options, prepared.costs, prepared.training
    chunks_for = (lambda stages: [1]) if whole_batch else \
        _chunk_options(prepared.model, recipe, training, len(o.devices))
    specs, link, num_stages = o.devices, recipe.link, o.num_stages
    stage_counts = search.stage_counts(specs, num_stages) if pipelines else []
    schedules = list(search.SCHEDULES if o.schedule == "auto" and training else
                     ["gpipe" if o.schedule == "auto" else o.schedule])
    cores = os.cpu_count() or 1
    memory = Memory(training=training, optimizer_state=o.optimizer_state,
                    recompute=o.recompute)
    as_is_config = search.as_is_config(schedules[0])

    fitted: dict[search.Config, search.Candidate] = {}    # weighed on fitted costs (below)

    def considered(config: search.Config, exact: bool = False, **more: Any) -> search.Candidate:
        devices = costs.devices(config, specs)
        priced = priced_link(devices) if o.link_name == "default" else link
        fit = None if exact or config.num_stages == 1 else costs.fitted(config, devices)
        found = search.consider(config, fit or costs.measure(config, devices), devices, priced,
                                training, memory=memory, **more)
        if fit is not None:
            fitted[config] = found
        return found
    weighed: dict[search.Config, search.Candidate] = {}
    for k in stage_counts:
        threads = search.stage_threads(specs, k, cores, o.threads_per_stage)
        for chunks in _ends_first(chunks_for(k)):    # the sizes that others are fitted between
            for schedule in (schedules if k > 1 else schedules[:1]):   # alike on one stage
                config = search.Config(k, chunks, schedule, threads)
                if num_stages == "auto" and config == as_is_config:
                    continue     # the model as it is, measured whole below
                recipe.progress.doing(f"planning {k} stage{'s' * (k > 1)} x {chunks} "
                                      f"micro-batch{'es' * (chunks > 1)}")
                weighed[config] = considered(config, cores=cores, graph=costs.gm)
    candidates = sorted(weighed.values(), key=lambda c: (   # in the order of the options
        c.config.num_stages, c.config.chunks, schedules.index(c.config.schedule)))
    as_is = None
    # The model as it is: one stage, whole batch, the caller's threads, and its own tensors,
    # so only where they all are on the first device (there the stage holds them, not copies).
    if num_stages == "auto" and all(same_memory(t.device, specs[0].name) for t in
                                    [*recipe.model.parameters(), *recipe.model.buffers()]):
        # Its time is its own, measured; its nodes measured on its threads only if no
        # pipeline measured its rows (`Costs.as_is`).
        devices = costs.devices(as_is_config, specs)
        as_is = search.consider(as_is_config, costs.as_is(as_is_config, devices,
                                                          prepared.unpipelined_s)
                                or costs.measure(as_is_config, devices), devices,
                                priced_link(devices) if o.link_name == "default" else link,
                                training, memory=memory)
        as_is = replace(as_is, predicted_s=prepared.unpipelined_s if as_is.partition else None)
    while True:
        chosen, reason = search.choose(candidates, as_is)
        guess = fitted.pop(chosen.config, None)
        if guess is None:
            return chosen, reason, tuple(candidates) + ((as_is,) if as_is else ())
        # Chosen on fitted costs: measured, and weighed again, as is every configuration of
        # that size (another schedule); where the fit was off, every size is measured.
        exact = {chosen.config: considered(chosen.config, exact=True, cores=cores,
                                           graph=costs.gm)}
        off = not _fit_holds(guess, exact[chosen.config])
        for config in [c for c in fitted if off or costs.is_measured(c, costs.devices(c, specs))]:
            exact[config] = considered(config, exact=True, cores=cores, graph=costs.gm)
            del fitted[config]
        candidates = [exact.get(c.config, c) for c in candidates]


# How far a configuration's measured prediction may be from its fitted one for the fit to hold
# for the others (`weigh`): node costs affine in rows predict within a few percent; beyond this,
# the graph's costs are not affine (a kernel changing with the size) and every size is measured.
FIT_TOLERANCE = 0.15


def _fit_holds(fitted: search.Candidate, measured: search.Candidate) -> bool:
    """Whether a configuration's prediction on fitted costs came within `FIT_TOLERANCE` of its
    prediction on measured ones (both fitting, or both not)."""
    if fitted.predicted_s is None or measured.predicted_s is None:
        return fitted.predicted_s is None and measured.predicted_s is None
    return abs(fitted.predicted_s - measured.predicted_s) <= FIT_TOLERANCE * measured.predicted_s


def _ends_first(chunk_counts: list[int]) -> list[int]:
    """The micro-batch counts, the fewest and the most first: the sizes measured, between which
    the others' costs are fitted (`Costs.fitted`)."""
    ends = list(dict.fromkeys([min(chunk_counts), max(chunk_counts)]))
    return ends + [c for c in chunk_counts if c not in ends]


def _chunk_options(model: nn.Module, recipe: Recipe, training: bool,
                   devices: int) -> Callable[[int], list[int]]:
    """The micro-batch counts to consider on a number of stages: the one asked for; with
    "auto" the powers of two worth trying (`search.chunk_options`, one on one stage); by default
    2 per stage (`search.default_chunks`); only one micro-batch where micro-batches would
    compute something else than the whole batch (BatchNorm normalising each in training)."""
    chunks = recipe.options.chunks
    if chunks not in ("auto", None):
        return lambda stages: [chunks]
    if training and any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
                        for m in model.modules()):
        return lambda stages: [1]
    rows = microbatch.batch_size((recipe.args, recipe.kwargs), recipe.input_dims)
    if chunks is None:
        return lambda stages: [search.default_chunks(rows, stages)]
    options = search.chunk_options(rows, devices)
    return lambda stages: options if stages > 1 else [1]


def weighed_as_is(recipe: Recipe, considered: Sequence[search.Candidate]) -> bool:
    """Whether the model as is was weighed (last) among the configurations considered."""
    return recipe.options.num_stages == "auto" and bool(considered) and \
        considered[-1].config == search.as_is_config(considered[-1].config.schedule)


def realize(prepared: Prepared, recipe: Recipe, chosen: search.Candidate, *,
            considered: tuple[search.Candidate, ...], reason: str, runs: Runs) -> Plan:
    """The plan of `chosen`, one of the candidates `weigh` considered: a copy of the prepared
    graph split as it was partitioned, cut into stages placed on their devices, and checked
    against the model on the example (`verify`), its step predicted."""
    o, training, costs = recipe.options, prepared.training, prepared.costs
    materialize = recipe.materialize
    config, specs, part = chosen.config, chosen.partition.devices, chosen.partition
    costed = costs.measure(config, specs)   # the chosen configuration's costs on the nodes
    gm = graph_copy(prepared.gm)     # with those costs; the prepared graph stays whole
    search.split_chosen(gm, chosen)  # nodes split to balance, their costs shared by the parts
    # The model's runs, made before any stage is placed (a stage holds copies of the tensors
    # that are not on its device): the pipeline is checked against what the model computes.
    reference, unverified = _reference(prepared, recipe, gm, config.chunks,
                                       [d.name for d in specs])
    stages = split_stages(gm, part.stage_of, [d.name for d in specs], placed=recipe.placed)
    held_by_stages(gm, stages)       # the pipeline's parameters: the stages' own
    if prepared.held is not None:
        carry_values(prepared.held, gm)
    recomputed = _recompute_part(part, stages)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    signature = signature_of(gm)
    tolerance = reference.stated_tolerance()
    record = PlanRecord(
        verified=unverified or ("yes" if o.verify else "skipped (verify=False)"),
        stage_recomputed=recomputed, unpipelined_s=prepared.unpipelined_s,
        unpipelined_spread=prepared.unpipelined_spread,
        example_rows=microbatch.rows_of((recipe.args, recipe.kwargs), recipe.input_dims),
        unpipelined_threads=torch.get_num_threads(),
        chosen=chosen, reason=reason, considered=considered,
        calibration=costs.calibration[config.chunks, specs[0].kind, config.num_stages > 1],
        spread=measurement_spread(gm), host=costed.host,
        weights=recipe.weights.where if materialize else None,
        stand_ins=recipe.stand_ins() if materialize else (),
        verify_tolerance=tolerance.get("verify_tolerance"),
        verify_tolerance_source=tolerance.get("verify_tolerance_source", ""),
        measurements=costs.saved_measurements())
    plan = make_plan(
        gm.meta["capture"], part, stages, config.chunks,
        wiring=Wiring.of(stages, [n.name for n in output.all_input_nodes
                                  if n.op != "placeholder"]),
        signature=signature,
        batch_dims=placeholder_dims(signature, recipe.input_dims, recipe.default_dim),
        output_dims=reference.output_dims, schedule=config.schedule, training=prepared.mode,
        recompute=o.recompute, runs=runs, link=o.link_name, graph=gm,
        link_fn=priced_link(specs) if o.link_name == "default" else recipe.link, record=record)
    verify(streamed_stages(plan, materialize) if materialize else plan, recipe, reference,
           o.verify_tolerance)
    # The model as is runs the model's own ops, so it takes the model's time.
    predicted_s = (prepared.unpipelined_s if plan.runs_as_is else
                   max((slot.end_s for slot in plan.predict(training=training)), default=0.0))
    return plan.with_record(predicted_step_s=predicted_s)


def graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule of its own holding a copy of `gm`'s graph (its nodes' names and meta, its
    calling convention) over `gm`'s modules and tensors, so that passes rewriting a graph in
    place (`split_wide`, `held_by_stages`) leave `gm` as it was."""
    copied_gm = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    for table in ("_parameters", "_buffers", "_modules"):    # the tree as it is, not rebuilt
        copied_gm.__dict__[table] = dict(gm.__dict__[table])
    copied_gm._non_persistent_buffers_set = set(gm._non_persistent_buffers_set)
    copied_gm.meta = dict(gm.meta)
    copied_gm.training = gm.training
    return copied_gm


def _reference(prepared: Prepared, recipe: Recipe, gm: fx.GraphModule, chunks: int,
               devices: Sequence[str]) -> tuple[Reference, str]:
    """The model's runs the checks of a plan on `chunks` micro-batches on `devices` compare
    with (`checks.reference_of`), and what a plan of a model on meta leaves unverified; made
    once per micro-batch count and set of devices, for every plan of `prepared`."""
    o = recipe.options
    key = (chunks, tuple(dict.fromkeys(devices)))
    references = prepared.kept.references
    if key not in references:
        if recipe.materialize:
            found = meta_reference(prepared.checked, gm, recipe, chunks, o.verify,
                                   o.verify_tolerance, _inputs_device(recipe))
        else:
            found = (reference_of(prepared.checked, recipe, chunks, o.verify,
                                  o.verify_tolerance, list(devices)), "")
        references[key] = found
    return references[key]


def _inputs_device(recipe: Recipe) -> torch.device:
    """Where the example inputs are (the CPU for an example without tensors)."""
    return next((t.device for t in tensors((recipe.args, recipe.kwargs))), torch.device("cpu"))


def _recompute_part(part: Partition, stages: Sequence[Stage]) -> tuple[tuple[str, ...], ...]:
    """The nodes each stage recomputes where the partitioner priced recomputing part of its
    forward (`StageCost.recomputed`), those stages rewritten in place to do so
    (`fxpipe.passes.recompute.checkpoint_regions`)."""
    for stage, cost in zip(stages, part.stages):
        if cost.recomputed:
            checkpoint_regions(stage.module, set(cost.recomputed))
    return tuple(cost.recomputed for cost in part.stages)
