"""Graphs too coarse to balance (issue 15 item 7): a module fx keeps whole gives way to export.

torch.fx keeps torch.nn's own modules whole; `nn.TransformerEncoder` then is one node holding
almost every parameter, and no split can balance 4 stages on it. Asked for more stages than
that graph can fill, capture falls back to torch.export, which records the encoder op by op,
and the plan says why.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.testing import assert_pipeline_matches
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.passes.errors import PartitionError
from fxpipe.passes.capture import trace


def encoder(dropout: float = 0.1) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=dropout, batch_first=True)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)


class Tagger(nn.Module):
    """An encoder between an input projection and a head: fx captures it as three nodes."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.encoder = encoder(dropout)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_one_stage_keeps_the_fx_graph_with_the_encoder_whole():
    gm = trace(Tagger().eval(), (_x(4, 5, 16),))
    assert gm.meta["capture"].method == "fx" and not gm.meta["capture"].reason
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == \
        ["embed", "encoder", "head"]


def test_an_encoder_holding_more_than_a_stages_share_gives_way_to_export():
    model, x = Tagger().eval(), _x(4, 5, 16)
    gm = trace(model, (x,), stages=2)
    capture = gm.meta["capture"]
    assert capture.method == "export"
    assert capture.reason == ("torch.fx kept 'encoder' (TransformerEncoder, 98% of the "
                              "parameters) whole, too coarse to balance 2 stages")
    assert "too coarse to balance 2 stages" in str(capture)
    torch.testing.assert_close(gm(x), model(x))


class WideInput(Tagger):
    """The encoder holds a fifth of the parameters: a wide input projection holds the rest."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4096, 32)


def test_a_graph_with_fewer_nodes_than_stages_gives_way_to_export_when_a_leaf_can_open():
    model, x = WideInput().eval(), _x(2, 3, 4096)
    assert trace(model, (x,), stages=3).meta["capture"].method == "fx"    # 3 nodes: enough
    gm = trace(model, (x,), stages=4)
    assert gm.meta["capture"].method == "export"
    assert gm.meta["capture"].reason == (
        "torch.fx kept 'encoder' (TransformerEncoder, 21% of the parameters) whole, and its "
        "graph has 3 computing nodes, too few for 4 stages")
    torch.testing.assert_close(gm(x), model(x))


def test_leaves_the_user_asked_for_stay_whole_however_big():
    gm = trace(Tagger().eval(), (_x(4, 5, 16),), stages=4, leaf_modules=["encoder"])
    assert gm.meta["capture"].method == "fx" and not gm.meta["capture"].reason
    gm = trace(Tagger().eval(), (_x(4, 5, 16),), stages=4, leaf_modules=[nn.TransformerEncoder])
    assert gm.meta["capture"].method == "fx"


def test_fx_only_capture_keeps_the_coarse_graph_and_the_partitioner_refuses_it():
    with pytest.raises(PartitionError, match="3 computing nodes, too few for 4 stages"):
        fxpipe.compile(Tagger().eval(), ["cpu"] * 4, (_x(4, 5, 16),), capture="fx")


class Hooked(Tagger):
    def __init__(self):
        super().__init__()
        self.head.register_forward_hook(lambda module, args, out: None)


def test_a_coarse_graph_stays_when_export_cannot_capture_the_model():
    gm = trace(Hooked().eval(), (_x(4, 5, 16),), stages=4)
    capture = gm.meta["capture"]
    assert capture.method == "fx"
    assert capture.reason.startswith(
        "torch.fx kept 'encoder' (TransformerEncoder, 98% of the parameters) whole, too coarse "
        "to balance 4 stages, and torch.export failed: it runs hooks once")


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("stages", [4, 8])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_an_encoder_inside_a_model_compiles_on_more_stages_than_fx_nodes(stages, training):
    torch.manual_seed(0)
    model, x = Tagger().train(training), _x(8, 5, 16)
    pipe = fxpipe.compile(model, ["cpu"] * stages, (x,), chunks=2, repeats=1)
    assert len(pipe.stages) == stages
    text = str(pipe.plan)
    assert (f"captured by export in {'train' if training else 'eval'} mode because torch.fx "
            f"kept 'encoder' (TransformerEncoder, 98% of the parameters) whole, too coarse to "
            f"balance {stages} stages") in text
    # no dropout and no batch statistics: the model run whole is the reference
    pipe(x).sum().backward()
    from_pipe = _grads(model)
    model.zero_grad()
    expected = model(x)
    expected.sum().backward()
    assert_same_up_to_rounding(pipe(x), expected)
    assert_same_up_to_rounding(from_pipe, _grads(model))


@pytest.mark.parametrize("stages", [4, 8])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_a_transformer_encoder_compiles_on_4_and_8_stages(stages, training):
    torch.manual_seed(0)
    model = encoder().train(training)
    pipe = assert_pipeline_matches(model, (_x(8, 5, 32),), devices=["cpu"] * stages,
                                   backward=True, repeats=1)
    assert len(pipe.stages) == stages
    assert "captured by export" in str(pipe.plan)


class Gated(nn.Module):
    """A block whose forward fx cannot follow (a branch on a value): fx+leaves keeps it whole."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        if x.sum() > 0:
            return self.b(self.a(x))
        return self.a(x)


class GatedTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gated()
        self.head = nn.Linear(32, 2)
        self.head.register_forward_hook(lambda module, args, out: None)

    def forward(self, x):
        return self.head(self.gate(x))


def test_the_reason_keeps_why_fx_needed_leaves_and_why_export_was_not_taken():
    model, x = GatedTagger().eval(), _x(4, 32)
    gm = trace(model, (x,), stages=2)
    capture = gm.meta["capture"]
    assert capture.method == "fx+leaves" and capture.leaves == ("head", "gate")
    assert capture.reason.startswith("torch.fx failed: TraceError: symbolically traced variables")
    assert ("; torch.fx kept 'gate' (Gated, 97% of the parameters) whole, too coarse to balance 2 "
            "stages, and torch.export failed: it runs hooks once") in capture.reason
    torch.testing.assert_close(gm(x), model(x))
