"""`fxpipe.plan` and `fxpipe.compile`: the edge, where options are taken and documented.

`plan` is planning conducted on a `Recipe` (`fxpipe.planning.build`: the model captured once per
mode and prepared, the configurations weighed, the one chosen realized and checked against the
model, raced where it is asked): a complete `Plan`, before any Pipeline exists. `compile` is
`Pipeline(plan)` plus the recipe it was made from (a `Planner`), kept to plan the model again in
the other mode (`pipe.train()` / `pipe.eval()`). Options are checked once, as
`fxpipe.planning.options.Options`.
"""

from __future__ import annotations

from typing import Any, Iterable, Literal, Mapping, Sequence

from torch import nn

from fxpipe.passes.cost_model import LinkFn
from fxpipe.passes.capture import CaptureMode

from .pipeline import Pipeline
from .planning.build import Planner, plan_of
from .planning.options import BatchDims, Options
from .plans.plan_data import Plan
from .runtime.devices import DeviceLike
from .runtime.schedules import ScheduleName


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
            `PlanRecord.stand_ins`. A model that holds its values refuses `weights`.

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
    recipe = Planner.of(model, example_inputs, example_kwargs, options)
    pipe = Pipeline(plan_of(recipe))
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
    return plan_of(Planner.of(model, example_inputs, example_kwargs,
                              Options(devices, **options)))
