import pytest
import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.errors import TraceError
from fxpipe.passes.trace import trace
from fxpipe.passes.user_code import describe_frame, user_frame


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


# ---- where it failed: fxpipe.passes.user_code ------------------------------------------------------

class SplitsWrongly(nn.Module):
    """torch's own Python raises, called from forward."""

    def forward(self, x):
        return torch.split(x, [1, 1])[0]


def test_user_frame_of_an_error_is_the_models_line_not_torchs():
    with pytest.raises(RuntimeError) as info:
        SplitsWrongly()(torch.randn(3, 4))
    frame = user_frame(info.value)
    assert frame.name == "forward" and frame.line == "return torch.split(x, [1, 1])[0]"
    assert describe_frame(frame) == (f'  File "{__file__}", line {frame.lineno}, in forward\n'
                                     f'    return torch.split(x, [1, 1])[0]')
    assert describe_frame(frame, "", one_line=True) == (
        f"at {__file__}:{frame.lineno}: return torch.split(x, [1, 1])[0]")


class Doubles(nn.Module):
    def forward(self, x):
        return x * 2


def test_user_frame_of_a_node_is_the_line_that_traced_it():
    tracer = fx.Tracer()
    tracer.record_stack_traces = True
    (mul,) = [n for n in tracer.trace(Doubles()).nodes if n.op == "call_function"]
    frame = user_frame(mul)
    assert (frame.filename, frame.name, frame.line) == (__file__, "forward", "return x * 2")
    unrecorded = fx.symbolic_trace(Doubles()).graph
    assert user_frame(next(n for n in unrecorded.nodes if n.op == "call_function")) is None


def test_user_frame_of_the_current_stack_is_the_caller():
    frame = user_frame()
    assert frame.name == "test_user_frame_of_the_current_stack_is_the_caller"
    assert frame.line == "frame = user_frame()"
