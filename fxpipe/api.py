"""`fxpipe.plan` and `fxpipe.compile`: the steps of planning conducted, then the race.

`plan` captures the model once per mode and prepares it (`fxpipe.planning.prepare.prepare`: functionalized,
seeded, its costs measured as configurations ask), weighs the configurations the options leave
open (`weigh`, `fxpipe.planning.search`), and realizes the one chosen (`realize`: split, placed, checked
against the model, `fxpipe.planning.checks`): a complete `Plan`, before any Pipeline exists. With
`num_stages="auto"`, the plans raced against the model as is (`_raced`) are realized from the
same prepared graph. `compile` is
`Pipeline(plan)` plus the `Recipe` it was made from, kept to plan the model again in the other
mode (`pipe.train()` / `pipe.eval()`). Options are checked once, as `fxpipe.planning.options.Options`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Literal, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.codegen import Placed
from fxpipe.passes.cost_model import DRIVER_DEVICE, DeviceSpec, Link, LinkFn, default_link
from fxpipe.passes.errors import BatchError, CostError, DeviceError, InputError, TraceError
from fxpipe.passes.graph_values import tensors
from fxpipe.passes.materialize import Materialize, Tiled, blockless, holds_meta
from fxpipe.passes.capture import CaptureMode, trace, with_tensor_defaults, without_cache

from .planning import search
from .runtime.devices import DeviceLike, measure_links
from .planning.measure import race
from .planning.options import BatchDims, Options, input_dims
from .pipeline import Pipeline
from .plans.plan_data import Plan, Runs, peak_rss_bytes
from .planning.prepare import Prepared, PreparedKey, prepare, realize, weigh, weighed_as_is
from .planning.progress import Progress
from .planning.reference import copied
from .runtime.schedules import ScheduleName
from .weights import Init, open_weights


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

    Returns a `Pipeline` that computes what `model` computes (see `fxpipe.planning.reference`), planned
    by `fxpipe.plan` with the same options (`pipe.plan` is the plan). Every option is checked
    once, as `fxpipe.planning.options.Options`: a bad value raises the `FxpipeError` subclass naming it
    and a fix. Compiling leaves the model, its tensors, its buffers and the random generators
    as they were.

    Args:
        model: the `nn.Module` to pipeline, in the mode (`train()` / `eval()`) to plan first;
            the pipeline follows `.train()` and `.eval()`, capturing the model again in the
            other mode when its graph depends on the mode. A model built under
            `torch.device("meta")` (shapes, no values) is planned without ever being held
            whole: each node's weights are materialised just before it runs and dropped after
            (`fxpipe.passes.materialize`), and the check runs module by module
            (`fxpipe.planning.checks.streamed`); its plan's stages hold meta tensors, to be given
            weights before a Pipeline runs them.
        devices: one entry per stage ("cpu", "cuda:1", a `torch.device`, or a
            `DeviceSpec(memory_bytes=...)`); a single device is a list of one.
        example_inputs: one full batch, positional (a single tensor is accepted as is); costs
            are measured on one micro-batch of it, on `devices[0]`.
        example_kwargs: the example's keyword inputs.
        chunks: the number of micro-batches each call is split into. By default 2 per stage,
            so that the stages overlap, at most the example's rows; 1 on one stage, and where
            micro-batches would compute something else than the whole batch (BatchNorm in
            training, a model mixing samples); "auto" weighs several. A call or train step on
            fewer rows than `chunks` runs one micro-batch per row (the example must have at
            least `chunks`).
        capture: the front-ends tried (`fxpipe.passes.capture.trace`): "auto" tries fx, fx
            with the failing submodules kept whole, then torch.export; "fx" only fx; "export"
            only torch.export. The plan says which captured the model and why.
        leaf_modules: qualified names or module classes that fx keeps whole, one node each.
        concrete_args: inputs fx fixes to constants (export fixes every non-tensor input to
            its example value).
        num_stages: how many of `devices` to use, the first ones: a number, or "auto" for the
            fewest whose bottleneck is within 2% of using them all (you have 8 GPUs; how many
            pay off?), never two on one GPU. "auto" also weighs the model as is, and in
            inference a pipeline predicted faster than it must be measured faster on the
            example too (see docs/choosing.md). Default: all of them.
        schedule: "gpipe" or "1f1b" (or "auto"): the order of forwards and backwards in
            `Pipeline.train_step`.
        training: default `model.training`; also measures backward costs and balances the
            stages on forward plus backward time.
        threads_per_stage: each CPU stage's intra-op threads (default: the cores shared evenly
            among the CPU stages).
        link: how transfers between devices are priced: "default" (typical figures by device
            kind, stages as threads of one process), "measure" (timed here, see
            `fxpipe.runtime.devices.measure_links`), "gloo" (a message between two processes on this
            host, as `fxpipe.distributed` sends it, for every value: plan so for a run under
            torchrun; see `fxpipe.distributed.measure_link`) or your own `(src, dst) -> Link`
            function. The plan records which (`plan.link`).
        repeats: timed runs per node (the median is kept; more while the times are unsteady).
        reuse_blocks: the nodes of a block that repeats another (the layers of a decoder,
            equal op for op, in the same types) take the first one's measured times
            (`fxpipe.passes.blocks`); the plan says how many nodes were measured, reused and
            estimated.
        batch_dims: the dimension micro-batches are cut along: 0 of every input unless given,
            as an int for all inputs or per input (`{"x": 1}` or `{0: 1}` for a sequence-first
            input; None for an input given whole to every micro-batch). Each output's batch
            dimension is found by running the model on the whole example and on
            micro-batches; an output that reduces or mixes the batch is refused by name.
        verify: check the pipeline's output on the example against the model run once per
            micro-batch (see `fxpipe.planning.reference`), in either mode, and the model's outputs on
            micro-batches against its output on the whole batch (in eval mode), which fails
            for a model that mixes samples across the batch.
        verify_tolerance: the check's tolerance, relative to each output's largest magnitude.
            Default: 4 times the model's own rounding, at least 16 float epsilons, as rounding
            differs with the number of threads, the CPU's kernels and the device: its float32
            outputs on the example measured against one float64 run, on the GPU where a GPU
            may compute float32 in TF32 (`checks.rounding_tolerance`).
        costs: a plan of the same model (`pipe.plan`, or `fxpipe.load_plan(path)`) to plan
            again from: each measurement it holds (a micro-batch size, a kind of device, on a
            worker thread or not, in this mode) is reused and only the others are measured, so
            re-planning for other devices or stage counts measures only what is new.
        progress: show on stderr the nodes measured and the configurations weighed (None: when
            stderr is a terminal).
        recompute: "never" (the default) keeps activations; "always" re-materialises them
            (GPipe's second idea): in `train_step`, each stage's forward keeps only what it
            received, and its backward runs the forward again first (from the same seed, its
            buffer writes undone), trading a forward's time for the memory of its activations;
            "auto" recomputes in the stages that would not fit their device otherwise, and the
            partitioner balances stages on that time (a stage with many micro-batches in flight
            may be made shorter to fit without it).
        optimizer: what training adds to a stage's memory besides parameters, gradients and
            what autograd keeps for each micro-batch in flight (measured; `cost_model.Memory`):
            a name ("sgd", "momentum", "adam", "adamw", "adagrad" or "rmsprop"), a
            `torch.optim` class of one, the optimizer itself (its settings read: SGD's
            momentum, Adam's amsgrad), or state bytes per parameter byte. Default "adam". Each
            stage must fit its device's memory (a GPU's, or `DeviceSpec(memory_bytes=...)`).
        weights: for a model on meta, where its values come from: None (the values the model
            initialises, `fxpipe.weights.Init(model, seed=0)`) or what
            `fxpipe.weights.open_weights` takes (a checkpoint path, a state_dict, a `Weights`).
            A tensor that none of the model's init rules writes (a norm holding
            `torch.ones(d)` without `reset_parameters()`), and that no checkpoint given holds,
            is timed and checked on a stand-in (`fxpipe.weights.stand_in_`), named in
            `Plan.stand_ins`. A model that holds its values refuses `weights`.

    Example:
        >>> import torch, fxpipe
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
        ...                             torch.nn.Linear(8, 2)).eval()
        >>> x = torch.randn(4, 8)
        >>> pipe = fxpipe.compile(model, ["cpu", "cpu"], example_inputs=(x,))
        >>> torch.testing.assert_close(pipe(x), model(x))
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
        plan = _plan_mode(recipe, model, recipe.trace(model))
    finally:
        recipe.progress.finish()
    return replace(plan, planning_peak_rss_bytes=peak_rss_bytes())


def _plan_mode(recipe: Recipe, model: nn.Module, gm: fx.GraphModule,
               held: nn.Module | None = None) -> Plan:
    """The plan of `gm`, captured from `model` in its current mode: prepared once, then
    weighed, realized and, where it is asked, raced, all from that one `Prepared`. With `held`
    (the other mode's pipeline's tensors), the stages compute with its values (`prepare`)."""
    prepared = prepare(recipe, model, gm, held)
    try:
        try:
            return _weighed(prepared, recipe)
        except BatchError:
            if recipe.options.chunks not in ("auto", None):
                raise
            # The model mixes or reduces the batch: micro-batches cannot compute what it
            # computes, and neither "auto" nor the default changes the result, so the plan
            # keeps the batch whole (and says its stages then run one at a time).
            return _weighed(prepared, recipe, whole_batch=True)
    finally:
        prepared.kept.drop()     # the model's outputs (and copies) the plans were checked on


def _weighed(prepared: Prepared, recipe: Recipe, whole_batch: bool = False) -> Plan:
    """The plan of the configuration `weigh` chooses, raced against the model as is where that
    was weighed too (`_raced`)."""
    chosen, reason, considered = weigh(prepared, recipe, whole_batch=whole_batch)
    as_is_weighed = weighed_as_is(recipe, considered)
    runs = Runs.AS_IS_PREDICTED if as_is_weighed and chosen is considered[-1] else Runs.PIPELINE
    plan = realize(prepared, recipe, chosen, considered=considered, reason=reason, runs=runs)
    # Raced in this process: not a plan priced for another runtime (gloo ranks, your links).
    in_process = recipe.options.link_name in ("default", "measure")
    if as_is_weighed and in_process and not plan.runs_as_is:
        return _raced(plan, prepared, recipe)
    return plan


@dataclass(frozen=True)
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
    # Each mode's model prepared to plan, by mode and the example's shapes (`prepare.prepare`).
    prepared: dict[PreparedKey, Prepared] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def plausible(self) -> Materialize | None:
        """What runs that need plausible values only read (timing nodes, finding which values
        share memory, finding the outputs' batch dimensions): `materialize`, but where the
        values are drawn (`Init`, no checkpoint given), each parameter's are tiled from the
        first drawn for its role (`Tiled`), one object for every such run."""
        if not isinstance(self.weights, Init):
            return self.materialize
        return Tiled(self.materialize)

    @functools.cached_property
    def computed(self) -> Init | None:
        """What computes the tensors no checkpoint holds (non-persistent buffers: rotary
        `inv_freq`) as the model initialises them; None for a model that holds its own."""
        if self.weights is None:
            return None
        return self.weights if isinstance(self.weights, Init) else \
            Init(self.model, seed=0, stand_ins=True)

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
        weights, computed = self.weights, self.computed

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
        """`model` captured in its current mode: the one capture of each mode's planning."""
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
            return _plan_mode(self, model, gm, held)
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


# Below this share of its threads' time, the model's run says other processes hold the cores.
BUSY_SHARE = 0.85


# The pipelines raced at most: the one predicted fastest, and the next ones predicted within
# `SHORTLIST_SLACK` of it (a prediction off by more is off by more than the race can mend).
SHORTLIST = 3
SHORTLIST_SLACK = 1.25


def _raced(plan: Plan, prepared: Prepared, recipe: Recipe) -> Plan:
    """A pipeline chosen over the model as is on its prediction is kept only where it is
    measured faster. The shortlist (the chosen pipeline and the next best predicted, realized
    from the same prepared graph and costs: `_runners_up`) and the model run on the example in
    interleaved rounds (`measure.race`: calls in inference, train steps in training), and each
    one's least time counts, the least disturbed by other work on the machine (the model's
    all-core run is the first a busy core slows). The pipeline measured fastest is kept where
    it beats the model by over `search.TIE`; otherwise the model as is is realized, weighed
    alone on the costs measured; so it is where the model's run on CPUs got under
    `BUSY_SHARE` of its threads' time: the machine is too busy to tell, and the model as is is
    the choice that cannot lose much. The plan records each one's predicted and measured time
    (`Plan.raced`)."""
    shortlist = [plan, *_runners_up(plan, prepared, recipe)]
    raced = race(shortlist, prepared.checked, recipe)
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
        return replace(best, raced=rows, reason=f"{why}; {measured}")
    else:
        runs = Runs.AS_IS_MEASURED
        reason = f"no pipeline is measured faster than the model run whole: {measured}"
    return realize(prepared, recipe, plan.considered[-1], considered=plan.considered,
                   reason=reason, runs=runs)


def _runners_up(plan: Plan, prepared: Prepared, recipe: Recipe) -> list[Plan]:
    """The plans of the configurations predicted next best after the chosen one (at most
    `SHORTLIST - 1`, within `SHORTLIST_SLACK` of it and faster than the model), each realized
    from the prepared graph as the chosen one was."""
    best = plan.chosen.predicted_s
    others = sorted((c for c in plan.considered[:-1] if c.predicted_s is not None and
                     c.config != plan.chosen.config and c.predicted_s <= best * SHORTLIST_SLACK
                     and c.predicted_s < (plan.unpipelined_s or math.inf)),
                    key=lambda c: c.predicted_s)
    return [realize(prepared, recipe, c, considered=plan.considered, reason=plan.reason,
                    runs=Runs.PIPELINE) for c in others[:SHORTLIST - 1]]


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
    from .runtime.devices import measure_link
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
