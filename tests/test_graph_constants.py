"""Tensors a model makes in forward (`torch.tensor([2.0])`) become constants of the traced
graph, held by its stages; they are not the model's state: the pipeline's `state_dict()` is
the model's, loads into it and from it, and a plan given the model's weights (a checkpoint, a
state_dict) runs without asking it for them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding


class Constants(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("shift", torch.full((8,), 0.5))

    def forward(self, x):
        x = self.a(x) * torch.tensor([2.0]) + self.shift
        return self.b(x) + torch.tensor([3.0])


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model, x = Constants().eval(), torch.randn(4, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), num_stages=2, chunks=2, repeats=1)
    assert any("_tensor_constant" in stage.code for stage in pipe.stages)   # the case
    yield model, x, pipe
    pipe.close()


def test_the_pipelines_state_dict_is_the_models(compiled):
    model, x, pipe = compiled
    assert list(pipe.state_dict()) == list(model.state_dict())
    other = Constants()
    other.load_state_dict(pipe.state_dict())          # strict
    pipe.load_state_dict(model.state_dict())          # strict
    with torch.no_grad():
        assert_same_up_to_rounding(other(x), model(x))


@pytest.mark.parametrize("how", ["with_weights", "load_plan"])
def test_a_plan_given_the_models_weights_keeps_its_constants(compiled, how, tmp_path):
    model, x, pipe = compiled
    state = {k: v * 0 + 1 for k, v in model.state_dict().items()}    # other values
    if how == "with_weights":
        plan = pipe.plan.with_weights(state)
    else:
        plan = fxpipe.load_plan(pipe.plan.save(tmp_path / "plan"), weights=state)
    expected = Constants()
    expected.load_state_dict(state)
    with fxpipe.Pipeline(plan) as loaded, torch.no_grad():
        assert_same_up_to_rounding(loaded(x), expected(x))
