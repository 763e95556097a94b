"""Each misuse raises the FxpipeError subclass that names its kind, so a caller can catch that
kind alone (and catching FxpipeError still catches all)."""

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.runtime.schedules import timetable_for


def two_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(8, 8)


@pytest.fixture(scope="module")
def pipe():
    model, x = two_layers()
    return fxpipe.compile(model, ["cpu", "cpu"], (x,), num_stages=2, chunks=2)


@pytest.mark.parametrize("option, value, error", [
    ("schedule", "zigzag", fxpipe.ScheduleError),
    ("verify_tolerance", -1, fxpipe.VerificationError),
    ("recompute", "sometimes", fxpipe.CostError),
    ("optimizer", "lion-ish", fxpipe.CostError),
])
def test_a_bad_option_value_raises_the_subclass_of_what_it_sets(option, value, error):
    model, x = two_layers()
    with pytest.raises(error, match=f"{option}|schedule"):
        fxpipe.plan(model, ["cpu", "cpu"], (x,), **{option: value})


def test_an_unknown_schedule_is_a_schedule_error():
    with pytest.raises(fxpipe.ScheduleError, match="unknown schedule 'zigzag'"):
        timetable_for("zigzag", 2, 2, backward=False)


def test_a_loss_fn_returning_a_vector_is_a_loss_error_in_the_last_stage(pipe):
    _, x = two_layers()
    with pytest.raises(fxpipe.StageError, match="LossError: loss_fn must return") as failed:
        pipe.train_step(x, torch.randn(8, 4), lambda out, t: F.mse_loss(out, t, reduction="none"))
    assert isinstance(failed.value.__cause__, fxpipe.LossError)


def test_an_unknown_reduction_is_a_loss_error(pipe):
    _, x = two_layers()
    with pytest.raises(fxpipe.LossError, match="reduction='avg'"):
        pipe.train_step(x, torch.randn(8, 4), F.mse_loss, reduction="avg")


def test_a_target_with_other_rows_than_the_inputs_is_a_batch_error(pipe):
    _, x = two_layers()
    with pytest.raises(fxpipe.BatchError, match="the target has 6 rows but the inputs have 8"):
        pipe.train_step(x, torch.randn(6, 4), F.mse_loss)


def test_explain_on_a_loaded_plan_is_a_cost_error(pipe, tmp_path):
    pipe.plan.save(tmp_path / "plan")
    loaded = fxpipe.Pipeline(fxpipe.load_plan(tmp_path / "plan"))
    with pytest.raises(fxpipe.CostError, match="explain\\(\\) needs the costed graph"):
        loaded.explain()


def test_pickling_a_pipeline_is_a_plan_file_error_and_moving_it_a_device_error(pipe):
    with pytest.raises(fxpipe.PlanFileError, match="cannot be pickled"):
        pickle.dumps(pipe)
    with pytest.raises(fxpipe.DeviceError, match="places each stage on its own device"):
        pipe.to("cpu")
