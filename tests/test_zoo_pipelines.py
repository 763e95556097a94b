"""Every zoo architecture (examples/zoo, size "tiny") pipelined: same outputs, same gradients.

Default capture takes fx for all but `dynamic` (fx with its loop kept whole as a leaf); the same
models captured by torch.export check export graphs on real CNN and attention patterns too.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import fxpipe
from examples.zoo import ZOO, ZooCase, build
from fxpipe.testing import assert_pipeline_matches
from fxpipe.testing import assert_same_up_to_rounding, grads_of

NAMES = sorted(ZOO)
# Micro-batches take other conv kernels than the whole batch, other orders of sums: equal up to
# rounding (`fxpipe.testing`'s rule, each tensor within 64 epsilons of its own magnitude; a lost
# sample or parameter is O(1) wrong).

_cases: dict[str, ZooCase] = {}


def case(name: str) -> ZooCase:
    if name not in _cases:
        _cases[name] = build(name, size="tiny", batch=4, seed=0)
    return _cases[name]


@pytest.mark.parametrize("stages", [2, pytest.param(4, marks=pytest.mark.slow), 8])
@pytest.mark.parametrize("name", NAMES)
def test_zoo_model_pipeline_matches_outputs_and_gradients(name, stages):
    c = case(name)
    pipe = assert_pipeline_matches(c.model, c.example_inputs, c.example_kwargs,
                                   devices=["cpu"] * stages, chunks=2, backward=True)
    capture = pipe.plan.capture
    if name == "dynamic":
        assert capture.method == "fx+leaves" and capture.leaves == ("downsample",)
        assert "kept whole: downsample" in str(pipe.plan)
    else:
        assert capture.method == "fx"


@pytest.mark.parametrize("stages", [2, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", NAMES)
def test_zoo_model_captured_by_export_matches_outputs_and_gradients(name, stages):
    c = case(name)
    pipe = assert_pipeline_matches(c.model, c.example_inputs, c.example_kwargs,
                                   devices=["cpu"] * stages, chunks=2, backward=True,
                                   capture="export")
    assert pipe.plan.capture.method == "export"


@pytest.mark.parametrize("name", NAMES)
def test_zoo_model_train_step_gives_the_models_gradients(name):
    c = case(name)
    model, (x,) = c.model, c.example_inputs
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        target = torch.randn_like(model(x))
    model.zero_grad()
    expected_loss = F.mse_loss(model(x), target)
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    pipe = fxpipe.compile(model, ["cpu"] * 4, (x,), chunks=2)
    loss = pipe.train_step(x, target, F.mse_loss)
    assert_same_up_to_rounding(loss, expected_loss, what=f"{name} loss")
    assert_same_up_to_rounding(grads_of(pipe), expected, what=f"{name} gradient")
    model.zero_grad()
