"""Capture keeps what the model does: grad-mode regions, the model's own output containers, the
caller's tensors untouched, and a terminal holding only fxpipe's message when a front-end fails."""

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.passes.capture import trace


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


def test_compile_refuses_a_forward_writing_its_input_and_leaves_the_callers_tensor():
    torch.manual_seed(0)
    model = WritesItsInput()
    x = torch.randn(6, 4)
    before = x.clone()
    with pytest.raises(fxpipe.TraceError, match=r"writes in place on its input 'x'(.|\n)*x\.mul_"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    torch.testing.assert_close(x, before, rtol=0, atol=0)


def test_trace_runs_the_model_and_the_graph_on_their_own_copies():
    model = WritesItsInput()
    x = torch.randn(6, 4)
    before = x.clone()
    gm = trace(model, (x,), capture="fx")
    torch.testing.assert_close(x, before, rtol=0, atol=0)
    assert gm.meta["capture"].method == "fx"


class Segmenter(nn.Module):
    """Returns an OrderedDict, as torchvision's segmentation models do."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 3)

    def forward(self, x):
        features = self.backbone(x).relu()
        result = OrderedDict()
        result["out"] = self.head(features)
        result["aux"] = self.aux(features)
        return result


def test_a_model_returning_an_ordered_dict_keeps_its_fx_graph_and_its_container():
    torch.manual_seed(0)
    model = Segmenter().eval()
    x = torch.randn(6, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=3)
    assert pipe.plan.capture.method == "fx"
    out = pipe(x)
    assert type(out) is OrderedDict and list(out) == ["out", "aux"]
    assert_same_up_to_rounding(out, model(x))


class BranchesOnValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x


def test_a_failed_export_prints_nothing_but_fxpipes_message(capfd):
    with pytest.raises(fxpipe.TraceError, match=r"torch\.export: .*data-dependent"):
        fxpipe.compile(BranchesOnValues(), ["cpu"], (torch.randn(4, 4),), capture="export")
    out, err = capfd.readouterr()
    assert out == "" and err == ""


class Distill(nn.Module):
    """A student trained against a frozen teacher: the teacher runs under no_grad."""

    def __init__(self, frozen=torch.no_grad):
        super().__init__()
        self.frozen = frozen
        self.teacher = nn.Linear(8, 8)
        self.student = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        with self.frozen():
            target = self.teacher(x).relu()
        return self.head(self.student(x).relu()) - target


FROZEN = [torch.no_grad, torch.inference_mode, lambda: torch.set_grad_enabled(False)]


def _grads(model):
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("capture, frozen", [
    ("fx", torch.no_grad), ("fx", torch.inference_mode), ("fx", FROZEN[2]),
    ("export", torch.no_grad), ("export", FROZEN[2])],
    ids=["fx-no_grad", "fx-inference_mode", "fx-set_grad_enabled", "export-no_grad",
         "export-set_grad_enabled"])
def test_a_frozen_teacher_gets_no_gradient_through_backward_of_the_output(capture, frozen):
    torch.manual_seed(0)
    model = Distill(frozen)
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=3, capture=capture, num_stages=3)
    pipe(x).sum().backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    assert got["teacher.weight"] is None and got["teacher.bias"] is None
    assert_same_up_to_rounding(got, _grads(model))


def test_export_refuses_inference_mode_in_forward_naming_the_line():
    model = Distill(torch.inference_mode)
    with pytest.raises(fxpipe.TraceError, match=r"(?s)torch\.inference_mode\(\) \(at .*"
                       r"target = self\.teacher\(x\)\.relu\(\)\).*Use torch\.no_grad\(\)"):
        fxpipe.compile(model, ["cpu"], (torch.randn(6, 8),), capture="export")


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_frozen_teacher_gets_no_gradient_through_train_step(capture):
    torch.manual_seed(0)
    model = Distill()
    x, target = torch.randn(6, 8), torch.randn(6, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=3, capture=capture, num_stages=3)
    loss = pipe.train_step(x, target, F.mse_loss)
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    expected = F.mse_loss(model(x), target)
    expected.backward()
    assert_same_up_to_rounding(loss, expected)
    assert got["teacher.weight"] is None
    assert_same_up_to_rounding(got, _grads(model))


def test_no_grad_region_is_written_in_each_stage_that_runs_part_of_it():
    torch.manual_seed(0)
    model = Distill()
    pipe = fxpipe.compile(model, ["cpu"] * 3, (torch.randn(6, 8),), capture="fx", num_stages=3)
    codes = [stage.code for stage in pipe.stages]
    teacher = [code for code in codes if "self.teacher(" in code]
    assert teacher and all("torch._C._set_grad_enabled(False)" in code for code in teacher)
    for code in codes:     # every region closes before its stage returns
        assert code.count("_set_grad_enabled(False)") == code.count("_set_grad_enabled(grad_enabled")


class GradInsideNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.enable_grad():
            return self.lin(x)


def test_enable_grad_in_forward_computes_with_grad_under_the_callers_no_grad():
    model = GradInsideNoGrad()
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, ["cpu"], (x,), capture="fx")
    with torch.no_grad():
        out, expected = pipe(x), model(x)
    assert expected.requires_grad and out.requires_grad
    assert_same_up_to_rounding(out, expected)


class FrozenEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    @torch.no_grad()
    def forward(self, x):
        return self.lin(x).tanh()


class Probe(nn.Module):
    """A trainable probe on a frozen encoder whose forward is decorated with @torch.no_grad()."""

    def __init__(self):
        super().__init__()
        self.encoder = FrozenEncoder()
        self.probe = nn.Linear(8, 2)

    def forward(self, x):
        return self.probe(self.encoder(x))


def test_a_forward_decorated_with_no_grad_stays_frozen():
    torch.manual_seed(0)
    model = Probe()
    x, target = torch.randn(6, 8), torch.randn(6, 2)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, capture="fx")
    pipe.train_step(x, target, F.mse_loss)
    assert model.encoder.lin.weight.grad is None and model.probe.weight.grad is not None


def test_outputs_compare_within_a_tolerance_scaled_to_their_magnitude():
    from fxpipe.passes.compare import difference
    big = torch.tensor([1e12, 3.0, -2e11])
    assert difference(big * (1 + 3e-7), big, None) == ""
    assert "differs by up to" in difference(big * (1 + 1e-4), big, None)
    assert difference(OrderedDict(out=big), {"out": big}, None) == ""
    assert "structure" in difference({"aux": big}, {"out": big}, None)


class AddsToItsInput(nn.Module):
    """`x += 1` on an input: fx records an add, so only running the model shows the write."""

    def forward(self, x):
        x += 1
        return x * 2


@pytest.mark.parametrize("capture", ["auto", "fx"])
def test_a_forward_adding_into_its_input_is_refused_by_name(capture):
    x = torch.randn(6, 4)
    before = x.clone()
    with pytest.raises(fxpipe.TraceError, match=r"writes in place on its input 'x'"):
        fxpipe.compile(AddsToItsInput(), ["cpu"] * 2, (x,), chunks=2, capture=capture)
    torch.testing.assert_close(x, before, rtol=0, atol=0)


class CachesASetting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._mode = None

    def forward(self, x):
        self._mode = "seen"          # a setting cached on first use: undone, not refused
        return self.lin(x).relu()


def test_compile_leaves_the_models_plain_attributes_as_it_found_them():
    model = CachesASetting()
    fxpipe.compile(model, ["cpu"] * 2, (torch.randn(6, 4),), chunks=2)
    assert model._mode is None
