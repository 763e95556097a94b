"""`fxpipe.plan` and `fxpipe.compile`: the passes called in order, then the checks.

`plan` captures the model, measures its costs (`fxpipe.measure`), weighs the configurations the
options leave open (`fxpipe.search`), partitions, places the stages and checks them against the
model (`fxpipe.checks`): a complete `Plan`, before any Pipeline exists. `compile` is
`Pipeline(plan)` plus the `Recipe` it was made from, kept to plan the model again in the other
mode (`pipe.train()` / `pipe.eval()`). Options are checked once, as `fxpipe.options.Options`.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.annotate_costs import measurement_spread
from fxpipe.passes.codegen import Placed, held_by_stages, split_stages
from fxpipe.passes.cost_model import (DRIVER_DEVICE, DeviceSpec, Link, LinkFn, Memory,
                                      default_link)
from fxpipe.passes.device import same_memory
from fxpipe.passes.errors import BatchError, CostError, DeviceError, InputError, TraceError
from fxpipe.passes.functionalize import GraphRunFailed, functionalize
from fxpipe.passes.graph_values import tensors
from fxpipe.passes.materialize import (Materialize, Tiled, blockless, holds_meta,
                                       release_freed_memory, unfilled)
from fxpipe.passes.partition import Partition
from fxpipe.passes.randomness import seed_random_ops
from fxpipe.passes.recompute import checkpoint_regions
from fxpipe.passes.signature import signature_of
from fxpipe.passes.stage import Stage
from fxpipe.passes.capture import CaptureMode, trace, with_tensor_defaults, without_cache

from . import microbatch, search
from .checks import holding, meta_reference, reference_of, streamed_stages, verify
from .devices import DeviceLike, measure_links
from .measure import Costs, race, time_unpipelined
from .options import BatchDims, Options, input_dims, placeholder_dims
from .pipeline import Pipeline, carry_values
from .plan_data import Plan, Runs, make_plan, peak_rss_bytes
from .progress import Progress
from .reference import copied
from .schedules import ScheduleName
from .weights import Init, open_weights
from .wiring import Wiring


def compile(model: nn.Module, devices: Sequence[DeviceLike] | DeviceLike,
            example_inputs: tuple | Any = (), example_kwargs: Mapping[str, Any] | None = None, *,
            chunks: int | Literal["auto"] | None = None, capture: CaptureMode = "auto",
            leaf_modules: Iterable[str | type] = (), concrete_args: Mapping[str, Any] | None = None,
            num_stages: int | Literal["auto"] | None = None,
            schedule: ScheduleName | Literal["auto"] = "gpipe", training: bool | None = None,
            threads_per_stage: int | None = None,
            link: LinkFn | Literal["default", "measure", "gloo"] = "default", repeats: int = 5,
            reuse_blocks: bool = True, batch_dims: BatchDims = 0, verify: bool = True,
            verify_tolerance: float | None = None, costs: Plan | None = None,
            progress: bool | None = None,
            recompute: Literal["never", "always", "auto"] = "never",
            optimizer: Any = "adam", weights: Any = None) -> Pipeline:
    """Split `model` into one stage per entry of `devices`, balanced by measured time.

    `example_inputs` is one full batch (positional; a single tensor is accepted as is) and
    `example_kwargs` its keyword inputs; costs are measured on one micro-batch of it, on
    `devices[0]`. `chunks` is the number of micro-batches each call is split into (by default
    2 per stage, so that the stages overlap, at most the example's rows; 1 on one stage, and
    where micro-batches would compute something else than the whole batch: BatchNorm in
    training, a model mixing samples; "auto" weighs several), along
    `batch_dims`: dimension 0 of every input unless given, as an int for all inputs or per input
    (`{"x": 1}` or `{0: 1}` for a sequence-first input; None for an input given whole to every
    micro-batch); a call or train step on fewer rows than `chunks` runs one micro-batch per row
    (the example must have at least `chunks`). Each output's batch dimension is found
    by running the model on the whole example and on micro-batches; an output that reduces or
    mixes the batch is refused by name.
    `num_stages` uses only the first devices: a number, or "auto" for the fewest whose
    bottleneck is within 2% of using them all (you have 8 GPUs; how many pay off?), never two
    on one GPU; "auto" also weighs the model as is, and in inference a pipeline predicted
    faster than it must be measured faster on the example too (see docs/choosing.md).
    `schedule` ("gpipe" or "1f1b") orders forwards and backwards in `Pipeline.train_step`.
    `training` (default: `model.training`) also measures backward costs and balances stages on
    forward plus backward time. `threads_per_stage` sets each CPU stage's intra-op threads
    (default: the cores shared evenly among the CPU stages). `link` prices transfers between
    devices: "default" (typical figures by device kind, stages as threads of one process),
    "measure" (timed here, see `fxpipe.devices.measure_links`), "gloo" (a message between two
    processes on this host, as `fxpipe.distributed` sends it, for every value: plan so for a
    run under torchrun; see `fxpipe.distributed.measure_link`) or your own `(src, dst) -> Link`
    function. The plan records which (`plan.link`). With `reuse_blocks`, the nodes of a block
    that repeats another (the layers of a decoder, equal op for op, in the same types) take the
    first one's measured times (`fxpipe.passes.blocks`); the plan says how many nodes were
    measured, reused and estimated.

    With `verify`, the pipeline's output on the example is checked against the model run once
    per micro-batch (see `fxpipe.reference`), in either mode, and the model's outputs on
    micro-batches against its output on the whole batch (in eval mode), which fails for a model
    that mixes samples across the batch. Outputs are compared within `verify_tolerance` of each
    output's largest magnitude (default: 4 times the model's own rounding, at least 16 float
    epsilons, as rounding differs with the number of threads, the CPU's kernels and the device:
    its float32 outputs on the example measured against one float64 run, on the GPU where a
    GPU may compute float32 in TF32; `checks.rounding_tolerance`). Checking leaves the
    model, its buffers and the random generators as they were. The pipeline follows `.train()`
    and `.eval()`, capturing the model again in the other mode when its graph depends on the
    mode.

    `costs`, a plan of the same model (`pipe.plan`, or `fxpipe.load_plan(path)`), plans again
    from the costs it measured: each measurement it holds (a micro-batch size, a kind of device,
    on a worker thread or not, in this mode) is reused, and only the others are measured, so
    re-planning for other devices or stage counts measures only what is new.

    Each stage must fit its device's memory (a GPU's, or `DeviceSpec(memory_bytes=...)`). In
    training a stage holds its parameters, their gradients and the `optimizer`'s state (a name,
    "sgd", "momentum", "adam", "adamw", "adagrad" or "rmsprop", a `torch.optim` class of one,
    the optimizer itself (its settings read: SGD's momentum, Adam's amsgrad), or state bytes per
    parameter byte; default "adam"), and what autograd keeps for the backward of
    each micro-batch in flight (measured; `cost_model.Memory`).
    `recompute="always"` re-materialises activations (GPipe's second idea): in `train_step`, each
    stage's forward keeps only what it received, and its backward runs the forward again first
    (from the same seed, its buffer writes undone), trading a forward's time for the memory of
    its activations. The default, "never", keeps them; "auto" recomputes in the stages that
    would not fit their device otherwise, and the partitioner balances stages on that time (a
    stage with many micro-batches in flight may be made shorter to fit without it).

    `progress` shows on stderr the nodes measured and the configurations weighed (None: when
    stderr is a terminal).

    A model built under `torch.device("meta")` (shapes, no values) is planned without ever
    being held whole: each node's weights are materialised just before it runs and dropped
    after (`fxpipe.passes.materialize`), and the check runs module by module
    (`fxpipe.checks.streamed`). `weights` says where those values come from: None (the values
    the model initialises, `fxpipe.weights.Init(model, seed=0)`) or what
    `fxpipe.weights.open_weights` takes (a checkpoint path, a state_dict, a `Weights`). A
    tensor that none of the model's init rules writes (a norm holding `torch.ones(d)` without
    `reset_parameters()`), and that no checkpoint given holds, is timed and checked on a
    stand-in (`fxpipe.weights.stand_in_`), named in `Plan.stand_ins`. The plan's stages hold
    meta tensors: give them weights before a Pipeline runs them. A model that holds its values
    refuses `weights`.
    """
    options = Options(devices, chunks=chunks, capture=capture, leaf_modules=leaf_modules,
                      concrete_args=concrete_args, num_stages=num_stages, schedule=schedule,
                      training=training, threads_per_stage=threads_per_stage, link=link,
                      repeats=repeats, reuse_blocks=reuse_blocks, batch_dims=batch_dims,
                      verify=verify, verify_tolerance=verify_tolerance, costs=costs,
                      progress=progress, recompute=recompute, optimizer=optimizer,
                      weights=weights)
    recipe = Recipe.of(model, example_inputs, example_kwargs, options)
    pipe = Pipeline(_plan(recipe))
    pipe._keep_recipe(recipe)
    return pipe


def plan(model: nn.Module, devices: Sequence[DeviceLike] | DeviceLike,
         example_inputs: tuple | Any = (), example_kwargs: Mapping[str, Any] | None = None,
         **options: Any) -> Plan:
    """The plan `compile` makes, with the same options: what `fxpipe.Pipeline(plan)` runs, and
    what `plan.save(path)` writes (and `fxpipe.load_plan(path)` reads back in another process).
    Like compile, it checks the plan against the model on the example unless `verify=False`.
    No Pipeline is built and no stage worker thread started: the check runs the placed stages
    one after another on the caller's thread."""
    return _plan(Recipe.of(model, example_inputs, example_kwargs, Options(devices, **options)))


def _plan(recipe: Recipe) -> Plan:
    """The plan of the recipe's model in its current mode (see `plan`), with the planning
    process's peak resident memory."""
    model = recipe.model
    try:
        try:
            plan = _build(model, recipe.trace(model), recipe)
        except BatchError:
            if recipe.options.chunks not in ("auto", None):
                raise
            # The model mixes or reduces the batch: micro-batches cannot compute what it
            # computes, and neither "auto" nor the default changes the result, so the plan
            # keeps the batch whole (and says its stages then run one at a time).
            recipe.options = replace(recipe.options, chunks=1)
            plan = _build(model, recipe.trace(model), recipe)
    finally:
        recipe.progress.finish()
    return replace(plan, planning_peak_rss_bytes=peak_rss_bytes())


@dataclass
class Recipe:
    """What planning takes, kept by the pipeline to plan the model again in the other mode.

    The model and the example inputs are kept as given (the pipeline holds the model's
    parameters anyway; `fxpipe.compile(Net(), ...)` must still switch modes).
    """

    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    input_dims: tuple[tuple, dict]      # a batch dimension per input, a prefix of (args, kwargs)
    default_dim: int                    # that of inputs the example does not give
    options: Options
    link: LinkFn                        # options.link as a function, checked for the devices
    traced_code: dict[bool, str] = field(default_factory=dict)
    progress: Progress = field(default_factory=lambda: Progress(False))
    # The copies of the model's tensors placed on stage devices, shared by both modes' stages.
    placed: Placed = field(default_factory=dict)
    # Where the values of a model built on the meta device come from (a fxpipe.weights.Weights);
    # None for a model that holds its own.
    weights: Any = None
    tiled: Tiled | None = field(default=None, repr=False)    # `plausible`, once made
    # What computes the tensors no checkpoint holds (non-persistent buffers), once made.
    computed: Init | None = field(default=None, repr=False)

    @property
    def plausible(self) -> Materialize | None:
        """What runs that need plausible values only read (timing nodes, finding which values
        share memory, finding the outputs' batch dimensions): `materialize`, but where the
        values are drawn (`Init`, no checkpoint given), each parameter's are tiled from the
        first drawn for its role (`Tiled`), one object for every such run."""
        if not isinstance(self.weights, Init):
            return self.materialize
        if self.tiled is None:
            self.tiled = Tiled(self.materialize)
        return self.tiled

    @property
    def materialize(self) -> Materialize | None:
        """The model's tensors read from `weights` by the model's first name for each (a tied
        tensor is read once, whichever module asks), for `fxpipe.passes.materialize`; None for
        a model that holds its own values. What no checkpoint holds (non-persistent buffers:
        rotary `inv_freq`) is computed as the model initialises it (`Init`)."""
        if self.weights is None:
            return None
        first: dict[int, str] = {}
        for name, t in [*self.model.named_parameters(remove_duplicate=False),
                        *self.model.named_buffers(remove_duplicate=False)]:
            first.setdefault(id(t), name)
        stored = set(self.model.state_dict(keep_vars=True))
        weights = self.weights
        if isinstance(weights, Init):
            self.computed = weights
        elif self.computed is None:
            self.computed = Init(self.model, seed=0, stand_ins=True)
        computed = self.computed

        def read(like: Mapping[str, torch.Tensor], device: torch.device
                 ) -> dict[str, torch.Tensor]:
            asked = {first.get(id(t), name): t for name, t in like.items()}
            values = {}
            for source, names in ((weights, [n for n in asked if n in stored]),
                                  (computed, [n for n in asked if n not in stored])):
                if names:
                    values.update(source.read({n: asked[n] for n in names}, device))
            return {name: values[first.get(id(t), name)] for name, t in like.items()}
        return read

    def stand_ins(self) -> tuple[str, ...]:
        """The model's meta tensors (by its first name for each) timed or checked on stand-in
        values so far (`fxpipe.weights.stand_in_`: no rule of the model's initialisation writes
        them): those drawn so, and those of the same role (the name without block numbers,
        shape and dtype), which timing's `Tiled` values repeat."""
        drawn = {name for init in (self.weights, self.computed) if isinstance(init, Init)
                 for name in init.stood_in}
        if not drawn:
            return ()
        first: dict[int, tuple[str, torch.Tensor]] = {}
        for name, t in [*self.model.named_parameters(remove_duplicate=False),
                        *self.model.named_buffers(remove_duplicate=False)]:
            if t.is_meta:
                first.setdefault(id(t), (name, t))
        tensors = dict(first.values())

        def role(name: str) -> tuple:
            return blockless(name), tuple(tensors[name].shape), tensors[name].dtype
        roles = {role(name) for name in drawn if name in tensors}
        return tuple(name for name in tensors if name in drawn or role(name) in roles)

    @staticmethod
    def of(model: nn.Module, example_inputs: tuple | Any, example_kwargs: Mapping[str, Any] | None,
           options: Options) -> Recipe:
        """The recipe of `model` on the example, once the model and the example are fit to plan
        from (options are checked already, as `Options`)."""
        if not isinstance(model, nn.Module):
            raise TraceError(f"the model is a {type(model).__name__}, not an nn.Module\nwrap it "
                             f"in a module whose forward calls it, then compile that module")
        if example_inputs is None or isinstance(example_inputs, list):
            raise InputError(
                f"example_inputs={'None' if example_inputs is None else 'a list'} is not a "
                f"tuple\npass the model's positional example inputs as a tuple (one tensor may "
                f"be passed alone)"
                + (", e.g. tuple(inputs), or (inputs,) if the model takes the list as its one "
                   "input" if example_inputs is not None else
                   ", and keyword inputs in example_kwargs"))
        if not isinstance(example_inputs, tuple):
            example_inputs = (example_inputs,)
        if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
            raise InputError(f"example_kwargs is a {type(example_kwargs).__name__}, not a dict\n"
                             f"pass the model's keyword example inputs as a dict (name -> value), "
                             f"positional ones in example_inputs")
        example_kwargs = with_tensor_defaults(                                    # what it runs
            model, example_inputs, without_cache(model, example_inputs, example_kwargs))
        _refuse_meta_inputs((example_inputs, example_kwargs))
        batch_dims = options.batch_dims
        return Recipe(model, example_inputs, example_kwargs,
                      input_dims(model, example_inputs, example_kwargs, batch_dims),
                      batch_dims if isinstance(batch_dims, int) else 0, options,
                      _link_function(options), progress=Progress(options.progress),
                      weights=_weights_of(model, options.weights))

    def trace(self, model: nn.Module) -> fx.GraphModule:
        o = self.options
        gm = trace(model, copied(self.args), copied(self.kwargs), batch_dims=self.input_dims,
                   capture=o.capture, leaf_modules=o.leaf_modules, concrete_args=o.concrete_args,
                   stages=o.stages_asked,     # a graph fine enough for the stages
                   device_type=torch.device(o.devices[0].name).type)   # a meta model's fakes
        self.traced_code[model.training] = gm.code
        return gm

    @staticmethod
    def plan_other(model: nn.Module, devices: Sequence[DeviceLike], example_kwargs: dict[str, Any],
                   **options: Any) -> Plan:
        """`plan(...)`, for the pipeline's own plans of another module (`fxpipe.generate`'s
        steps), which reaches planning through the recipe, as the mode switch does."""
        return plan(model, devices, example_kwargs=example_kwargs, **options)

    def build_for_mode(self, mode: bool, held: nn.Module) -> Plan | None:
        """The plan of the model in `mode` (`model.train(mode)`), or None when the graph
        captured in that mode is the one already built (a graph that does not read the mode).

        `held`: the tensors the other mode's pipeline holds, by the model's names, which
        training may have changed since compile: the new stages share its copies, or are given
        their values, and are checked against the model computing with those values."""
        model = self.model
        flags = {m: m.training for m in model.modules()}
        try:
            model.train(mode)
            gm = self.trace(model)
            if self.traced_code.get(not mode) == gm.code:
                return None
            return _build(model, gm, self, held=held)
        finally:
            for m, flag in flags.items():
                m.training = flag


def _refuse_meta_inputs(inputs: Any) -> None:
    """Refuse example inputs on the meta device: activations are measured on real values."""
    if any(t.is_meta for t in tensors(inputs)):
        raise DeviceError("an example input is on the meta device: it has a shape but no values\n"
                          "fxpipe measures and checks the model on real ones (a model built "
                          "on meta is fine); pass real example inputs (e.g. torch.randn(shape), "
                          "or token ids) of the batch's shape")


def _weights_of(model: nn.Module, spec: Any) -> Any:
    """Where the values of a model built on the meta device come from (`weights=`, see
    `compile`), or None for a model holding its own values, which refuses `weights=`."""
    if not holds_meta(model):
        if spec is not None:
            raise InputError(
                "weights= was given, but the model holds its own values\n"
                "it was not built on the meta device: load them into the model instead "
                "(model.load_state_dict(...)), "
                "or build it under torch.device('meta') to plan it without holding it")
        return None
    weights = Init(model, seed=0) if spec is None else open_weights(spec)
    # Planning never needs an init rule: a tensor none writes is timed and checked on a
    # stand-in (the plan names it); only running the plan needs its values.
    return weights.for_planning(model) if isinstance(weights, Init) else weights


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


def _build(model: nn.Module, gm: fx.GraphModule, recipe: Recipe,
           held: nn.Module | None = None, *, pipelines: bool = True,
           unpipelined_s: float | None = None) -> Plan:
    """The passes after capture, on `model` in its current mode, then the checks: the complete
    plan, before any Pipeline exists. With `held` (the other mode's pipeline's tensors), the
    stages compute with its values, and the model it is checked against too (`holding`).
    Without `pipelines`, only the model as is is weighed (see `_raced`); `unpipelined_s`: the
    model's own time, measured already (a plan built again for the race)."""
    o = recipe.options
    training = model.training if o.training is None else o.training
    args, kwargs, dims = recipe.args, recipe.kwargs, recipe.input_dims
    materialize = recipe.materialize
    # A model on meta cannot run whole anywhere: its own time is not measured.
    if unpipelined_s is None and not materialize:
        unpipelined_s = time_unpipelined(model, recipe, training)
    chunks_for = _chunk_options(model, recipe, training, len(o.devices))
    first_args, first_kwargs = microbatch.split((args, kwargs), chunks_for(1)[0], dims)[0]
    _functionalize(gm, recipe, first_args, first_kwargs)
    seed_random_ops(gm)   # dropout & co draw from each micro-batch's seed
    costs = Costs(gm, recipe, training)
    chosen, reason, considered = _choose(costs, recipe, training, chunks_for, unpipelined_s,
                                         pipelines)
    config = chosen.config
    specs = chosen.partition.devices
    costs.measure(config, specs)     # the chosen configuration's costs stay on the nodes
    search.split_chosen(gm, chosen)     # nodes split to balance, their costs shared by the parts
    # The model's last runs, before any stage is placed (a stage holds copies of the tensors
    # that are not on its device): the pipeline is checked against what the model computes here.
    unverified = ""
    if materialize:
        reference, unverified = meta_reference(model, gm, recipe, config.chunks, o.verify,
                                               o.verify_tolerance, _inputs_device(recipe))
    else:
        reference = reference_of(model if held is None else holding(model, held), recipe,
                                 config.chunks, o.verify, o.verify_tolerance,
                                 [d.name for d in specs])
    stages = split_stages(gm, chosen.partition.stage_of, [d.name for d in specs],
                          placed=recipe.placed)
    held_by_stages(gm, stages)       # the pipeline's parameters: the stages' own
    if held is not None:
        carry_values(held, gm)
    part = chosen.partition
    recomputed = _recompute_part(part, stages)
    weighed_as_is = o.num_stages == "auto" and bool(considered) and \
        considered[-1].config == search.as_is_config(considered[-1].config.schedule)
    runs = Runs.AS_IS_PREDICTED if weighed_as_is and chosen is considered[-1] else Runs.PIPELINE
    verified = unverified or ("yes" if o.verify else "skipped (verify=False)")
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    signature = signature_of(gm)
    plan = make_plan(gm.meta["capture"], part, stages, config.chunks, verified,
                     wiring=Wiring.of(stages, [n.name for n in output.all_input_nodes
                                               if n.op != "placeholder"]),
                     signature=signature,
                     batch_dims=placeholder_dims(signature, dims, recipe.default_dim),
                     schedule=config.schedule, runs=runs,
                     training=model.training, measurements=costs.saved_measurements(),
                     recompute=o.recompute, stage_recomputed=recomputed,
                     output_dims=reference.output_dims, unpipelined_s=unpipelined_s,
                     unpipelined_threads=torch.get_num_threads(), chosen=chosen,
                     reason=reason, considered=considered,
                     calibration=costs.calibration[config.chunks, specs[0].kind,
                                                   config.num_stages > 1],
                     spread=measurement_spread(gm), link=o.link_name, graph=gm,
                     link_fn=recipe.link,
                     weights=recipe.weights.where if materialize else None,
                     stand_ins=recipe.stand_ins() if materialize else (),
                     **reference.stated_tolerance())
    verify(streamed_stages(plan, materialize) if materialize else plan, recipe, reference,
           o.verify_tolerance)
    # The model as is runs the model's own ops, so it takes the model's time.
    predicted_s = (unpipelined_s if plan.runs_as_is else
                   max((slot.end_s for slot in plan.predict(training=training)), default=0.0))
    plan = replace(plan, predicted_step_s=predicted_s)
    # Raced in this process: not a plan priced for another runtime (gloo ranks, your links).
    in_process = o.link_name in ("default", "measure")
    if pipelines and weighed_as_is and in_process and not plan.runs_as_is:
        return _raced(plan, model if held is None else holding(model, held), recipe, held)
    return plan


# Below this share of its threads' time, the model's run says other processes hold the cores.
BUSY_SHARE = 0.85


# The pipelines raced at most: the one predicted fastest, and the next ones predicted within
# `SHORTLIST_SLACK` of it (a prediction off by more is off by more than the race can mend).
SHORTLIST = 3
SHORTLIST_SLACK = 1.25


def _raced(plan: Plan, model: nn.Module, recipe: Recipe, held: nn.Module | None) -> Plan:
    """A pipeline chosen over the model as is on its prediction is kept only where it is
    measured faster. The shortlist (the chosen pipeline and the next best predicted, built
    from the costs already measured: `_runners_up`) and the model run on the example in
    interleaved rounds (`measure.race`: calls in inference, train steps in training), and each
    one's least time counts, the least disturbed by other work on the machine (the model's
    all-core run is the first a busy core slows). The pipeline measured fastest is kept where
    it beats the model by over `search.TIE`; otherwise the plan is made again weighing the model
    as is alone, on the costs measured; so it is where the model's run on CPUs got under
    `BUSY_SHARE` of its threads' time: the machine is too busy to tell, and the model as is is
    the choice that cannot lose much. The plan records each one's predicted and measured time
    (`Plan.raced`)."""
    shortlist = [plan, *_runners_up(plan, recipe, held)]
    raced = race(shortlist, model, recipe)
    rows = tuple((p.chosen.config, p.predicted_step_s, t)
                 for p, t in zip(shortlist, raced.pipelines_s)) + (
        (plan.considered[-1].config, plan.unpipelined_s, raced.model_s),)
    fastest = min(range(len(shortlist)), key=lambda i: raced.pipelines_s[i])
    best = shortlist[fastest]
    also = f", fastest of {len(shortlist)} pipelines raced" if len(shortlist) > 1 else ""
    measured = (f"{best.chosen} measured {raced.pipelines_s[fastest] * 1e3:.3f} ms, the model "
                f"{raced.model_s * 1e3:.3f} ms (the least of {raced.rounds} interleaved runs "
                f"each{also}; predicted {best.predicted_step_s * 1e3:.3f} ms)")
    if raced.cpu_share is not None and raced.cpu_share < BUSY_SHARE:
        runs = Runs.AS_IS_BUSY
        reason = (f"no pipeline is weighed on a busy machine: the model's fastest run had "
                  f"{raced.cpu_share:.0%} of the time of its {torch.get_num_threads()} "
                  f"thread(s), other processes holding cores, so neither time would hold on a "
                  f"quiet machine; compile where the cores are free to weigh pipelines "
                  f"({measured})")
    elif raced.pipelines_s[fastest] < raced.model_s * (1 - search.TIE):
        why = plan.reason if best is plan else (
            f"measured fastest, though {plan.chosen} was predicted fastest")
        chosen = next(c for c in plan.considered if c.config == best.chosen.config)
        return replace(best, considered=plan.considered, chosen=chosen, raced=rows,
                       reason=f"{why}; {measured}")
    else:
        runs = Runs.AS_IS_MEASURED
        reason = f"no pipeline is measured faster than the model run whole: {measured}"
    again = replace(recipe, options=replace(recipe.options, costs=plan))
    as_is = _build(recipe.model, again.trace(recipe.model), again, held, pipelines=False,
                   unpipelined_s=plan.unpipelined_s)
    return replace(as_is, considered=plan.considered, chosen=plan.considered[-1], reason=reason,
                   runs=runs, raced=rows)


def _runners_up(plan: Plan, recipe: Recipe, held: nn.Module | None) -> list[Plan]:
    """The plans of the configurations predicted next best after the chosen one (at most
    `SHORTLIST - 1`, within `SHORTLIST_SLACK` of it and faster than the model), each built
    as `compile` builds one asked for, on the costs already measured."""
    best = plan.chosen.predicted_s
    others = sorted((c for c in plan.considered[:-1] if c.predicted_s is not None and
                     c.config != plan.chosen.config and c.predicted_s <= best * SHORTLIST_SLACK
                     and c.predicted_s < (plan.unpipelined_s or math.inf)),
                    key=lambda c: c.predicted_s)
    built = []
    for c in others[:SHORTLIST - 1]:
        config = c.config
        again = replace(recipe, options=replace(
            recipe.options, costs=plan, num_stages=config.num_stages, chunks=config.chunks,
            schedule=config.schedule, threads_per_stage=config.threads))
        built.append(_build(recipe.model, again.trace(recipe.model), again, held,
                            unpipelined_s=plan.unpipelined_s))
    return built


def _inputs_device(recipe: Recipe) -> torch.device:
    """Where the example inputs are (the CPU for an example without tensors)."""
    return next((t.device for t in tensors((recipe.args, recipe.kwargs))), torch.device("cpu"))


def _choose(costs: Costs, recipe: Recipe, training: bool, chunks_for: Callable[[int], list[int]],
            unpipelined_s: float | None, pipelines: bool = True
            ) -> tuple[search.Candidate, str, tuple[search.Candidate, ...]]:
    """Every configuration the options leave open, costed, partitioned and predicted; the one
    to build, why, and all those considered (the model as is last, when it was one). Without
    `pipelines`, the model as is alone."""
    o = recipe.options
    specs, link, num_stages = o.devices, recipe.link, o.num_stages
    stage_counts = search.stage_counts(specs, num_stages) if pipelines else []
    schedules = list(search.SCHEDULES if o.schedule == "auto" and training else
                     ["gpipe" if o.schedule == "auto" else o.schedule])
    cores = os.cpu_count() or 1
    memory = Memory(training=training, optimizer_state=o.optimizer_state,
                    recompute=o.recompute)
    as_is_config = search.as_is_config(schedules[0])
    candidates = []
    for k in stage_counts:
        threads = search.stage_threads(specs, k, cores, o.threads_per_stage)
        for chunks in chunks_for(k):
            for schedule in (schedules if k > 1 else schedules[:1]):   # alike on one stage
                config = search.Config(k, chunks, schedule, threads)
                if num_stages == "auto" and config == as_is_config:
                    continue     # the model as it is, measured whole below
                recipe.progress.doing(f"planning {k} stage{'s' * (k > 1)} x {chunks} "
                                      f"micro-batch{'es' * (chunks > 1)}")
                devices = costs.devices(config, specs)
                candidates.append(search.consider(config, costs.measure(config, devices),
                                                  devices, link, training, cores, memory,
                                                  graph=costs.gm))
    as_is = None
    # The model as it is: one stage, whole batch, the caller's threads, and its own tensors,
    # so only where they all are on the first device (there the stage holds them, not copies).
    if num_stages == "auto" and all(same_memory(t.device, specs[0].name) for t in
                                    [*recipe.model.parameters(), *recipe.model.buffers()]):
        devices = costs.devices(as_is_config, specs)
        as_is = search.consider(as_is_config, costs.measure(as_is_config, devices), devices,
                                link, training, memory=memory)
        as_is = replace(as_is, predicted_s=unpipelined_s if as_is.partition else None)
    chosen, reason = search.choose(candidates, as_is)
    return chosen, reason, tuple(candidates) + ((as_is,) if as_is else ())


def _recompute_part(part: Partition, stages: Sequence[Stage]) -> tuple[tuple[str, ...], ...]:
    """The nodes each stage recomputes where the partitioner priced recomputing part of its
    forward (`StageCost.recomputed`), those stages rewritten in place to do so
    (`fxpipe.passes.recompute.checkpoint_regions`)."""
    for stage, cost in zip(stages, part.stages):
        if cost.recomputed:
            checkpoint_regions(stage.module, set(cost.recomputed))
    return tuple(cost.recomputed for cost in part.stages)


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


def _link_function(options: Options) -> LinkFn:
    """The `link` option as a function pricing a transfer between two devices, its answer for
    every pair of the devices (and the driver) checked once, up front."""
    link, specs = options.link, options.devices
    if link == "measure":
        link = measure_links(specs)
    elif link == "default":
        link = default_link
    elif link == "gloo":
        link = _gloo_link()
    return _checked_link(link, specs)


@functools.cache
def _gloo_link() -> LinkFn:
    """Every value priced as one message between two gloo processes, measured once a process."""
    from .devices import measure_link
    measured = measure_link()
    return lambda src, dst: measured


def _checked_link(link: LinkFn, specs: Sequence[DeviceSpec]) -> LinkFn:
    """`link`, its answer for every pair of devices (and the driver) checked once, up front."""
    checked: dict[tuple[str, str], Link] = {}

    def checked_link(src: DeviceSpec, dst: DeviceSpec) -> Link:
        if (src.name, dst.name) not in checked:
            checked[src.name, dst.name] = _valid_link(link(src, dst), src, dst)
        return checked[src.name, dst.name]
    for src in [DRIVER_DEVICE, *specs]:
        for dst in [DRIVER_DEVICE, *specs]:
            checked_link(src, dst)
    return checked_link


def _valid_link(found: Any, src: DeviceSpec, dst: DeviceSpec) -> Link:
    where = f"link({src.name!r}, {dst.name!r}) returned {found!r}"
    if not isinstance(found, Link):
        raise CostError(f"{where}: a link function must return a fxpipe.Link\ne.g. "
                        f"Link(latency_s=10e-6, bytes_per_s=20e9)")
    if not (isinstance(found.latency_s, (int, float)) and 0 <= found.latency_s < math.inf):
        raise CostError(f"{where}: latency_s must be a finite number of seconds >= 0")
    if not (isinstance(found.bytes_per_s, (int, float)) and found.bytes_per_s > 0):
        raise CostError(f"{where}: bytes_per_s must be a bandwidth > 0\n"
                        f"math.inf for a free copy")
    return found
