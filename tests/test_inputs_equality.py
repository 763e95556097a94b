"""Inputs, hooks and side effects: the pipeline equals the model, or compile or the call says why.

Issue 14's items 3 (export-captured non-tensor inputs) and 11 (hooks and Python side effects in
forward), and `batch_dims` with torch.export.
"""

import re

import pytest
import torch
from torch import nn

import fxpipe


# ---- item 3: non-tensor inputs of an exported graph --------------------------------------

class Options(nn.Module):
    """A forward whose Python-level options change what it computes."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.body = nn.Linear(8, 8)

    def forward(self, x, flag: bool, steps: int = 2, temperature: float = 1.0):
        h = self.inp(x)
        if flag:
            h = h.relu()
        for _ in range(steps):
            h = self.body(h).tanh()
        return h / temperature


@pytest.fixture(scope="module")
def options_pipe():
    torch.manual_seed(0)
    model = Options().eval()
    pipe = fxpipe.compile(model, ["cpu"] * 2, example_inputs=(torch.randn(8, 8), True),
                          example_kwargs={"steps": 3, "temperature": 0.5}, capture="export",
                          chunks=2)
    return model, pipe


def test_export_runs_the_captured_values(options_pipe):
    model, pipe = options_pipe
    x = torch.randn(8, 8)
    torch.testing.assert_close(pipe(x, True, steps=3, temperature=0.5),
                               model(x, True, steps=3, temperature=0.5))


@pytest.mark.parametrize("args, kwargs, name, shown", [
    ((False,), {"steps": 3, "temperature": 0.5}, "flag", "False"),
    ((1,), {"steps": 3, "temperature": 0.5}, "flag", "1"),
    ((True,), {"steps": 1, "temperature": 0.5}, "steps", "1"),
    ((True,), {"steps": 3, "temperature": 2.0}, "temperature", "2.0"),
    ((torch.tensor(True),), {"steps": 3, "temperature": 0.5}, "flag", "a tensor of shape ()"),
])
def test_export_refuses_another_non_tensor_input(options_pipe, args, kwargs, name, shown):
    _, pipe = options_pipe
    captured = {"flag": True, "steps": 3, "temperature": 0.5}[name]
    with pytest.raises(fxpipe.InputError,
                       match=rf"input '{name}' is {re.escape(shown)}, but the graph was exported with "
                             rf"{name}={captured!r}.*one pipeline per value"):
        pipe(torch.randn(8, 8), *args, **kwargs)


# ---- batch_dims with torch.export --------------------------------------------------------

class TimeFirst(nn.Module):
    """Inputs shaped (time, batch, features): a running sum over time, batch along dimension 1."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.inp(x).tanh().cumsum(0))


def test_export_frees_the_batch_dimension_given():
    torch.manual_seed(0)
    model = TimeFirst().eval()
    x = torch.randn(5, 8, 6)
    pipe = fxpipe.compile(model, ["cpu"] * 2, example_inputs=(x,), capture="export",
                          batch_dims=1, chunks=4)
    torch.testing.assert_close(pipe(x), model(x))
    y = torch.randn(5, 12, 6)           # another batch size, split along dimension 1 too
    torch.testing.assert_close(pipe(y), model(y))
