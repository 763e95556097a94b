import pytest
import torch
from torch import nn

from passes.errors import TraceError
from passes.trace import trace


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:          # fx cannot follow control flow on a tensor's value
            return x * 2
        return x - 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gate = DataDependent()

    def forward(self, x, scale=None):
        y = self.gate(self.lin(x))
        return y * scale if scale is not None else y


class Hopeless(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


def test_plain_fx_capture_reproduces_the_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    gm = trace(model, (x,))
    assert gm.meta["capture"].method == "fx"
    torch.testing.assert_close(gm(x), model(x))


def test_submodule_that_breaks_fx_becomes_a_leaf_automatically():
    model, x = Net(), torch.randn(3, 4)
    gm = trace(model, (x,))
    capture = gm.meta["capture"]
    assert capture.method == "fx+leaves" and capture.leaves == ("gate",)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["lin", "gate"]
    torch.testing.assert_close(gm(x), model(x))


def test_explicit_leaf_modules_stay_whole():
    gm = trace(Net(), (torch.randn(2, 4),), leaf_modules=["gate"])
    assert gm.meta["capture"].method == "fx"
    assert "gate" in [n.target for n in gm.graph.nodes if n.op == "call_module"]


def test_inputs_missing_from_the_example_are_traced_at_their_default():
    model, x = Net(), torch.randn(2, 4)
    gm = trace(model, (x,), leaf_modules=[DataDependent])
    (scale,) = [n for n in gm.graph.nodes if n.op == "placeholder" and n.target != "x"]
    # `y * scale` was not traced: scale stayed None, and fx only checks that it is
    assert [u.target.__name__ for u in scale.users] == ["_assert_is_none"]
    torch.testing.assert_close(gm(x), model(x))


def test_untraceable_model_error_names_the_source_line_and_the_fix():
    with pytest.raises(TraceError) as info:
        trace(Hopeless(), (torch.randn(2, 3),))
    message = str(info.value)
    assert "test_trace.py" in message and "if x.sum() > 0:" in message
    assert "leaf_modules" in message and "Hopeless" in message


def test_fx_only_capture_does_not_fall_back():
    with pytest.raises(TraceError, match="torch.fx"):
        trace(Net(), (torch.randn(2, 4),), capture="fx")


def test_unknown_capture_mode_is_refused():
    with pytest.raises(TraceError, match="capture mode"):
        trace(Net(), (torch.randn(2, 4),), capture="magic")


def test_checking_the_graph_leaves_batchnorm_statistics_untouched():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    before = model[1].running_mean.clone()
    trace(model, (torch.randn(8, 4),))
    torch.testing.assert_close(model[1].running_mean, before)
