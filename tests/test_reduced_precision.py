"""Checks on a model that a GPU runs in reduced precision (TF32): the tolerance is the model's
own rounding, measured against float64, so rounding passes and a model mixing samples does not.

A CPU has no TF32: `Rounds` stands in for it, rounding its float32 results by an amount that
depends on the batch size (as a GPU's kernels do for other micro-batch sizes) and computing
float64 exactly, and the checks are told float32 is reduced (`_reduced_float32`), the CPU
standing for the GPU.
"""

import pytest
import torch
from torch import nn

import fxpipe
import fxpipe.checks
from fxpipe.checks import rounding_tolerance


class Rounds(nn.Module):
    """Float32 results off by 2**-10 times (batch size mod 5) of themselves; float64 exact."""

    def forward(self, y):
        if y.dtype != torch.float32:
            return y
        return y + y.detach() * 2.0 ** -10 * (y.shape[0] % 5)


class Net(nn.Module):
    def __init__(self, mixes=False):
        super().__init__()
        self.first, self.rounds, self.last = nn.Linear(16, 32), Rounds(), nn.Linear(32, 8)
        self.mixes = mixes

    def forward(self, x):
        y = self.rounds(torch.tanh(self.first(x)))
        if self.mixes:
            y = y - 0.5 * y.mean(0)        # every sample reads the others
        return self.last(y)


@pytest.fixture
def reduced(monkeypatch):
    monkeypatch.setattr(fxpipe.checks, "_reduced_float32", lambda tensors, gpu: True)


def test_the_tolerance_is_four_times_the_models_rounding_against_float64(reduced):
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(12, 16)
    tolerance = rounding_tolerance(model, (x,), {})
    exact = model.double()(x.double())
    model.float()
    error = ((model(x).double() - exact).abs().max() / exact.abs().max()).item()
    assert 2 * 2 ** -10 * 0.5 < error < 2 * 2 ** -10 * 1.5       # 12 % 5 = 2
    assert tolerance == pytest.approx(4 * error, rel=1e-6)


def test_no_reduced_precision_no_measured_tolerance():
    model, x = Net().eval(), torch.randn(12, 16)
    assert rounding_tolerance(model, (x,), {}) is None          # a CPU: float32 is float32


def test_rounding_alone_passes_the_checks_and_the_pipeline_equals_the_model(reduced):
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(12, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4)
    assert "checked against the model: yes" in str(pipe.plan)
    expected = torch.cat([model(part) for part in x.chunk(4)])
    torch.testing.assert_close(pipe(x), expected)


def test_without_the_measure_the_same_rounding_is_refused():
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(12, 16)
    with pytest.raises(fxpipe.BatchError, match="mixes samples across the batch"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4)


def test_a_model_mixing_samples_is_still_refused_where_float32_is_reduced(reduced):
    torch.manual_seed(0)
    model, x = Net(mixes=True).eval(), torch.randn(12, 16)
    with pytest.raises(fxpipe.BatchError, match="mixes samples across the batch"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4)
