"""Compile on GPUs: the model's tensors stay where they are, the pipeline equals the model.

Skipped without CUDA (two-GPU tests under two GPUs). The model is built on the CPU, so every
stage holds copies of its tensors placed on its GPU.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_training

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


class Net(nn.Module):
    def __init__(self, width=256, depth=6):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width),
                                                    nn.GELU()) for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.layers(x))


def state(model):
    return {name: (t, t.detach().clone(), t.device)
            for name, t in [*model.named_parameters(), *model.named_buffers()]}


def assert_untouched(model, before):
    after = dict([*model.named_parameters(), *model.named_buffers()])
    for name, (tensor, value, device) in before.items():
        assert after[name] is tensor and tensor.device == device, name
        torch.testing.assert_close(tensor.detach(), value, rtol=0, atol=0)


def compiled_on(devices, training=False, **options):
    torch.manual_seed(0)
    model, x = Net().train(training), torch.randn(64, 256)
    before = state(model)
    pipe = fxpipe.compile(model, devices, (x,), chunks=4, **options)      # verified
    assert_untouched(model, before)
    return model, x, pipe


@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cuda:0"],
                                     pytest.param(["cuda:0", "cuda:1"], marks=two_gpus)])
def test_a_cpu_model_compiled_onto_gpus_keeps_its_tensors_and_the_pipeline_equals_it(devices):
    model, x, pipe = compiled_on(devices)
    for stage in pipe.stage_info:
        assert all(t.device == stage.device for t in stage.module.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(pipe(x.cuda()).cpu(), model(x), rtol=1e-4, atol=1e-5)
    fresh = Net()
    fresh.load_state_dict(pipe.state_dict())          # the pipeline's names are the model's
    torch.testing.assert_close(fresh.state_dict(), model.state_dict())


@two_gpus
def test_two_gpu_train_step_gradients_equal_the_models():
    model, x, pipe = compiled_on(["cuda:0", "cuda:1"], training=True)
    target = torch.randn(64, 10)
    loss = pipe.train_step(x.cuda(0), target.cuda(1), F.mse_loss)
    expected = F.mse_loss(model(x), target)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected, rtol=1e-4, atol=1e-5)
    held = dict(pipe.named_parameters())
    for name, p in model.named_parameters():
        assert held[name] is not p and held[name].device.type == "cuda"
    assert_same_training(pipe, model, rtol=1e-3, atol=1e-5)


@two_gpus
def test_switching_modes_after_training_on_two_gpus_keeps_what_was_trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.1), nn.ReLU(), nn.Linear(64, 8)).train()
    x = torch.randn(16, 32)
    pipe = fxpipe.compile(model, ["cuda:0", "cuda:1"], (x,), chunks=2, capture="export")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.train_step(x.cuda(0), torch.randn(16, 8).cuda(1), F.mse_loss)
    optimizer.step()
    before = state(model)
    pipe.eval()                      # captured again in eval mode, checked, trained values kept
    assert_untouched(model, before)
    trained = copy.deepcopy(model).eval()
    trained.load_state_dict(pipe.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(pipe(x.cuda(0)).cpu(), trained(x), rtol=1e-4, atol=1e-5)


@two_gpus
def test_the_calibration_of_two_gpus_agrees():
    # Each GPU measured and synchronised as itself: cuda:1 is not timed by its launches alone.
    times = []
    for device in ("cuda:0", "cuda:1"):
        _, _, pipe = compiled_on([device], num_stages=1, verify=False)
        times.append(pipe.plan.partition.stages[0].compute_s)
    assert max(times) <= 2 * min(times), times


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Conv2d(c, 32, 3, padding=1), nn.ReLU())
                                    for c in (3, 32, 32, 32)])
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


@pytest.mark.parametrize("where", ["cuda:0", "cpu"])
def test_a_float32_model_the_gpu_runs_in_tf32_compiles_and_equals_its_microbatches(where):
    """cuDNN runs float32 convolutions in TF32 by default: micro-batches (and a GPU against the
    model's CPU) round otherwise than the whole batch, by the model's own rounding, which the
    checks measure against float64 instead of refusing the model as mixing samples."""
    torch.manual_seed(0)
    model, x = ConvNet().to(where).eval(), torch.randn(32, 3, 16, 16, device=where)
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        pipe = fxpipe.compile(model, ["cuda:0"] * 2, (x,), chunks=4)
        with torch.no_grad():
            got = pipe(x.cuda()).to(where)
            expected = torch.cat([model(part) for part in x.chunk(4)])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
    assert "checked against the model: yes" in str(pipe.plan)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-3)
