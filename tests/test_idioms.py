"""Generated models with the idioms a pipeline must keep equal the model run per micro-batch:
dropout, `self.training` branches, `no_grad` regions and buffers updated in forward, in both
modes, on 1-4 stages: outputs, gradients and buffers (`fxpipe.testing.assert_pipeline_matches`)."""

import pytest
import torch
from hypothesis import given, strategies as st

from fxpipe.testing import assert_pipeline_matches, models

IDIOMS = dict(dropout=True, training_branches=True, grad_regions=True, buffer_updates=True)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@given(case=models(max_nodes=12, batch=(2, 6), **IDIOMS), num_stages=st.integers(1, 4),
       chunks=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_idioms_match_the_model_run_per_microbatch(training, case, num_stages, chunks, seed):
    model, inputs = case
    model.train(training)
    assert_pipeline_matches(model, inputs, devices=["cpu"] * num_stages,
                            chunks=min(chunks, inputs[0].shape[0]), backward=True, seed=seed)


def test_frozen_branch_keeps_no_gradient_through_the_pipeline():
    torch.manual_seed(0)

    class Distill(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.teacher = torch.nn.Linear(8, 8)
            self.student = torch.nn.Linear(8, 8)

        def forward(self, x):
            with torch.no_grad():
                target = self.teacher(x)
            return self.student(x) - target

    model = Distill()
    pipe = assert_pipeline_matches(model, (torch.randn(6, 8),), devices=["cpu"] * 2, chunks=3,
                                   backward=True)
    pipe(torch.randn(6, 8)).sum().backward()
    assert model.teacher.weight.grad is None and model.student.weight.grad is not None
