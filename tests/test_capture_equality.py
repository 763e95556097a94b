"""Capture keeps what the model does: grad-mode regions, the model's own output containers, the
caller's tensors untouched, and a terminal holding only fxpipe's message when a front-end fails."""

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from passes.trace import trace


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


def test_compile_leaves_the_callers_tensor_alone_when_forward_writes_its_input():
    torch.manual_seed(0)
    model = WritesItsInput()
    x = torch.randn(6, 4)
    before = x.clone()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    torch.testing.assert_close(x, before, rtol=0, atol=0)
    torch.testing.assert_close(pipe(x), model(before.clone()))


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
    torch.testing.assert_close(out, model(x))


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
