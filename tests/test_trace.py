import json
import pickle

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxpipe
from fxpipe.passes.errors import TraceError
from fxpipe.passes.capture import (EXPORT, FX, FX_LEAVES, Capture, CaptureFailed, Method, Request,
                                   trace)
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
    assert gm.meta["capture"].method is Method.FX
    torch.testing.assert_close(gm(x), model(x))


def test_submodule_that_breaks_fx_becomes_a_leaf_automatically():
    model, x = Net(), torch.randn(3, 4)
    gm = trace(model, (x,))
    capture = gm.meta["capture"]
    assert capture.method is Method.FX_LEAVES and capture.leaves == ("gate",)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["lin", "gate"]
    torch.testing.assert_close(gm(x), model(x))


def test_explicit_leaf_modules_stay_whole():
    gm = trace(Net(), (torch.randn(2, 4),), leaf_modules=["gate"])
    assert gm.meta["capture"].method is Method.FX
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


# ---- the front-ends' protocol and the method they are recorded by --------------------------------

def test_each_front_end_returns_a_captured_graph_or_raises_capture_failed_naming_the_line():
    x = torch.randn(2, 4)
    for front_end in (FX, FX_LEAVES, EXPORT):
        model = nn.Linear(4, 4)
        captured = front_end.capture(model, Request((x,), {}))
        torch.testing.assert_close(captured.gm(x), model(x))
        assert "signature" in captured.gm.meta
        assert captured.training is (True if front_end is EXPORT else None)
        with pytest.raises(CaptureFailed) as failure:
            front_end.capture(Hopeless(), Request((x,), {}))
        assert "if x.sum() > 0:" in failure.value.reason and failure.value.culprit is None


def test_the_method_is_an_enum_plans_print_and_save_by_its_name(tmp_path):
    assert [str(m) for m in Method] == ["fx", "fx+leaves", "export"]
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    plan = fxpipe.plan(model, ["cpu"] * 2, (torch.randn(4, 4),), chunks=2)
    assert plan.capture.method is Method.FX and "captured by fx" in str(plan)
    plan.save(tmp_path / "plan")
    saved = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert saved["capture"]["method"] == "fx"
    assert fxpipe.load_plan(tmp_path / "plan").capture.method is Method.FX


def test_a_capture_pickled_with_the_methods_name_under_the_old_module_loads_as_the_member():
    old = Capture(Method.FX_LEAVES, ("gate",))
    object.__setattr__(old, "method", "fx+leaves")    # as plans saved before Method hold it
    data = pickle.dumps(old, protocol=0)
    data = data.replace(b"fxpipe.passes.capture.frontend\n", b"fxpipe.passes.trace\n")
    assert b"fxpipe.passes.trace\nCapture" in data and b"fx+leaves" in data
    loaded = pickle.loads(data)
    assert loaded.method is Method.FX_LEAVES and loaded == Capture(Method.FX_LEAVES, ("gate",))
    assert str(loaded) == "fx+leaves (kept whole: gate)"
