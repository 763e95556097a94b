"""`fxpipe.compile`: the passes called in order, then a Pipeline that runs their result."""

from __future__ import annotations

import os
from typing import Any, Iterable, Literal, Mapping, Sequence

import torch
from torch import nn

from passes.annotate_costs import annotate_costs
from passes.codegen import split_stages
from passes.cost_model import LinkFn, cost_graph, default_link
from passes.errors import BatchError, FxpipeError, PartitionError
from passes.functionalize import functionalize
from passes.partition import num_stages_for, partition
from passes.randomness import seed_random_ops
from passes.trace import CaptureMode, trace

from . import microbatch
from .devices import DeviceLike, measure_links, parse_devices
from .pipeline import Pipeline
from .report import make_plan
from .schedules import SCHEDULES, ScheduleName


def compile(model: nn.Module, devices: Sequence[DeviceLike] | DeviceLike,
            example_inputs: tuple | Any = (), example_kwargs: Mapping[str, Any] | None = None, *,
            chunks: int = 1, capture: CaptureMode = "auto",
            leaf_modules: Iterable[str | type] = (), concrete_args: Mapping[str, Any] | None = None,
            num_stages: int | Literal["auto"] | None = None,
            schedule: ScheduleName = "gpipe", training: bool | None = None,
            threads_per_stage: int | None = None,
            link: LinkFn | Literal["default", "measure"] = "default", repeats: int = 5,
            verify: bool = True) -> Pipeline:
    """Split `model` into one stage per entry of `devices`, balanced by measured time.

    `example_inputs` is one full batch (positional; a single tensor is accepted as is) and
    `example_kwargs` its keyword inputs; costs are measured on one micro-batch of it, on
    `devices[0]`. `chunks` is the number of micro-batches each call is split into.
    `num_stages` uses only the first devices: a number, or "auto" for the fewest whose
    bottleneck is within 2% of using them all (you have 8 GPUs; how many pay off?).
    `schedule` ("gpipe" or "1f1b") orders forwards and backwards in `Pipeline.train_step`.
    `training` (default: `model.training`) also measures backward costs and balances stages on
    forward plus backward time. `threads_per_stage` sets each CPU stage's intra-op threads
    (default: the cores shared evenly among the CPU stages). `link` prices transfers between
    devices: "default" (typical figures by device kind), "measure" (timed here, see
    `fxpipe.devices.measure_links`) or your own `(src, dst) -> Link` function.
    With `verify`, the pipeline's output on the example is checked against the model's (skipped
    when the model is in training mode, where dropout or BatchNorm make outputs differ).
    """
    specs = parse_devices(devices)
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    example_kwargs = dict(example_kwargs or {})
    if not isinstance(chunks, int) or chunks < 1:
        raise BatchError(f"chunks={chunks!r}: the number of micro-batches must be an int >= 1")
    if schedule not in SCHEDULES:
        raise FxpipeError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    training = model.training if training is None else training
    if link == "measure":
        link = measure_links(specs)
    elif link == "default":
        link = default_link
    elif not callable(link):
        raise FxpipeError(f"link={link!r}: use 'default', 'measure' or a (src, dst) -> Link function")

    verify = verify and not model.training
    if verify:   # before stages take the parameters to their devices
        with torch.no_grad():
            expected = model(*example_inputs, **example_kwargs)
    gm = trace(model, example_inputs, example_kwargs, capture=capture,
               leaf_modules=leaf_modules, concrete_args=concrete_args)
    first_args, first_kwargs = microbatch.split((example_inputs, example_kwargs), chunks)[0]
    functionalize(gm, first_args, first_kwargs)
    seed_random_ops(gm)   # runtime: dropout & co draw from each micro-batch's seed
    annotate_costs(gm, first_args, first_kwargs, device=specs[0].name, repeats=repeats,
                   backward=training)
    graph = cost_graph(gm, training=training)
    if num_stages == "auto":
        num_stages = num_stages_for(graph, specs, link,
                                    activation_factor=_in_flight(training, schedule, chunks, 1))
    if num_stages is not None:
        if not isinstance(num_stages, int) or not 1 <= num_stages <= len(specs):
            raise PartitionError(f"num_stages={num_stages!r}: use 'auto' or a number from 1 to "
                                 f"the {len(specs)} devices given")
        specs = specs[:num_stages]
    plan = partition(graph, specs, link,
                     activation_factor=_in_flight(training, schedule, chunks, len(specs)))
    if threads_per_stage is None:
        cpu_stages = sum(d.name.startswith("cpu") for d in specs)
        threads_per_stage = max(1, (os.cpu_count() or 1) // max(1, cpu_stages))
    stages = split_stages(gm, plan.stage_of, [d.name for d in specs])
    verified = "yes" if verify else (
        "skipped (model in training mode)" if model.training else "skipped (verify=False)")
    pipe = Pipeline(gm, stages, make_plan(gm.meta["capture"], plan, stages, chunks, verified),
                    chunks, schedule=schedule, threads_per_stage=threads_per_stage)
    if verify:
        with torch.no_grad():
            _check_reproduces(expected, pipe(*example_inputs, **example_kwargs), chunks)
    return pipe


def _in_flight(training: bool, schedule: str, chunks: int, num_stages: int) -> int:
    """Micro-batches of activations a stage holds at once: one in inference; in training, GPipe
    keeps every micro-batch until the backwards, 1F1B at most as many as there are stages."""
    if not training:
        return 1
    return chunks if schedule == "gpipe" else min(chunks, num_stages)


def _check_reproduces(expected: Any, actual: Any, chunks: int) -> None:
    """Raise unless the pipeline's output equals the model's on the example inputs."""
    flat_expected, spec = torch.utils._pytree.tree_flatten(expected)
    flat_actual, actual_spec = torch.utils._pytree.tree_flatten(actual)
    problem = "" if spec == actual_spec else f"outputs differ in structure ({actual_spec} vs {spec})"
    for i, (e, a) in enumerate(zip(flat_expected, flat_actual)):
        if problem:
            break
        try:
            torch.testing.assert_close(a, e, equal_nan=True, check_device=False)
        except AssertionError as error:
            problem = f"output {i} differs: {str(error).splitlines()[0]}"
    if problem and chunks > 1:
        raise FxpipeError(
            f"the pipeline does not reproduce the model on the example inputs: {problem}. "
            f"If the model mixes samples across the batch (a reduction or a normalisation over "
            f"dimension 0), micro-batches change its result: use chunks=1, or verify=False to "
            f"accept micro-batch semantics as GPipe does. Otherwise this is a bug in fxpipe: "
            f"please report it with the model")
    if problem:
        raise FxpipeError(f"the pipeline does not reproduce the model on the example inputs: "
                          f"{problem}. This is a bug in fxpipe: please report it with the model")
