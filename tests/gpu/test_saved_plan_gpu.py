"""A plan saved on a GPU, loaded on other devices than it was planned for (skipped without
CUDA; the two-GPU test without two)."""

import pytest
import torch
from torch import nn

import fxpipe
from test_saved_plan import TiedEnds     # tests/ is on the path: its conftest.py lives there

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CLOSE = dict(rtol=1e-4, atol=1e-5)     # CPU and GPU kernels sum in other orders


class Filled(nn.Module):
    """An export graph names the example's device (`full_like(..., device=cuda:0)`)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.register_buffer("inv_freq", torch.rand(16) + 0.5, persistent=False)

    def forward(self, x):
        h = torch.relu(self.a(x)) * self.inv_freq
        return self.b(h * torch.full_like(h, 2.0, device=h.device))


def saved_on_cuda0(tmp_path):
    torch.manual_seed(0)
    model, x = Filled().eval().cuda(), torch.randn(6, 8, device="cuda:0")
    fxpipe.plan(model, ["cuda:0"] * 2, (x,), chunks=2, capture="export").save(tmp_path / "plan")
    with torch.no_grad():
        return tmp_path / "plan", x, model(x)


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cuda:0", "cpu"], ["cpu", "cuda:0"]])
def test_a_plan_saved_on_a_gpu_loads_on_the_devices_given(devices, tmp_path):
    path, x, expected = saved_on_cuda0(tmp_path)
    plan = fxpipe.load_plan(path, devices=devices)
    assert [str(s.device) for s in plan.stages] == devices
    for stage in plan.stages:
        assert all(t.device == stage.device for t in stage.module.state_dict().values())
        if stage.device.type == "cpu":
            assert "cuda" not in stage.module.code
    with torch.no_grad():
        out = fxpipe.Pipeline(plan)(x.to(devices[0]))
    torch.testing.assert_close(out.cpu(), expected.cpu(), **CLOSE)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_plan_saved_on_gpu_0_runs_on_gpu_1(tmp_path):
    path, x, expected = saved_on_cuda0(tmp_path)
    plan = fxpipe.load_plan(path, devices=["cuda:1", "cuda:1"])
    code = "".join(s.module.code for s in plan.stages)
    assert "device(type='cuda', index=0)" not in code
    assert "device(type='cuda', index=1)" in code
    with torch.no_grad():
        out = fxpipe.Pipeline(plan)(x.to("cuda:1"))
    assert out.device == torch.device("cuda:1")
    torch.testing.assert_close(out.cpu(), expected.cpu(), **CLOSE)


def test_stages_sharing_a_tied_weight_cannot_be_put_on_two_devices(tmp_path):
    torch.manual_seed(0)
    fxpipe.plan(TiedEnds(), ["cpu"] * 3, (torch.randint(0, 20, (8, 5)),),
                chunks=2).save(tmp_path / "plan")
    with pytest.raises(fxpipe.DeviceError, match="stages 0 and 2 .* share the tied 'emb.weight'"):
        fxpipe.load_plan(tmp_path / "plan", devices=["cpu", "cpu", "cuda:0"])
    with pytest.raises(fxpipe.DeviceError, match="stage 1 of the plan .* needs"):
        fxpipe.load_plan(tmp_path / "plan",
                         devices=["cpu", fxpipe.DeviceSpec("cuda:0", memory_bytes=1), "cpu"])
