"""fxpipe.weights on GPUs: tensors read straight onto the asked GPU, Init drawn there.

Skipped without CUDA (two-GPU tests under two GPUs).
"""

import pytest
import torch
from torch import nn

from fxpipe.weights import Init, open_weights, save_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def make():
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))


def meta_like():
    with torch.device("meta"):
        model = make()
    return model, dict(model.state_dict(keep_vars=True))


@pytest.mark.parametrize("device", ["cuda", pytest.param("cuda:1", marks=two_gpus)])
def test_a_checkpoint_is_read_onto_the_gpu_asked(device, tmp_path):
    torch.manual_seed(0)
    state = make().state_dict()
    save_weights(state, tmp_path, max_shard_bytes=200)
    got = open_weights(tmp_path).read(meta_like()[1], device)
    expected = torch.device(device)
    if expected.index is None:
        expected = torch.device("cuda", torch.cuda.current_device())
    for name, tensor in state.items():
        assert got[name].device == expected
        torch.testing.assert_close(got[name].cpu(), tensor, rtol=0, atol=0)


def test_init_on_a_gpu_is_deterministic_and_leaves_its_generator_alone():
    model, like = meta_like()
    torch.cuda.manual_seed(5)
    expected = torch.rand(3, device="cuda")
    torch.cuda.manual_seed(5)
    first = Init(model, seed=1).read(like, "cuda")
    torch.testing.assert_close(torch.rand(3, device="cuda"), expected)
    again = Init(model, seed=1).read({n: like[n] for n in reversed(list(like))}, "cuda")
    for name in like:
        assert first[name].is_cuda
        torch.testing.assert_close(first[name], again[name], rtol=0, atol=0)
