"""`fxpipe.compile`: the passes called in order, then a Pipeline that runs their result."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.annotate_costs import (annotate_costs, bind_inputs, measurement_spread,
                                          start_timer)
from fxpipe.passes.codegen import Placed, held_by_stages, placed_copy, split_stages
from fxpipe.passes.stage import Stage
from fxpipe.passes.compare import difference, output_name
from fxpipe.passes.cost_model import (DRIVER, DeviceSpec, Link, LinkFn, Memory, NodeCost,
                                      cost_graph, default_link, lower_bound_s)
from fxpipe.passes.errors import (BatchError, CostError, DeviceError, FxpipeError, InputError,
                           PartitionError, TraceError)
from fxpipe.passes.functionalize import functionalize
from fxpipe.passes.graph_values import tensors
from fxpipe.passes.randomness import microbatch_seed, microbatch_seeds, seed_random_ops
from fxpipe.passes.partition import Partition
from fxpipe.passes.recompute import checkpoint_regions, choose_recomputed
from fxpipe.passes.signature import Signature, signature_of
from fxpipe.passes.state import unchanged_state
from fxpipe.passes.trace import CaptureMode, trace, without_cache

from . import microbatch, search
from .devices import DeviceLike, measure_links, parse_devices, shared_memory, synchronize
from .options import BatchDims, Options
from .pipeline import Pipeline, call_stages, carry_values, runtime_of
from .reference import copied, run_per_microbatch, unchanged
from .progress import Progress
from .plan_data import Measurement, Plan, make_plan, stage_param_bytes
from .wiring import Wiring
from .schedules import SCHEDULES, ScheduleName


def compile(model: nn.Module, devices: Sequence[DeviceLike] | DeviceLike,
            example_inputs: tuple | Any = (), example_kwargs: Mapping[str, Any] | None = None, *,
            chunks: int | Literal["auto"] = 1, capture: CaptureMode = "auto",
            leaf_modules: Iterable[str | type] = (), concrete_args: Mapping[str, Any] | None = None,
            num_stages: int | Literal["auto"] | None = None,
            schedule: ScheduleName | Literal["auto"] = "gpipe", training: bool | None = None,
            threads_per_stage: int | None = None,
            link: LinkFn | Literal["default", "measure", "gloo"] = "default", repeats: int = 5,
            batch_dims: BatchDims = 0, verify: bool = True,
            verify_tolerance: float | None = None, costs: Plan | None = None,
            progress: bool | None = None,
            recompute: Literal["never", "always", "auto"] = "never",
            optimizer: str | float | type = "adam") -> Pipeline:
    """Split `model` into one stage per entry of `devices`, balanced by measured time.

    `example_inputs` is one full batch (positional; a single tensor is accepted as is) and
    `example_kwargs` its keyword inputs; costs are measured on one micro-batch of it, on
    `devices[0]`. `chunks` is the number of micro-batches each call is split into, along
    `batch_dims`: dimension 0 of every input unless given, as an int for all inputs or per input
    (`{"x": 1}` or `{0: 1}` for a sequence-first input; None for an input given whole to every
    micro-batch). Each output's batch dimension is found
    by running the model on the whole example and on micro-batches; an output that reduces or
    mixes the batch is refused by name.
    `num_stages` uses only the first devices: a number, or "auto" for the fewest whose
    bottleneck is within 2% of using them all (you have 8 GPUs; how many pay off?).
    `schedule` ("gpipe" or "1f1b") orders forwards and backwards in `Pipeline.train_step`.
    `training` (default: `model.training`) also measures backward costs and balances stages on
    forward plus backward time. `threads_per_stage` sets each CPU stage's intra-op threads
    (default: the cores shared evenly among the CPU stages). `link` prices transfers between
    devices: "default" (typical figures by device kind, stages as threads of one process),
    "measure" (timed here, see `fxpipe.devices.measure_links`), "gloo" (a message between two
    processes on this host, as `fxpipe.distributed` sends it, for every value: plan so for a
    run under torchrun; see `fxpipe.distributed.measure_link`) or your own `(src, dst) -> Link`
    function. The plan records which (`plan.link`).

    With `verify`, the pipeline's output on the example is checked against the model run once
    per micro-batch (see `fxpipe.reference`), in either mode, and the model's outputs on
    micro-batches against its output on the whole batch (in eval mode), which fails for a model
    that mixes samples across the batch. Outputs are compared within `verify_tolerance` of each
    output's largest magnitude (default: 16 float epsilons), as rounding differs with the
    number of threads. Checking leaves the model, its buffers and the random generators as they
    were. The pipeline follows `.train()` and `.eval()`, capturing the model again in the other
    mode when its graph depends on the mode.

    `costs`, a plan of the same model (`pipe.plan`, or `fxpipe.load_plan(path)`), plans again
    from the costs it measured: each measurement it holds (a micro-batch size, a kind of device,
    on a worker thread or not, in this mode) is reused, and only the others are measured, so
    re-planning for other devices or stage counts measures only what is new.

    Each stage must fit its device's memory (a GPU's, or `DeviceSpec(memory_bytes=...)`). In
    training a stage holds its parameters, their gradients and the `optimizer`'s state (a name,
    "sgd", "momentum", "adam", "adamw", "adagrad" or "rmsprop", a `torch.optim` class of one, or
    state bytes per parameter byte; default "adam"), and what autograd keeps for the backward of
    each micro-batch in flight (measured; `cost_model.Memory`).
    `recompute="always"` re-materialises activations (GPipe's second idea): in `train_step`, each
    stage's forward keeps only what it received, and its backward runs the forward again first
    (from the same seed, its buffer writes undone), trading a forward's time for the memory of
    its activations. The default, "never", keeps them; "auto" recomputes in the stages that
    would not fit their device otherwise, and the partitioner balances stages on that time (a
    stage with many micro-batches in flight may be made shorter to fit without it).

    `progress` shows on stderr the nodes measured and the configurations weighed (None: when
    stderr is a terminal).
    """
    options = Options(devices, chunks=chunks, capture=capture, leaf_modules=leaf_modules,
                      concrete_args=concrete_args, num_stages=num_stages, schedule=schedule,
                      training=training, threads_per_stage=threads_per_stage, link=link,
                      repeats=repeats, batch_dims=batch_dims, verify=verify,
                      verify_tolerance=verify_tolerance, costs=costs, progress=progress,
                      recompute=recompute, optimizer=optimizer)
    recipe = _Recipe.of(model, example_inputs, example_kwargs, options)
    pipe = Pipeline(_plan(recipe))
    pipe._keep_recipe(recipe)
    return pipe


def _refuse_meta(model: nn.Module, inputs: Any) -> None:
    """Refuse a model with parameters or buffers on the meta device (built under
    `torch.device("meta")`), or example inputs there: they hold no values to measure, run or
    check against."""
    on_meta = [name for name, t in (*model.named_parameters(), *model.named_buffers())
               if t.is_meta]
    if on_meta:
        more = f" (and {len(on_meta) - 1} more tensors)" if len(on_meta) > 1 else ""
        raise DeviceError(
            f"the model's {on_meta[0]!r}{more} is on the meta device: it has a shape but no "
            f"values, and fxpipe plans from the model run on real ones (planning from meta is "
            f"not supported yet). Materialise the model first: "
            f"model.load_state_dict(state_dict, assign=True) with its weights, or "
            f"model.to_empty(device='cpu') then load or initialise them")
    if any(t.is_meta for t in tensors(inputs)):
        raise DeviceError("an example input is on the meta device: it has a shape but no values, "
                          "and fxpipe measures and checks the model on real ones; pass real "
                          "example inputs (e.g. torch.randn(shape)) of the batch's shape")


def plan(model: nn.Module, devices: Sequence[DeviceLike] | DeviceLike,
         example_inputs: tuple | Any = (), example_kwargs: Mapping[str, Any] | None = None,
         **options: Any) -> Plan:
    """The plan `compile` makes, with the same options: what `fxpipe.Pipeline(plan)` runs, and
    what `plan.save(path)` writes (and `fxpipe.load_plan(path)` reads back in another process).
    Like compile, it checks the plan against the model on the example unless `verify=False`.
    No Pipeline is built and no stage worker thread started: the check runs the placed stages
    one after another on the caller's thread."""
    return _plan(_Recipe.of(model, example_inputs, example_kwargs, Options(devices, **options)))


def _plan(recipe: _Recipe) -> Plan:
    """The plan of the recipe's model in its current mode (see `plan`)."""
    model = recipe.model
    try:
        return _build(model, recipe.trace(model), recipe)
    except BatchError:
        if recipe.options.chunks != "auto":
            raise
        # The model mixes or reduces the batch: micro-batches cannot compute what it computes,
        # and "auto" never changes the result, so the plan keeps the batch whole.
        recipe.options = replace(recipe.options, chunks=1)
        return _build(model, recipe.trace(model), recipe)
    finally:
        recipe.progress.finish()


@dataclass
class _Recipe:
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

    @staticmethod
    def of(model: nn.Module, example_inputs: tuple | Any, example_kwargs: Mapping[str, Any] | None,
           options: Options) -> _Recipe:
        """The recipe of `model` on the example, once the model and the example are fit to plan
        from (options are checked already, as `Options`)."""
        if not isinstance(model, nn.Module):
            raise TraceError(f"the model is a {type(model).__name__}, not an nn.Module: wrap it "
                             f"in a module whose forward calls it, then compile that module")
        if example_inputs is None or isinstance(example_inputs, list):
            raise InputError(
                f"example_inputs={'None' if example_inputs is None else 'a list'}: pass the "
                f"model's positional example inputs as a tuple (one tensor may be passed alone)"
                + (", e.g. tuple(inputs), or (inputs,) if the model takes the list as its one "
                   "input" if example_inputs is not None else
                   ", and keyword inputs in example_kwargs"))
        if not isinstance(example_inputs, tuple):
            example_inputs = (example_inputs,)
        if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
            raise InputError(f"example_kwargs is a {type(example_kwargs).__name__}: pass the "
                             f"model's keyword example inputs as a dict (name -> value), "
                             f"positional ones in example_inputs")
        example_kwargs = without_cache(model, example_inputs, example_kwargs)   # what it runs
        _refuse_meta(model, (example_inputs, example_kwargs))
        batch_dims = options.batch_dims
        recipe = _Recipe(model, example_inputs, example_kwargs,
                         _input_dims(model, example_inputs, example_kwargs, batch_dims),
                         batch_dims if isinstance(batch_dims, int) else 0, options,
                         _link_function(options))
        recipe.progress = Progress(options.progress)
        return recipe

    def trace(self, model: nn.Module) -> fx.GraphModule:
        o = self.options
        gm = trace(model, copied(self.args), copied(self.kwargs), batch_dims=self.input_dims,
                   capture=o.capture, leaf_modules=o.leaf_modules, concrete_args=o.concrete_args,
                   stages=o.stages_asked)     # a graph fine enough for the stages
        self.traced_code[model.training] = gm.code
        return gm

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


class _Holding(nn.Module):
    """`model` computing with other values for some of its tensors, by name
    (`torch.func.functional_call`), the model's own left as they are."""

    def __init__(self, model: nn.Module, values: dict[str, torch.Tensor]):
        super().__init__()
        self.model = model
        self.values = values

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.model, self.values, args, kwargs)


def _holding(model: nn.Module, held: nn.Module) -> nn.Module:
    """`model` computing with the values `held` has for its tensors where they are other
    tensors (a pipeline's copies on stage devices), copied to where the model's are; the model
    itself where there are none."""
    own = dict([*model.named_parameters(remove_duplicate=False),
                *model.named_buffers(remove_duplicate=False)])
    copies: dict[int, torch.Tensor] = {}       # tied tensors keep one value
    values = {name: copies.setdefault(id(t), t.detach().to(own[name].device, copy=True))
              for name, t in [*held.named_parameters(remove_duplicate=False),
                              *held.named_buffers(remove_duplicate=False)]
              if name in own and own[name] is not t}
    return _Holding(model, values) if values else model


def _build(model: nn.Module, gm: fx.GraphModule, recipe: _Recipe,
           held: nn.Module | None = None) -> Plan:
    """The passes after capture, on `model` in its current mode, then the checks: the complete
    plan, before any Pipeline exists. With `held` (the other mode's pipeline's tensors), the
    stages compute with its values, and the model it is checked against too (`_holding`)."""
    o = recipe.options
    training = model.training if o.training is None else o.training
    args, kwargs, dims = recipe.args, recipe.kwargs, recipe.input_dims
    unpipelined_s = _time_unpipelined(model, recipe, training)
    chunk_list = _chunk_options(model, recipe, training, len(o.devices))
    first_args, first_kwargs = microbatch.split((args, kwargs), chunk_list[0], dims)[0]
    functionalize(gm, copied(first_args), copied(first_kwargs))
    seed_random_ops(gm)   # dropout & co draw from each micro-batch's seed
    costs = _Costs(gm, recipe, training)
    chosen, reason, considered = _choose(costs, recipe, training, chunk_list, unpipelined_s)
    config = chosen.config
    specs = chosen.partition.devices
    costed = costs.measure(config, specs)     # the chosen configuration's costs stay on the nodes
    # The model's last runs, before any stage is placed (a stage holds copies of the tensors
    # that are not on its device): the pipeline is checked against what the model computes here.
    reference = _reference(model if held is None else _holding(model, held), recipe,
                           config.chunks, o.verify, o.verify_tolerance)
    stages = split_stages(gm, chosen.partition.stage_of, [d.name for d in specs],
                          placed=recipe.placed)
    held_by_stages(gm, stages)       # the pipeline's parameters: the stages' own
    if held is not None:
        carry_values(held, gm)
    part, recomputed = chosen.partition, ((),) * len(stages)
    if training and o.recompute == "auto":
        part, recomputed = _recompute_less(part, stages, config, o.optimizer_state,
                                           lower_bound_s(costed.step, specs))
    verified = "yes" if o.verify else "skipped (verify=False)"
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    signature = signature_of(gm)
    plan = make_plan(gm.meta["capture"], part, stages, config.chunks, verified,
                     wiring=Wiring.of(stages, [n.name for n in output.all_input_nodes
                                               if n.op != "placeholder"]),
                     signature=signature,
                     batch_dims=_placeholder_dims(signature, dims, recipe.default_dim),
                     schedule=config.schedule, threads=tuple(d.threads for d in specs),
                     training=model.training, measurements=costs.saved_measurements(),
                     recompute=o.recompute, stage_recomputed=recomputed,
                     output_dims=reference.output_dims, unpipelined_s=unpipelined_s,
                     unpipelined_threads=torch.get_num_threads(), chosen=chosen,
                     reason=reason, considered=considered,
                     calibration=costs.calibration[config.chunks, specs[0].kind,
                                                   config.num_stages > 1],
                     spread=measurement_spread(gm), link=o.link_name, graph=gm,
                     link_fn=recipe.link)
    _verify(plan, recipe, reference, o.verify_tolerance)
    # The model as is runs the model's own ops, so it takes the model's time.
    predicted_s = (unpipelined_s if plan.runs_as_is else
                   max((slot.end_s for slot in plan.predict(training=training)), default=0.0))
    return replace(plan, predicted_step_s=predicted_s)


def _choose(costs: "_Costs", recipe: _Recipe, training: bool, chunk_list: Sequence[int],
            unpipelined_s: float) -> tuple[search.Candidate, str, tuple[search.Candidate, ...]]:
    """Every configuration the options leave open, costed, partitioned and predicted; the one
    to build, why, and all those considered (the model as is last, when it was one)."""
    o = recipe.options
    specs, link, num_stages = o.devices, recipe.link, o.num_stages
    stage_counts = (range(1, len(specs) + 1) if num_stages == "auto" else
                    [num_stages or len(specs)])
    schedules = list(search.SCHEDULES if o.schedule == "auto" and training else
                     ["gpipe" if o.schedule == "auto" else o.schedule])
    cores = os.cpu_count() or 1
    memory = Memory(training=training, optimizer_state=o.optimizer_state,
                    recompute=o.recompute)
    as_is_config = search.Config(1, 1, schedules[0], torch.get_num_threads())
    candidates = []
    for k in stage_counts:
        threads = search.stage_threads(specs, k, cores, o.threads_per_stage)
        for chunks in (chunk_list if k > 1 or len(chunk_list) == 1 else [1]):
            for schedule in (schedules if k > 1 else schedules[:1]):   # alike on one stage
                config = search.Config(k, chunks, schedule, threads)
                if num_stages == "auto" and config == as_is_config:
                    continue     # the model as it is, measured whole below
                recipe.progress.doing(f"planning {k} stage{'s' * (k > 1)} x {chunks} "
                                      f"micro-batch{'es' * (chunks > 1)}")
                devices = costs.devices(config, specs)
                candidates.append(search.consider(config, costs.measure(config, devices),
                                                  devices, link, training, cores, memory))
    as_is = None
    # The model as it is: one stage, whole batch, the caller's threads, and its own tensors,
    # so only where they all are on the first device (there the stage holds them, not copies).
    if num_stages == "auto" and all(t.device == torch.device(specs[0].name) for t in
                                    [*recipe.model.parameters(), *recipe.model.buffers()]):
        devices = costs.devices(as_is_config, specs)
        as_is = search.consider(as_is_config, costs.measure(as_is_config, devices), devices,
                                link, training, memory=memory)
        as_is = replace(as_is, predicted_s=unpipelined_s if as_is.partition else None)
    chosen, reason = search.choose(candidates, as_is)
    return chosen, reason, tuple(candidates) + ((as_is,) if as_is else ())


class _Costs:
    """The graph's node costs, measured once per micro-batch size, device kind (a CPU kind per
    thread count) and thread (the caller's, or a worker's as the stages of a pipeline run on),
    then calibrated; a configuration's costs are those of its devices' kinds."""

    def __init__(self, gm: fx.GraphModule, recipe: _Recipe, training: bool):
        self.gm, self.recipe, self.training = gm, recipe, training
        self.measured: dict[tuple, dict[fx.Node, NodeCost]] = {}
        self.calibration: dict[tuple, tuple[float, float]] = {}
        saved = recipe.options.costs
        self.saved: Mapping[tuple, Measurement] = {
            key: m for key, m in (saved.measurements if saved is not None else {}).items()
            if key[3] == training}      # costs measured with backward, or without
        if self.saved:
            names = {n.name for n in gm.graph.nodes if n.op != "output"}
            known = next(iter(self.saved.values())).costs.keys()
            if names != set(known):
                raise CostError(
                    f"the costs passed with costs= were measured on another graph ("
                    f"{len(names - set(known))} of this graph's {len(names)} nodes are not in "
                    f"it): pass the plan of this model, captured with the same options")

    def saved_measurements(self) -> dict[tuple, Measurement]:
        """Every measurement made or reused, by (the micro-batch's input shapes, kind, on a worker
        thread, with backward), each node's cost by name: what `compile(..., costs=plan)`
        reuses."""
        found = dict(self.saved)
        for (chunks, kind, worker), costs in self.measured.items():
            found[self._key(chunks, kind, worker)] = Measurement(
                {n.name: cost for n, cost in costs.items()},
                self.calibration[chunks, kind, worker])
        return found

    def _key(self, chunks: int, kind: str, worker: bool) -> tuple:
        recipe = self.recipe
        first = microbatch.split((recipe.args, recipe.kwargs), chunks, recipe.input_dims)[0]
        shapes = tuple(tuple(t.shape) for t in tensors(first))    # what a node's cost depends on
        return (shapes, kind, worker, self.training)

    @staticmethod
    def devices(config: search.Config, specs: Sequence[DeviceSpec]) -> list[DeviceSpec]:
        """The configuration's devices, each CPU stage with its threads."""
        return shared_memory([replace(d, threads=d.threads or config.threads)
                              if d.name.startswith("cpu") else d
                              for d in specs[:config.num_stages]])

    def measure(self, config: search.Config, devices: Sequence[DeviceSpec]) -> search.Costed:
        """The graph costed as `config`'s stages run one of `config.chunks` micro-batches on
        `devices`: each kind measured on its device with its threads, on a worker thread of its
        own when the stages run on workers (several stages), where intra-op threads scale
        differently than on the caller's thread. Leaves those costs on the nodes."""
        worker = config.num_stages > 1
        kinds = list(dict.fromkeys(d.kind for d in devices))
        for device in {d.kind: d for d in devices}.values():
            key = (config.chunks, device.kind, worker)
            if key not in self.measured:
                self.measured[key] = self._measure(config.chunks, device, worker)
        for n in self.gm.graph.nodes:
            if n.op != "output":
                n.meta["costs"] = {k: self.measured[config.chunks, k, worker][n] for k in kinds}
                n.meta["cost"] = n.meta["costs"][kinds[0]]
        return search.Costed(cost_graph(self.gm, kinds=kinds),
                             cost_graph(self.gm, training=self.training, kinds=kinds))

    def _measure(self, chunks: int, device: DeviceSpec, worker: bool) -> dict[fx.Node, NodeCost]:
        gm, recipe = self.gm, self.recipe
        reused = self.saved.get(self._key(chunks, device.kind, worker))
        if reused is not None:
            self.calibration[chunks, device.kind, worker] = reused.calibration
            return {n: reused.costs[n.name] for n in gm.graph.nodes if n.op != "output"}
        args, kwargs = microbatch.split((recipe.args, recipe.kwargs), chunks,
                                        recipe.input_dims)[0]

        def run():
            with _intra_op_threads(device.threads):
                annotate_costs(gm, args, kwargs, device=device.name,
                               repeats=recipe.options.repeats, backward=self.training,
                               progress=recipe.progress.nodes)
                self.calibration[chunks, device.kind, worker] = _calibrate(
                    gm, args, kwargs, self.training, torch.device(device.name))
        _on_worker_thread(run) if worker else run()
        return {n: n.meta["cost"] for n in gm.graph.nodes if n.op != "output"}


def _recompute_less(part: Partition, stages: Sequence[Stage], config: search.Config,
                    optimizer_state: float, bound_s: float
                    ) -> tuple[Partition, tuple[tuple[str, ...], ...]]:
    """Where the partitioner has a stage recompute its whole forward to fit, recompute only its
    cheapest nodes per byte when that fits (`fxpipe.passes.recompute`): the stages rewritten in
    place, the partition repriced, and the nodes each stage recomputes."""
    peaks = search.in_flight(True, config.schedule, config.chunks, len(stages))
    memory = Memory(in_flight=tuple(peaks), training=True, optimizer_state=optimizer_state)
    costs, recomputed = list(part.stages), []
    for s, (stage, cost, device) in enumerate(zip(stages, part.stages, part.devices)):
        choice = None
        if cost.recompute:      # what the stage holds recomputing, but its saved activations
            fixed = memory.need(s, stage_param_bytes(stage), 0, 0, cost.received_bytes,
                                cost.sent_bytes, recompute=True)
            choice = choose_recomputed(stage.module, in_flight=peaks[s], fixed_bytes=fixed,
                                       capacity=device.memory_bytes, speed=device.speed)
        if choice is None or choice.extra_s >= cost.recompute_s:
            recomputed.append(())
            continue
        checkpoint_regions(stage.module, set(choice.nodes))
        saved_s = cost.recompute_s - choice.extra_s
        costs[s] = replace(cost, compute_s=cost.compute_s - saved_s,
                           backward_s=cost.backward_s - saved_s, recompute=False,
                           recompute_s=choice.extra_s, memory_bytes=fixed + peaks[s] *
                           choice.kept_bytes + choice.transient_bytes)
        recomputed.append(choice.nodes)
    if costs == list(part.stages):
        return part, tuple(recomputed)
    # The partitioner's optimum was over stages recomputing whole: the bound left is compute's.
    bottleneck = max(c.time_s for c in costs)
    bound = min(bound_s, bottleneck)
    return replace(part, stages=tuple(costs), bottleneck_s=bottleneck, lower_bound_s=bound,
                   optimal=bottleneck <= bound * (1 + 1e-9)), tuple(recomputed)


def _chunk_options(model: nn.Module, recipe: _Recipe, training: bool, devices: int) -> list[int]:
    """The micro-batch counts to consider: the one asked for, or with "auto" the powers of two
    worth trying (`search.chunk_options`); only one micro-batch where micro-batches would
    compute something else than the whole batch (BatchNorm normalising each in training)."""
    chunks = recipe.options.chunks
    if chunks != "auto":
        return [chunks]
    if training and any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
                        for m in model.modules()):
        return [1]
    rows = microbatch.batch_size((recipe.args, recipe.kwargs), recipe.input_dims)
    return search.chunk_options(rows, devices)


def _on_worker_thread(fn: Callable[[], None]) -> None:
    """Call `fn` on a thread of its own, as the runtime runs a stage; its exception re-raised."""
    errors: list[BaseException] = []

    def call():
        try:
            fn()
        except BaseException as e:      # handed to the caller's thread
            errors.append(e)
    thread = threading.Thread(target=call, name="fxpipe-measure", daemon=True)
    thread.start()
    while thread.is_alive():            # with a timeout, so Ctrl-C reaches the caller
        thread.join(0.05)
    if errors:
        raise errors[0]


def _calibrate(gm: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any], training: bool,
               device: torch.device | None = None, repeats: int = 3) -> tuple[float, float]:
    """Scale the nodes' measured costs so that they add up to the graph's own time, measured
    here in the same conditions (thread, threads, micro-batch); returns the factors applied to
    forward and backward times.

    Timing each node alone misses what runs between nodes (the dispatch of the next op, autograd's
    engine walking the whole graph, gradients accumulated across nodes), and adds what timing a
    node costs: the graph run whole measures what a stage will see. The median of `repeats` runs
    after a warm-up, on `device` (default: where `gm`'s parameters are; a copy placed there
    where `gm` is elsewhere), timed as the nodes were (`start_timer`: CUDA events on a GPU);
    buffers and random generators are left as they were.
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    node_fwd_s = sum(n.meta["cost"].fwd_s for n in nodes)
    node_bwd_s = sum(n.meta["cost"].bwd_s for n in nodes)
    device = device or next((t.device for t in gm.parameters()), torch.device("cpu"))
    measured = placed_copy(gm, device)
    inputs = bind_inputs(gm, *pytree.tree_map(
        lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, (args, kwargs)))
    params = [p for p in measured.parameters() if p.requires_grad]
    run = _positional(measured)
    forward_s, step_s = [], []
    with unchanged_state(measured), torch.random.fork_rng(devices=[]), microbatch_seed(0):
        for _ in range(repeats + 1):
            fresh = copied(inputs)
            elapsed_s = start_timer(device)
            with torch.set_grad_enabled(training and bool(params)):
                out = run(*fresh)
                forward_s.append(elapsed_s())
                loss = sum(t.float().sum() for t in pytree.tree_leaves(out)
                           if isinstance(t, torch.Tensor) and t.requires_grad)
                if isinstance(loss, torch.Tensor):
                    torch.autograd.grad(loss, params, allow_unused=True)
            step_s.append(elapsed_s())
    forward = statistics.median(forward_s[1:])
    backward = max(0.0, statistics.median(step_s[1:]) - forward)
    scale = (forward / node_fwd_s if node_fwd_s > 0 else 1.0,
             backward / node_bwd_s if training and node_bwd_s > 0 else 1.0)
    for n in nodes:
        cost = n.meta["cost"]
        n.meta["cost"] = replace(cost, fwd_s=cost.fwd_s * scale[0], bwd_s=cost.bwd_s * scale[1])
    return scale


def _positional(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` as generated code taking one positional argument per placeholder (no `*args`, no
    defaults), as a stage takes its inputs; on `gm`'s own parameters."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in graph.nodes:
        if n.op == "placeholder":
            n.target, n.args = n.name, ()
    return fx.GraphModule(gm, graph)


@contextlib.contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` intra-op threads on this thread (None: as it is)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _time_unpipelined(model: nn.Module, recipe: _Recipe, training: bool,
                      repeats: int = 3) -> float:
    """The model's own time for one batch, as given: whole, on its device, with the caller's
    threads (in training, forward and backward to every parameter): what a pipeline must beat.

    Measured on the model as given (each device it uses synchronised), without side effects;
    the median of `repeats` after one warm-up run.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    devices = {t.device for t in [*model.parameters(), *model.buffers(),
                                  *tensors((recipe.args, recipe.kwargs))]}
    times = []
    for _ in range(repeats + 1):
        with unchanged(model), torch.set_grad_enabled(training and bool(params)):
            args, kwargs = copied(recipe.args), copied(recipe.kwargs)
            synchronize(*devices)
            start = time.perf_counter()
            out = model(*args, **kwargs)
            loss = sum(t.float().sum() for t in pytree.tree_leaves(out)
                       if isinstance(t, torch.Tensor) and t.requires_grad)
            if isinstance(loss, torch.Tensor):
                torch.autograd.grad(loss, params, allow_unused=True)   # .grad left alone
            synchronize(*devices)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


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
    from .distributed import measure_link
    measured = measure_link()
    return lambda src, dst: measured


def _checked_link(link: LinkFn, specs: Sequence[DeviceSpec]) -> LinkFn:
    """`link`, its answer for every pair of devices (and the driver) checked once, up front."""
    checked: dict[tuple[str, str], Link] = {}

    def checked_link(src: DeviceSpec, dst: DeviceSpec) -> Link:
        if (src.name, dst.name) not in checked:
            checked[src.name, dst.name] = _valid_link(link(src, dst), src, dst)
        return checked[src.name, dst.name]
    for src in [DRIVER, *specs]:
        for dst in [DRIVER, *specs]:
            checked_link(src, dst)
    return checked_link


def _valid_link(found: Any, src: DeviceSpec, dst: DeviceSpec) -> Link:
    where = f"link({src.name!r}, {dst.name!r}) returned {found!r}"
    if not isinstance(found, Link):
        raise CostError(f"{where}: a link function must return a fxpipe.Link, e.g. "
                        f"Link(latency_s=10e-6, bytes_per_s=20e9)")
    if not (isinstance(found.latency_s, (int, float)) and 0 <= found.latency_s < math.inf):
        raise CostError(f"{where}: latency_s must be a finite number of seconds >= 0")
    if not (isinstance(found.bytes_per_s, (int, float)) and found.bytes_per_s > 0):
        raise CostError(f"{where}: bytes_per_s must be a bandwidth > 0 (math.inf for a free copy)")
    return found


# ---- batch dimensions -----------------------------------------------------------------------

def _input_dims(model: nn.Module, args: tuple, kwargs: Mapping[str, Any],
                batch_dims: BatchDims) -> tuple[tuple, dict]:
    """`batch_dims` as one dimension per input: a pytree prefix of `(args, kwargs)`."""
    names = _positional_names(model, len(args))
    if isinstance(batch_dims, int) and not isinstance(batch_dims, bool):
        by_name: dict[str, int | None] = {}
        default = batch_dims
    elif isinstance(batch_dims, Mapping):
        default, by_name = 0, {}
        for key, dim in batch_dims.items():
            if isinstance(key, int) and 0 <= key < len(args):
                key = names[key] if names[key] is not None else key
            elif key not in kwargs and key not in names:
                raise BatchError(f"batch_dims names {key!r}, which is not an input of the example "
                                 f"(positional 0..{len(args) - 1}: {names}; keyword: "
                                 f"{sorted(kwargs)}): name an input or give its position")
            if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool)):
                raise BatchError(f"batch_dims[{key!r}]={dim!r}: use a dimension (an int) or None")
            by_name[key] = dim
    else:
        raise BatchError(f"batch_dims={batch_dims!r}: use an int (the batch dimension of every "
                         f"input) or a dict from input name or position to its batch dimension")
    positional = tuple(by_name.get(n if n is not None else i, default)
                       for i, n in enumerate(names))
    return positional, {k: by_name.get(k, default) for k in kwargs}


def _positional_names(model: nn.Module, count: int) -> list[str | None]:
    """The forward parameter each of `count` positional inputs binds to (None: past `*args`)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return [None] * count
    named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [named[i] if i < len(named) else None for i in range(count)]


def _placeholder_dims(signature: Signature, input_dims: tuple[tuple, dict],
                      default: int) -> dict[str, Any]:
    """The batch dimension of each graph placeholder, from the model inputs' ones."""
    positional, keyword = input_dims
    if signature.in_spec is None:          # fx: one placeholder per forward parameter
        names = list(signature.names)
        by_name = dict(keyword)
        for name, dim in zip(names, positional):
            if name == signature.var_positional:
                break
            by_name[name] = dim
        return {p: by_name.get(n, default) for p, n in zip(signature.placeholders, names)}
    # export: one placeholder per leaf of (args, kwargs), in in_spec's order
    tree = pytree.tree_unflatten(list(range(signature.in_spec.num_leaves)), signature.in_spec)
    dims: dict[int, Any] = {}
    for i, value in enumerate(tree[0]):
        for leaf in pytree.tree_leaves(value):
            dims[leaf] = positional[i] if i < len(positional) else default
    for name, value in tree[1].items():
        for leaf in pytree.tree_leaves(value):
            dims[leaf] = keyword.get(name, default)
    return {p: dims.get(i, default) for i, p in enumerate(signature.placeholders)}


# ---- checks on the example ------------------------------------------------------------------

@dataclass(frozen=True)
class _Reference:
    """What the model computed on the example before anything was placed: each output's batch
    dimension (None for one micro-batch) and, to verify against, its outputs run once per
    micro-batch, merged, and whether it draws random numbers."""

    output_dims: tuple[int | None, ...] | None
    expected: Any = None
    verify: bool = False
    random: bool = False


def _reference(model: nn.Module, recipe: _Recipe, chunks: int, verify: bool,
               tolerance: float | None) -> _Reference:
    """The model's runs that compile's checks need, all made before any of its tensors is
    placed on a stage device: each output's batch dimension, the micro-batch check
    (`_check_batch_independent`), and with `verify` the outputs the pipeline must reproduce
    (see `fxpipe.reference`). On copies of the example, from fixed seeds; the model's buffers
    and the caller's random state are left as they were."""
    args, kwargs, dims = recipe.args, recipe.kwargs, recipe.input_dims
    if chunks == 1 and not verify:
        return _Reference(None)
    with unchanged(model):
        torch.manual_seed(0)
        seeds = microbatch_seeds(chunks)        # those the pipeline draws after manual_seed(0)
        parts = run_per_microbatch(model, args, kwargs, chunks, seeds=seeds, batch_dims=dims)
    output_dims = None
    if chunks > 1:
        with unchanged(model):
            torch.manual_seed(seeds[0])
            whole = model(*copied(args), **copied(kwargs))
        rows = [microbatch.batch_size(p, dims)
                for p in microbatch.split((args, kwargs), chunks, dims)]
        output_dims = tuple(_output_dims(whole, parts, rows, tolerance))
    if not verify:
        return _Reference(output_dims)
    random = _draws_random_numbers(model, args, kwargs)
    if chunks > 1:
        _check_batch_independent(model, recipe, output_dims, tolerance, whole, parts, random)
    return _Reference(output_dims, microbatch.merge(parts, output_dims), True, random)


def _verify(plan: Plan, recipe: _Recipe, reference: _Reference,
            tolerance: float | None) -> None:
    """With `verify`, the plan's placed stages checked against the model's outputs
    (`_reference`): the call a pipeline makes (`call_stages`), on a copy of the example from
    the same seed, every stage in turn on the caller's thread (`Runtime.in_order`: no Pipeline,
    no worker thread), the stages' buffers put back after."""
    if not reference.verify:
        return
    runtime = runtime_of(plan)
    with unchanged(plan.graph), runtime.in_order():
        torch.manual_seed(0)
        actual = call_stages(plan, runtime, copied(recipe.args), copied(recipe.kwargs))
    problem = difference(actual, reference.expected, tolerance)
    if problem and reference.random:
        raise FxpipeError(
            f"the pipeline differs from the model run once per micro-batch under the same seeds: "
            f"{problem}. The model draws random numbers (two runs from different seeds differ), "
            f"and the pipeline drew other ones: compile with verify=False to accept it, and "
            f"please report it as a bug in fxpipe with the model")
    if problem:
        raise FxpipeError(
            f"the pipeline does not reproduce the model on the example inputs: {problem}. If this "
            f"is rounding (the number of threads changes the order of sums), relax the check with "
            f"verify_tolerance= (a tolerance relative to each output's largest value) or skip it "
            f"with verify=False; otherwise this is a bug in fxpipe: please report it with the "
            f"model")


def _output_dims(whole: Any, parts: Sequence[Any], rows: Sequence[int],
                 tolerance: float | None) -> list[int | None]:
    """Each output leaf's batch dimension, the one whose size follows the batch size.

    None for a leaf that is the same on every micro-batch and on the whole batch (a constant);
    an output whose shape does not follow the batch, or follows it in several dimensions, is
    refused by name: it reduces or mixes the batch, and micro-batches cannot be merged into it.
    """
    flat_whole, spec = pytree.tree_flatten_with_path(whole)
    flat_parts = [pytree.tree_flatten(p) for p in parts]
    if any(other != pytree.tree_structure(whole) for _, other in flat_parts):
        raise BatchError(f"the model's output differs in structure between the whole batch and a "
                         f"micro-batch: return the same structure for every batch, or use chunks=1")
    total = sum(rows)
    dims: list[int | None] = []
    for i, (path, w) in enumerate(flat_whole):
        column = [leaves[i] for leaves, _ in flat_parts]
        if not isinstance(w, torch.Tensor):
            dims.append(None)
            continue
        name = output_name(path)
        if any(not isinstance(c, torch.Tensor) or c.dim() != w.dim() for c in column):
            raise BatchError(f"{name} changes its number of dimensions with the batch size: "
                             f"return tensors whose batch dimension stays, or use chunks=1")
        changed = [d for d in range(w.dim()) if any(c.shape[d] != w.shape[d] for c in column)]
        shape = "(" + ", ".join("B" if d in changed else str(s) for d, s in enumerate(w.shape)) + \
                ("," if w.dim() == 1 else "") + ")"
        if not changed:
            if all(not difference(c, w, tolerance) for c in column):
                dims.append(None)     # does not depend on the batch: given once
                continue
            raise BatchError(
                f"{name} of shape {tuple(w.shape)} reduces over the batch: its shape does not "
                f"follow the batch size, so it cannot be rebuilt from micro-batches. Return "
                f"per-sample values and reduce after the pipeline, or use chunks=1{_NOT_DIM_0}")
        d = changed[0]
        if len(changed) > 1 or any(w.shape[d] * r != c.shape[d] * total
                                   for c, r in zip(column, rows)):
            raise BatchError(
                f"{name} of shape {shape} mixes the batch (B: the batch size): each sample's "
                f"values depend on the others, so micro-batches cannot be merged into it. Compute it "
                f"after the pipeline from per-sample outputs, or use chunks=1{_NOT_DIM_0}")
        dims.append(d)
    return dims


_NOT_DIM_0 = (" (if the batch is not dimension 0 of every input, as in a sequence-first RNN, say "
              "which dimension it is with batch_dims=)")


def _check_batch_independent(model: nn.Module, recipe: _Recipe, output_dims, tolerance,
                             whole: Any, parts: Sequence[Any], random: bool) -> None:
    """Refuse a model whose output on micro-batches differs from its output on the whole batch.

    Checked in eval mode (BatchNorm in training mode normalises each micro-batch by design, as
    in GPipe), and only where the model is deterministic there. `whole` and `parts` are the
    runs already made in the model's mode, reused when that is eval; `random`: whether the model
    draws random numbers in its mode.
    """
    args, kwargs, dims = recipe.args, recipe.kwargs, recipe.input_dims
    flags = {m: m.training for m in model.modules()}
    try:
        model.eval()
        if any(flags.values()):
            with unchanged(model):
                whole = model(*copied(args), **copied(kwargs))
                parts = run_per_microbatch(model, args, kwargs, len(parts), batch_dims=dims)
        try:
            merged = microbatch.merge(parts, output_dims)
        except BatchError:      # eval mode returns other outputs than the mode checked
            return
        problem = difference(merged, whole, tolerance)
        if not problem or (random if not any(flags.values()) else
                           _draws_random_numbers(model, args, kwargs)):
            return
    finally:
        for m, flag in flags.items():
            m.training = flag
    raise BatchError(
        f"the model mixes samples across the batch: on micro-batches it computes something else "
        f"than on the whole batch ({problem}). If the batch is not dimension 0 of every input "
        f"(e.g. a sequence-first RNN), say which it is with batch_dims=; if the model normalises "
        f"or reduces over the batch, use chunks=1, or verify=False to accept micro-batch "
        f"semantics as GPipe does")


def _draws_random_numbers(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether two runs of the model from different seeds differ."""
    with unchanged(model):
        torch.manual_seed(1)
        first = model(*copied(args), **copied(kwargs))
    with unchanged(model):
        torch.manual_seed(2)
        second = model(*copied(args), **copied(kwargs))
    return bool(difference(first, second, 0.0))
