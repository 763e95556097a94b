"""Errors that name the cause: a model that fails on its own example says so before any word
about capture, in Python and on the command line; whatever breaks inside a front-end is that
front-end's failure (the next is tried); a tensor default argument is an input like any other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.__main__ import main
from fxpipe.passes.capture import FX
from fxpipe.testing import assert_same_up_to_rounding, grads_of

B, D = 8, 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("example, torch_says", [
    (torch.randn(8, 31), "mat1 and mat2 shapes cannot be multiplied (8x31 and 32x16)"),
    (torch.randn(8, 32, dtype=torch.float64), "mat1 and mat2 must have the same dtype"),
], ids=["shape", "dtype"])
def test_a_model_that_fails_on_its_example_says_so_first_quoting_torch(example, torch_says):
    with pytest.raises(fxpipe.InputError) as error:
        fxpipe.compile(Net(), ["cpu"] * 2, (example,), chunks=2)
    first, *rest = str(error.value).splitlines()
    assert first.startswith(f"Net fails on its example inputs: RuntimeError: {torch_says}")
    assert "capture" not in str(error.value)
    assert any("test_example_errors.py" in line and "self.a(x)" in line for line in rest)
    assert rest[-1].strip().startswith("Fix: give example inputs the model runs on")


def test_the_command_line_says_the_model_fails_on_its_example(capsys):
    argv = ["plan", "torch.nn:Linear", "--kwargs", '{"in_features": 32, "out_features": 8}',
            "--input", "4x31", "--devices", "cpu,cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    first = err.strip().splitlines()[0]
    assert first.startswith("fxpipe plan: error: Linear fails on its example inputs: "
                            "RuntimeError: mat1 and mat2 shapes cannot be multiplied"), err
    assert "Traceback" not in err and "capture" not in err


def test_any_exception_inside_a_front_end_is_its_failure_and_the_next_is_tried(monkeypatch):
    def broken(model, request):
        raise NameError("name 'float32' is not defined")
    monkeypatch.setattr(FX, "capture", broken)
    model, x = Net(), torch.randn(8, 32)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    assert pipe.plan.capture.method == "export"
    assert "NameError" in pipe.plan.capture.reason
    assert_same_up_to_rounding(pipe(x), model(x))


def test_when_every_front_end_breaks_the_error_is_fxpipes_naming_each(monkeypatch):
    def broken(model, request):
        raise KeyError("a front-end's own bug")
    from fxpipe.passes.capture import EXPORT
    monkeypatch.setattr(FX, "capture", broken)
    monkeypatch.setattr(EXPORT, "capture", broken)
    with pytest.raises(fxpipe.TraceError, match="could not capture Net") as error:
        fxpipe.compile(Net(), ["cpu"] * 2, (torch.randn(8, 32),), chunks=2)
    assert "torch.fx: KeyError" in str(error.value)
    assert "torch.export: KeyError" in str(error.value)


class TensorDefault(nn.Module):
    """A second input defaulting to a tensor of the batch's shape, as torch pipelining's own
    test models write it (`def forward(self, x, y=torch.zeros(B, D))`)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, y=torch.zeros(B, D)):
        return self.b(torch.relu(self.a(x)) + y)


def test_a_tensor_default_argument_is_an_input_at_its_default_or_another_value():
    torch.manual_seed(0)
    model, x, other = TensorDefault(), torch.randn(B, D), torch.randn(B, D)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    assert pipe.plan.capture.method == "fx"
    assert_same_up_to_rounding(pipe(x), model(x))
    assert_same_up_to_rounding(pipe(x, y=other), model(x, y=other))
    assert_same_up_to_rounding(pipe(x, other), model(x, other))
    assert not torch.equal(model(x, y=other), model(x))


@pytest.mark.parametrize("y", ["default", "other"])
def test_a_tensor_default_argument_trains_as_the_model(y):
    torch.manual_seed(0)
    model, x, target = TensorDefault(), torch.randn(B, D), torch.randn(B, D)
    inputs = (x,) if y == "default" else (x, torch.randn(B, D))
    expected_loss = F.mse_loss(model(*inputs), target)
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    loss = pipe.train_step(inputs, target, F.mse_loss)
    assert_same_up_to_rounding(loss, expected_loss)
    assert_same_up_to_rounding(grads_of(pipe), expected)


def test_a_stage_failing_on_a_call_names_the_callers_inputs_and_a_fix():
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
    pipe = fxpipe.compile(model, ["cpu"] * 2, (torch.randn(8, 32),), chunks=2)
    with pytest.raises(fxpipe.StageError, match="stage 0 failed on micro-batch 0") as error:
        pipe(torch.randn(8, 31))
    message = str(error.value)
    assert "the call's inputs: input_1 (8, 31) float32, split into 2 micro-batches" in message
    assert "Fix: call the pipeline with inputs the model takes" in message
    assert error.value.stage == 0 and error.value.microbatch == 0


def test_a_capture_reason_stops_before_a_structure_it_cannot_close():
    from fxpipe.passes.capture.choose import _because
    dumped = ("torch.export: UserError: expected TreeSpec(tuple, None, [TreeSpec(dict, ['x'],\n"
              "  [*]), *])\n    Fix: ...")
    assert _because([dumped]) == "torch.export failed: UserError: expected TreeSpec (...)"
    assert _because(["torch.fx: NameError: name (a) is not defined\n  ..."]) == \
        "torch.fx failed: NameError: name (a) is not defined"


def test_a_gpu_that_does_not_exist_is_refused_saying_what_there_is():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(fxpipe.DeviceError) as error:
        fxpipe.plan(Net(), [f"cuda:{count}"], (torch.randn(8, 32),))
    message = str(error.value)
    if count:
        assert f"use one of cuda:0..cuda:{count - 1}, or 'cpu'" in message
    else:
        assert "(no CUDA device)" in message and "use 'cpu'" in message
        assert "one of those" not in message
