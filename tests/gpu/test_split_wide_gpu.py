"""A head split along its output features on GPU stages (skipped without CUDA; two-GPU tests
under two GPUs): the parts read the weight's one copy on their device, or receive it (or their
slice) from its home stage on another GPU; loss and gradients equal the model's."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.testing import assert_same_training
from nets import Head

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.parametrize("devices", [["cuda:0"] * 3,
                                     pytest.param(["cuda:0", "cuda:1", "cuda:1"], marks=two_gpus),
                                     pytest.param(["cuda:0", "cuda:1"], marks=two_gpus)])
def test_a_split_head_on_gpus_trains_as_the_model(scripted_costs, devices):
    scripted_costs["head"] = 40.0
    torch.manual_seed(0)
    model, x = Head(32, 64, 512).train(), torch.randn(8, 32)
    target = torch.randn(8, 512)
    reference = copy.deepcopy(model)
    F.mse_loss(reference(x), target).backward()
    pipe = fxpipe.compile(model, devices, (x,), chunks=2)
    assert dict(pipe.plan.record.chosen.split)["head"] >= 2
    torch.testing.assert_close(pipe(x).cpu(), reference(x), rtol=1e-4, atol=1e-5)
    loss = pipe.train_step(x, target, F.mse_loss)
    assert_same_training(pipe, reference, loss=(loss, F.mse_loss(reference(x), target)),
                         rtol=1e-4, atol=1e-5)
    assert set(pipe.state_dict()) == set(reference.state_dict())
