"""`assert_pipeline_matches`: compile a model and check the pipeline against it."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.compare import equal, output_name, same_structure
from fxpipe.passes.randomness import microbatch_seeds
from fxpipe.passes.capture import trace, without_cache

from ..runtime import microbatch
from ..api import compile
from ..planning.reference import run_per_microbatch
from ..pipeline import Pipeline
from ._rounding import EPSILONS, assert_same_up_to_rounding


def assert_pipeline_matches(model: nn.Module, example_inputs: tuple = (),
                            example_kwargs: Mapping[str, Any] | None = None, *,
                            devices: Sequence[str] = ("cpu", "cpu"), chunks: int | None = None,
                            backward: bool = False, rtol: float | None = None,
                            atol: float | None = None, epsilons: float = EPSILONS, seed: int = 0,
                            **compile_options: Any) -> Pipeline:
    """Compile `model` and assert the pipeline equals the model run once per micro-batch.

    The reference is what a pipeline promises (`fxpipe.planning.reference`): the model called on each
    micro-batch in turn, micro-batch `m` after `torch.manual_seed(seeds[m])` with the seeds the
    pipeline's call draws after `torch.manual_seed(seed)`; so dropout, BatchNorm and buffers
    updated in forward are compared too. The pipeline's outputs and the model's buffers after
    the call must equal the reference's; with `backward`, both are back-propagated from the sum
    of their outputs and every parameter's gradient is compared. On a mismatch the message
    names the first stage whose outputs differ from the model's values for the same nodes.
    Values are compared as rounding allows (`assert_same_up_to_rounding`: the outputs, the
    buffers, all the gradients, each set within `epsilons` of its own largest magnitude), or
    with `rtol` or `atol`, by `torch.testing.assert_close` with them, element by element.
    A model whose forward takes `use_cache` runs with `use_cache=False`, as the pipeline does.
    Returns the pipeline; the model's buffers are left as the pipeline's call left them.

    `chunks` defaults to as many micro-batches as the batch allows, up to 4. A model with fewer
    operations than `devices` runs on as many stages as it has operations (compile itself
    refuses more stages than nodes), so one strategy can feed models of any size.
    """
    example_kwargs = without_cache(model, example_inputs, example_kwargs)   # as compile runs it
    if chunks is None:
        rows = [t.shape[0] for t in pytree.tree_leaves((example_inputs, example_kwargs))
                if isinstance(t, torch.Tensor) and t.dim() > 0]
        chunks = max(1, min(4, min(rows, default=1)))
    devices = list(devices)[:_computing_nodes(model, example_inputs, example_kwargs,
                                              compile_options, len(devices))]
    pipe = compile(model, devices, example_inputs, example_kwargs, chunks=chunks,
                   verify=False, **compile_options)
    tolerance = ({"epsilons": epsilons} if rtol is None and atol is None else
                 {"rtol": rtol, "atol": atol})
    params = {name: p for name, p in pipe.named_parameters() if p.requires_grad}
    before = _buffers(model)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        parts = run_per_microbatch(model, example_inputs, example_kwargs, pipe.chunks,
                                   seeds=microbatch_seeds(pipe.chunks),
                                   batch_dims=pipe._recipe.input_dims)
    expected = microbatch.merge(parts, pipe._output_dims)
    expected_buffers = _buffers(model)
    grads_model = _grads(expected, params) if backward else {}
    _restore(model, before)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        actual = pipe(*example_inputs, **example_kwargs)
    try:
        _assert_trees_close(actual, expected, tolerance, "output")
    except AssertionError as error:
        raise AssertionError(f"{error}\n{_first_differing_stage(pipe, example_inputs, example_kwargs, tolerance)}") from None
    _assert_trees_close(_buffers(model), expected_buffers, tolerance, "buffers after the call")
    if backward:
        _assert_trees_close(_grads(actual, params), grads_model, tolerance, "gradient of")
    return pipe


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _restore(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(saved[name])


def _computing_nodes(model: nn.Module, args: tuple, kwargs: dict, options: dict,
                     stages: int) -> int:
    """How many stages the model's graph, captured for `stages`, can fill: its nodes other
    than inputs and reads."""
    capture = {k: options[k] for k in ("capture", "leaf_modules", "concrete_args") if k in options}
    gm = trace(model, args, kwargs, stages=stages, **capture)
    return sum(n.op not in ("placeholder", "output", "get_attr") for n in gm.graph.nodes)


def _grads(outputs: Any, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    loss = sum(t.float().sum() for t in pytree.tree_leaves(outputs)
               if isinstance(t, torch.Tensor) and t.requires_grad)
    if not isinstance(loss, torch.Tensor) or not params:
        return dict.fromkeys(params)
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)))


def _assert_trees_close(actual: Any, expected: Any, tolerance: dict, what: str) -> None:
    """Every leaf of `actual` close to `expected`'s: as rounding allows, the whole tree one set
    (`assert_same_up_to_rounding`) where `tolerance` gives `epsilons`, else by
    torch.testing.assert_close with it (or == for a non-tensor); containers as
    `fxpipe.passes.compare` judges them, by their keys."""
    if "epsilons" in tolerance:
        assert_same_up_to_rounding(actual, expected, what=what, **tolerance)
        return
    assert same_structure(actual, expected), (
        f"{what} structure differs: pipeline gives {pytree.tree_structure(actual)}, model gives "
        f"{pytree.tree_structure(expected)}")
    for (path, e), a in zip(pytree.tree_flatten_with_path(expected)[0], pytree.tree_leaves(actual)):
        where = f"{what}{'' if not path else ' ' + output_name(path).removeprefix('output ')}"
        if isinstance(e, torch.Tensor) or isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, e, check_device=False, **tolerance,
                                       msg=lambda m: f"{where} differs: {m}")
        else:
            assert equal(a, e), f"{where} differs: {a!r} != {e!r}"


def _first_differing_stage(pipe: Pipeline, args: tuple, kwargs: dict, tolerance: dict) -> str:
    """Run the whole graph and the stages one after the other; name the first that disagrees."""
    from fxpipe.passes.annotate_costs import bind_inputs

    gm = pipe.module
    inputs = bind_inputs(gm, args, kwargs)
    reference: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            reference[n.name] = result = super().run_node(n)
            return result

    with torch.no_grad():
        Recorder(gm).run(*inputs)
        env = dict(reference)
        for stage in pipe.stage_info:
            out = stage.module(*(env[name] for name in stage.inputs))
            for name, value in zip(stage.outputs, out):
                try:
                    _assert_trees_close(value, reference[name], tolerance, name)
                except AssertionError as error:
                    return (f"stage {stage.index} is the first whose values differ: node {name!r}: "
                            f"{error}\n{stage.module.code}")
    return ("every stage agrees with the model on the whole batch: the difference comes from "
            "splitting it into micro-batches (an op that mixes samples across the batch?)")
