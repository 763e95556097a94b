"""The plan is made in the conditions the stages run in, and compares itself with the model."""

import dataclasses

import pytest
import torch
from torch import nn

import fxpipe
import fxpipe.api


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh()).eval()


@pytest.mark.parametrize("threads", [1, 2])
def test_costs_are_measured_with_the_threads_each_stage_runs_with(monkeypatch, threads):
    seen = []

    def measuring(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return annotate_costs(*args, **kwargs)

    annotate_costs = fxpipe.api.annotate_costs
    monkeypatch.setattr(fxpipe.api, "annotate_costs", measuring)
    caller = torch.get_num_threads()
    fxpipe.compile(mlp(), ["cpu", "cpu"], (torch.randn(8, 16),), chunks=2,
                   threads_per_stage=threads)
    assert seen == [threads]
    assert torch.get_num_threads() == caller


def test_the_plan_compares_the_pipeline_with_the_model_run_whole():
    pipe = fxpipe.compile(mlp(), ["cpu", "cpu"], (torch.randn(8, 16),), chunks=2)
    plan = pipe.plan
    predicted = max(slot.end_s for slot in pipe.predict())
    assert plan.predicted_step_s == pytest.approx(predicted)
    assert plan.unpipelined_s > 0 and plan.unpipelined_threads == torch.get_num_threads()
    assert plan.speedup == pytest.approx(plan.unpipelined_s / predicted)
    assert "model unpipelined" in str(plan)


def test_a_plan_predicted_slower_than_the_model_says_so():
    plan = fxpipe.compile(mlp(), ["cpu", "cpu"], (torch.randn(8, 16),), chunks=2).plan
    slower = dataclasses.replace(plan, predicted_step_s=2.0, unpipelined_s=1.0)
    faster = dataclasses.replace(plan, predicted_step_s=1.0, unpipelined_s=2.0)
    assert "0.50x" in str(slower) and "predicted slower than the model" in str(slower)
    assert "2.00x" in str(faster) and "slower" not in str(faster)


def test_training_plans_compare_a_training_step():
    model = mlp().train()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 16),), chunks=2)
    assert all(p.grad is None for p in model.parameters())       # timing left .grad alone
    assert pipe.plan.predicted_step_s == pytest.approx(
        max(slot.end_s for slot in pipe.predict(training=True)))
