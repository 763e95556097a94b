"""fxpipe.testing on a deliberately broken pass: failures are caught, named and shrunk."""

import operator

import pytest
import torch
from hypothesis import HealthCheck, find, settings

import fxpipe.api
from fxpipe.testing import assert_pipeline_matches, models
from fxpipe.passes.codegen import split_stages


def sabotage_last_stage(gm, stage_of, devices, **options):
    """A broken codegen: the last stage adds 1 to everything it outputs."""
    stages = split_stages(gm, stage_of, devices, **options)
    last = stages[-1].module
    (output,) = [n for n in last.graph.nodes if n.op == "output"]
    with last.graph.inserting_before(output):
        bumped = [last.graph.call_function(operator.add, (v, 1.0)) for v in output.args[0]]
    output.args = (tuple(bumped),)
    last.recompile()
    return stages


def test_a_broken_pass_is_caught_and_the_first_differing_stage_named(monkeypatch):
    monkeypatch.setattr(fxpipe.api, "split_stages", sabotage_last_stage)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    with pytest.raises(AssertionError, match=r"stage 2 is the first whose values differ"):
        assert_pipeline_matches(model, (torch.randn(6, 4),), devices=["cpu"] * 3)


def test_shrinking_finds_a_small_model_that_breaks_a_pass(monkeypatch):
    monkeypatch.setattr(fxpipe.api, "split_stages", sabotage_last_stage)

    def breaks(case):
        model, inputs = case
        try:
            assert_pipeline_matches(model, inputs, devices=["cpu"])
        except AssertionError:
            return True
        return False

    smallest = find(models(max_nodes=12), breaks,
                    settings=settings(max_examples=200, database=None, deadline=None,
                                      suppress_health_check=list(HealthCheck)))
    assert len(smallest.spec.ops) == 1
    assert "class Model(nn.Module)" in repr(smallest)      # pasteable code


def test_a_correct_pipeline_passes_with_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    pipe = assert_pipeline_matches(model, (torch.randn(6, 4),), devices=["cpu"] * 2,
                                   backward=True)
    assert pipe.plan.partition.num_stages == 2
