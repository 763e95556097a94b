"""Hugging Face transformers through fxpipe: captured by torch.export, pipelined, same numbers.

Every model is built from a config with small random weights (2 layers, width 32, no network),
compiled on 2, 4 and 8 stages, and compared with the original: outputs (in the model's own
`ModelOutput` type) and the gradients of every parameter.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.nn import functional as F

import fxpipe
from fxpipe.testing import assert_pipeline_matches
from fxpipe.testing import assert_same_up_to_rounding

import transformers  # noqa: F401  (a test dependency: its absence must fail, not skip)

from examples.zoo.hf import HF_MODELS, build_hf  # noqa: E402


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def case(request):
    return request.param, *build_hf(request.param, size="tiny", batch=4)


@pytest.mark.parametrize("stages", [2, pytest.param(4, marks=pytest.mark.slow), 8])
def test_pipeline_matches_outputs_and_gradients(case, stages):
    name, model, inputs = case
    pipe = assert_pipeline_matches(model, (), inputs, devices=["cpu"] * stages, chunks=2,
                                   backward=True)
    assert pipe.plan.capture.method == "export", f"{name}: {pipe.plan.capture}"
    assert len(pipe.stages) == stages


@pytest.fixture(scope="module")
def pipe(case):
    """The model on 3 stages, 2 micro-batches, shared by the tests that only call it."""
    name, model, inputs = case
    return fxpipe.compile(model, ["cpu"] * 3, example_kwargs=inputs, chunks=2)


def test_output_keeps_the_models_type_and_a_smaller_last_micro_batch_runs(case, pipe):
    name, model, inputs = case
    odd = {k: v[:3] for k, v in inputs.items()}         # micro-batches of 2 and 1 rows
    out, expected = pipe(**odd), model(**odd)
    assert type(out) is type(expected) and out.keys() == expected.keys()
    for key in expected.keys():
        assert_same_up_to_rounding(out[key], expected[key], what=f"output {key!r}")


def test_plan_says_how_and_why_the_model_was_captured_and_lists_modules(case, pipe):
    name, model, inputs = case
    cache = " without the key/value cache (use_cache=False)" if "use_cache" in str(
        inspect.signature(model.forward)) else ""
    assert f"captured by export in eval mode{cache} because torch.fx failed" in str(pipe.plan)
    listed = [m for stage in pipe.plan.record.stage_modules for m in stage]
    assert listed and all(m.split(" ")[0].rsplit("-")[0] in dict(model.named_modules())
                          for m in listed)
    named = [n.name for n in pipe.module.graph.nodes if n.op == "call_function"]
    assert sum(n.startswith(tuple(p.replace(".", "_") for p, _ in model.named_children()))
               for n in named) > len(named) // 2, "most nodes are named after their module"


def loss_fn(output, target):
    return F.cross_entropy(output.logits.flatten(0, -2), target.flatten())


def test_train_step_gives_the_models_gradients(case):
    name, model, inputs = case
    logits = model(**inputs).logits
    target = torch.randint(0, logits.shape[-1], logits.shape[:-1])
    model.zero_grad()
    expected_loss = loss_fn(model(**inputs), target)
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    pipe = fxpipe.compile(model, ["cpu"] * 4, example_kwargs=inputs, chunks=2)
    loss = pipe.train_step(inputs, target, loss_fn)
    assert_same_up_to_rounding(loss, expected_loss, what=f"{name} loss")
    grads = {n: p.grad for n, p in pipe.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    assert_same_up_to_rounding(grads, expected, what=f"{name} gradient")
    model.zero_grad()
