"""The front every run shares (`fxpipe.runtime.front`): a batch refused before it runs draws
nothing from the caller's generator, so a failed call or step leaves the caller's random stream
where it was; the run that follows draws as if the refused one never happened."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe import BatchError


@pytest.fixture(scope="module")
def pipe():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    with fxpipe.compile(model, ["cpu"] * 2, (torch.randn(8, 4),), chunks=4) as pipe:
        yield pipe


# Inputs made without drawing: only the run's own draws count.
REFUSED = {
    "a call of an empty batch": lambda pipe: pipe(torch.ones(0, 4)),
    "a step whose target has other rows": lambda pipe: pipe.train_step(
        torch.ones(6, 4), torch.ones(5, 2), F.mse_loss),
    "a step of an empty batch": lambda pipe: pipe.train_step(
        torch.ones(0, 4), torch.ones(0, 2), F.mse_loss),
}


@pytest.mark.parametrize("refused", REFUSED.values(), ids=REFUSED.keys())
def test_a_batch_refused_before_it_runs_draws_nothing_from_the_callers_generator(pipe, refused):
    x = torch.randn(6, 4)
    torch.manual_seed(1)
    expected = pipe(x)          # with dropout: what it draws decides the output
    torch.manual_seed(1)
    with pytest.raises(BatchError):
        refused(pipe)
    torch.testing.assert_close(pipe(x), expected)
