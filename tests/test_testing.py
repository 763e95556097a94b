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
    monkeypatch.setattr(fxpipe.planning.prepare, "split_stages", sabotage_last_stage)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    with pytest.raises(AssertionError, match=r"stage 2 is the first whose values differ"):
        assert_pipeline_matches(model, (torch.randn(6, 4),), devices=["cpu"] * 3)


def test_shrinking_finds_a_small_model_that_breaks_a_pass(monkeypatch):
    monkeypatch.setattr(fxpipe.planning.prepare, "split_stages", sabotage_last_stage)

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


# ---- assert_same_up_to_rounding: rounding passes, a wrong gradient does not ------------------

def amd_like_gradients():
    """The gradients of tests/test_recompute.py's Chain after `out.sum().backward()` as an AMD
    EPYC computed them on 2 stages and on 1: weights of up to 8, a bias right before a
    BatchNorm (zero in exact arithmetic) of 7e-6 on one and 1.1e-5 more on the other."""
    torch.manual_seed(0)
    weight = torch.randn(32, 256) * 3
    bias = torch.randn(32) * 3e-6
    one = {"layers.5.weight": weight, "layers.5.bias": bias}
    two = {"layers.5.weight": weight * (1 + 2 * torch.finfo(torch.float32).eps),
           "layers.5.bias": bias + 1.1e-5}
    return two, one


def test_rounding_of_a_gradient_that_cancels_passes_where_a_fixed_atol_fails():
    from fxpipe.testing import assert_same_up_to_rounding
    two, one = amd_like_gradients()
    assert_same_up_to_rounding(two, one)
    with pytest.raises(AssertionError):           # what the test compared it with before
        torch.testing.assert_close(two["layers.5.bias"], one["layers.5.bias"])


@pytest.mark.parametrize("bug", ["a micro-batch lost", "1% off", "another parameter's",
                                 "a bias of normal size"])
def test_a_wrong_gradient_of_normal_size_fails(bug):
    from fxpipe.testing import assert_same_up_to_rounding
    two, one = amd_like_gradients()
    weight = one["layers.5.weight"]
    wrong = {"a micro-batch lost": {**two, "layers.5.weight": weight * 0.75},
             "1% off": {**two, "layers.5.weight": weight * 1.01},
             "another parameter's": {**two, "layers.5.weight": weight.flip(0)},
             "a bias of normal size": {**two, "layers.5.bias": torch.full((32,), 0.01)}}[bug]
    with pytest.raises(AssertionError, match=r"gradient 'layers\.5\.(weight|bias)' differs by"):
        assert_same_up_to_rounding(wrong, one, what="gradient")


def test_structure_nans_and_integers_are_compared_exactly():
    from fxpipe.testing import assert_same_up_to_rounding
    x = torch.tensor([1.0, float("nan"), float("inf")])
    assert_same_up_to_rounding({"x": x, "n": torch.tensor(3)},
                               {"x": x.clone(), "n": torch.tensor(3)})
    for actual, expected, message in [
            ({"x": x}, {"y": x}, "structure differs"),
            (torch.tensor([1.0, 0.0, float("inf")]), x, "NaN in other places"),
            (torch.tensor([1.0, float("nan"), -float("inf")]), x, "infinities"),
            (torch.tensor(4), torch.tensor(3), "differs in 1 of 1"),
            (torch.zeros(2), torch.zeros(3), "shape"),
            ({"g": None}, {"g": torch.zeros(1)}, "NoneType instead of a Tensor")]:
        with pytest.raises(AssertionError, match=message):
            assert_same_up_to_rounding(actual, expected)


def test_the_scale_is_the_whole_sets_or_the_one_given():
    from fxpipe.testing import assert_same_up_to_rounding
    small, big = torch.tensor([1e-3]), torch.tensor([100.0])
    nudged = small + 1e-6                             # 1e-3 of the small, 1e-8 of the big
    assert_same_up_to_rounding({"a": nudged, "b": big}, {"a": small, "b": big})
    with pytest.raises(AssertionError):
        assert_same_up_to_rounding(nudged, small)
    assert_same_up_to_rounding(nudged, small, scale=100.0)


# ---- assert_same_training: loss, gradients and buffers of a step -----------------------------

def stepped(model, x, bug=""):
    """`model` after one mean-squared step on `x` (BatchNorm in training mode), `bug` spoiling
    one part of what the step left; its loss."""
    loss = model(x).square().mean()
    loss.backward()
    with torch.no_grad():
        if bug == "gradient":
            model[0].weight.grad[0, 0] += 0.01
        if bug == "no gradient":
            model[0].bias.grad = None
        if bug == "buffer":
            model[1].running_mean[0] += 0.01
    return loss.detach() + (0.01 if bug == "loss" else 0.0)


@pytest.mark.parametrize("tolerance", [{}, {"rtol": 1e-4, "atol": 1e-5}],
                         ids=["rounding", "assert_close"])
@pytest.mark.parametrize("bug", ["loss", "gradient", "no gradient", "buffer"])
def test_assert_same_training_compares_the_loss_every_gradient_and_every_buffer(bug, tolerance):
    import copy
    from fxpipe.testing import assert_same_training
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    twin, other = (copy.deepcopy(model) for _ in range(2))
    x = torch.randn(6, 4)
    loss, same = stepped(model, x), stepped(twin, x)
    assert_same_training(twin, model, loss=(same, loss), buffers=True, **tolerance)
    wrong = stepped(other, x, bug)
    with pytest.raises(AssertionError, match=bug.split()[-1]):
        assert_same_training(other, model, loss=(wrong, loss), buffers=True, **tolerance)
    if bug == "buffer":                   # buffers are compared only where asked
        assert_same_training(other, model, loss=(wrong, loss), **tolerance)
