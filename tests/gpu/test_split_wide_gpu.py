"""A head split along its output features on GPU stages (skipped without CUDA; two-GPU tests
under two GPUs): the parts read the weight's one copy on their device, or receive it (or their
slice) from its home stage on another GPU; loss and gradients equal the model's."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 512)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize("devices", [["cuda:0"] * 3,
                                     pytest.param(["cuda:0", "cuda:1", "cuda:1"], marks=two_gpus),
                                     pytest.param(["cuda:0", "cuda:1"], marks=two_gpus)])
def test_a_split_head_on_gpus_trains_as_the_model(scripted_costs, devices):
    scripted_costs["head"] = 40.0
    torch.manual_seed(0)
    model, x = Head().train(), torch.randn(8, 32)
    target = torch.randn(8, 512)
    reference = copy.deepcopy(model)
    F.mse_loss(reference(x), target).backward()
    pipe = fxpipe.compile(model, devices, (x,), chunks=2)
    assert dict(pipe.plan.chosen.split)["head"] >= 2
    torch.testing.assert_close(pipe(x).cpu(), reference(x), rtol=1e-4, atol=1e-5)
    loss = pipe.train_step(x, target, F.mse_loss)
    torch.testing.assert_close(loss.cpu(), F.mse_loss(reference(x), target), rtol=1e-4,
                               atol=1e-5)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), reference.get_parameter(name).grad,
                                   rtol=1e-4, atol=1e-5)
    assert set(pipe.state_dict()) == set(reference.state_dict())
