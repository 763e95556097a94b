"""A pipeline chosen over the model as is on its prediction is raced, with the next best
predicted (the shortlist), against the model on the example, and kept only where it is measured
faster (`fxpipe.planning.build._raced`), in inference and in training.

The prediction is steered by hand (the model's own time scripted as slow, or the race's result
scripted), so what is tested is the rule, not this machine's timings.
"""

import copy

import pytest
import torch
from torch import nn

import fxpipe
import fxpipe.api
import fxpipe.planning.build
import fxpipe.planning.measure
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding
from fxpipe.planning.measure import Race


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])

    def forward(self, x):
        return torch.relu(self.layers(x))


@pytest.fixture
def model_predicted_slow(monkeypatch):
    """The model's own time scripted at 1 s: every pipeline is predicted faster than it."""
    monkeypatch.setattr(fxpipe.planning.measure.Baseline, "seconds", property(lambda self: 1.0))


def raced_as(monkeypatch, pipeline_s, model_s, cpu_share=None):
    """The race scripted: the shortlist's pipelines measured `pipeline_s` (one time each, or
    the same time for all), the model `model_s`. Returns the shortlists raced."""
    calls = []

    def race(plans, model, recipe):
        calls.append(plans)
        times = pipeline_s if isinstance(pipeline_s, tuple) else (pipeline_s,) * len(plans)
        return Race(times[:len(plans)], model_s, 7, cpu_share)
    monkeypatch.setattr(fxpipe.planning.build, "race", race)
    return calls


def test_a_pipeline_measured_slower_than_the_model_gives_way_to_the_model(
        model_predicted_slow, monkeypatch):
    calls = raced_as(monkeypatch, pipeline_s=0.004, model_s=0.002)
    torch.manual_seed(0)
    model, x = Tiny().eval(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), num_stages="auto", chunks="auto")
    assert len(calls) == 1 and not calls[0][0].runs_as_is     # the pipeline predicted fastest
    plan = pipe.plan
    assert plan.runs_as_is and plan.record.reason.startswith("no pipeline is measured faster")
    assert "measured 4.000 ms, the model 2.000 ms (the least of 7 interleaved runs" in plan.record.reason
    assert plan.record.chosen is plan.record.considered[-1]                        # the model as is
    assert any(c.config.num_stages == 2 for c in plan.record.considered)    # beside what was weighed
    assert_same_up_to_rounding(pipe(x), model(x))
    assert "no pipeline is measured faster" in str(plan)


def test_a_pipeline_measured_faster_is_kept_and_says_so(model_predicted_slow, monkeypatch):
    calls = raced_as(monkeypatch, pipeline_s=0.001, model_s=0.002)
    torch.manual_seed(0)
    model, x = Tiny().eval(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), num_stages="auto")
    assert len(calls) == 1 and not pipe.plan.runs_as_is
    assert "measured 1.000 ms, the model 2.000 ms" in pipe.plan.record.reason
    assert_same_up_to_rounding(pipe(x), model(x))


def test_within_two_percent_the_model_as_is_wins(model_predicted_slow, monkeypatch):
    raced_as(monkeypatch, pipeline_s=0.00199, model_s=0.002)
    model, x = Tiny().eval(), torch.randn(8, 16)
    assert fxpipe.compile(model, ["cpu"] * 2, (x,), num_stages="auto").plan.runs_as_is


def test_on_a_busy_machine_the_model_as_is_is_kept_and_the_plan_says_why(
        model_predicted_slow, monkeypatch):
    raced_as(monkeypatch, pipeline_s=0.001, model_s=0.002, cpu_share=0.7)
    model, x = Tiny().eval(), torch.randn(8, 16)
    plan = fxpipe.compile(model, ["cpu"] * 2, (x,), num_stages="auto").plan
    assert plan.runs_as_is and plan.record.reason.startswith("no pipeline is weighed on a busy machine")
    assert "had 70% of the time of its" in plan.record.reason and "measured 1.000 ms" in plan.record.reason
    assert "the machine was too busy to weigh pipelines" in str(plan)
    raced_as(monkeypatch, pipeline_s=0.001, model_s=0.002, cpu_share=0.95)    # cores free
    assert not fxpipe.compile(model, ["cpu"] * 2, (x,), num_stages="auto").plan.runs_as_is


def test_no_race_where_the_model_as_is_is_not_weighed(model_predicted_slow, monkeypatch):
    calls = raced_as(monkeypatch, pipeline_s=1.0, model_s=0.001)
    model, x = Tiny(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), num_stages=2)
    assert calls == [] and not pipe.plan.runs_as_is


def test_the_shortlist_races_the_next_best_predicted_and_keeps_the_one_measured_fastest(
        model_predicted_slow, monkeypatch):
    calls = raced_as(monkeypatch, pipeline_s=(0.004, 0.001, 0.003), model_s=0.002)
    monkeypatch.setattr(fxpipe.planning.build, "SHORTLIST_SLACK", 100.0)  # all runners-up
    torch.manual_seed(0)
    model, x = Tiny().eval(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), num_stages="auto", chunks="auto")
    [shortlist] = calls
    assert 2 <= len(shortlist) <= fxpipe.planning.build.SHORTLIST
    predicted = [p.record.predicted_step_s for p in shortlist]
    assert predicted[0] == min(predicted) and predicted == sorted(predicted)
    plan = pipe.plan
    assert plan.record.chosen.config == shortlist[1].record.chosen.config and not plan.runs_as_is
    assert "measured fastest, though" in plan.record.reason and "measured 1.000 ms" in plan.record.reason
    # Every one raced, the model as is last, predicted against measured; print shows both.
    assert [config for config, _, _ in plan.record.raced] == [
        *(p.record.chosen.config for p in shortlist), plan.record.considered[-1].config]
    assert [s for _, _, s in plan.record.raced] == [0.004, 0.001, 0.003][:len(shortlist)] + [0.002]
    assert "raced ms" in str(plan) and "1.000" in str(plan)
    assert_same_up_to_rounding(pipe(x), model(x))


@pytest.mark.parametrize("pipeline_s, as_is", [(0.004, True), (0.001, False)])
def test_training_races_train_steps_and_keeps_the_faster(model_predicted_slow, monkeypatch,
                                                          pipeline_s, as_is):
    calls = raced_as(monkeypatch, pipeline_s=pipeline_s, model_s=0.002)
    torch.manual_seed(0)
    model, x = Tiny().train(), torch.randn(8, 16)
    reference = copy.deepcopy(model)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), num_stages="auto", training=True)
    assert len(calls) == 1 and all(p.training for p in calls[0])
    assert pipe.plan.runs_as_is == as_is
    target = torch.randn(8, 16)
    loss = pipe.train_step(x, target, torch.nn.functional.mse_loss)
    expected = torch.nn.functional.mse_loss(reference(x), target)
    expected.backward()
    assert_same_training(pipe, reference, loss=(loss, expected))


def test_the_race_runs_both_without_side_effects_and_gives_each_ones_least_time():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)).train()
    x = torch.randn(8, 16)
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), num_stages=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    raced = fxpipe.planning.measure.race([plan], model, plan_recipe(model, x))
    assert 0 < raced.pipelines_s[0] and 0 < raced.model_s and 3 <= raced.rounds <= 5
    assert 0 < raced.cpu_share <= 1.5       # the CPU time of the model's threads, over theirs
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_race_stops_early_only_once_the_fastest_leads_every_other_by_the_margin():
    from fxpipe.planning.measure import DECIDED, _decided
    runs = lambda *least: [[(t, t), (2 * t, 2 * t)] for t in least]     # noqa: E731
    assert _decided(runs(0.8, 1.0, 1.2))                 # 20% ahead of the next
    assert _decided(runs(1.0, 0.8))                      # whichever leads: the model too
    assert not _decided(runs(1.0 - DECIDED / 2, 1.0, 2.0))    # the two fastest near
    assert not _decided(runs(0.95, 1.0))                 # 5%: more rounds may turn it


def test_a_training_race_runs_train_steps_without_side_effects():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 4)).train()
    x = torch.randn(8, 16)
    plans = [fxpipe.plan(model, ["cpu"] * 2, (x,), num_stages=2, chunks=c, training=True)
             for c in (1, 2)]
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    raced = fxpipe.planning.measure.race(plans, model, plan_recipe(model, x))
    assert len(raced.pipelines_s) == 2 and all(t > 0 for t in raced.pipelines_s)
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), state)


def plan_recipe(model, x):
    return fxpipe.planning.recipe.Recipe.of(model, (x,), None, fxpipe.planning.options.Options(["cpu"] * 2))
