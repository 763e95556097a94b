"""Capture through torch.export, and export graphs through every pass after it."""

from __future__ import annotations

import copy
from collections import namedtuple

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxpipe
from fxpipe.plans.plan_data import stage_modules
from fxpipe.testing import assert_pipeline_matches
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding
from fxpipe.passes.annotate_costs import annotate_costs
from fxpipe.passes.codegen import place, split_stages
from fxpipe.passes.errors import InputError, TraceError
from fxpipe.passes.functionalize import functionalize
from fxpipe.passes.signature import signature_of
from fxpipe.passes.capture import trace


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(torch.relu(self.proj(x)) + x)


class Net(nn.Module):
    """fx cannot trace it: the model's own forward branches on a size (so no submodule to keep
    whole). Returns a dict holding a constant, and takes a keyword input."""

    def __init__(self, width=8, depth=4):
        super().__init__()
        self.layers = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 3)
        self.register_buffer("scale", torch.full((width,), 0.5), persistent=False)

    def forward(self, x, bias=None):
        if x.shape[-1] % 2 == 0:          # fine for export (sizes are known), not for fx
            x = x * self.scale
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x) if bias is None else self.head(x) + bias
        return {"logits": logits, "hidden": x, "aux": None}


def net_and_input(batch=4):
    torch.manual_seed(0)
    return Net().eval(), torch.randn(batch, 8)


def computing(gm):
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


# ---- capture ------------------------------------------------------------------------------------

def test_export_captures_what_fx_cannot_and_says_why():
    model, x = net_and_input()
    gm = trace(model, (x,))
    capture = gm.meta["capture"]
    assert capture.method == "export" and capture.leaves == () and capture.training is False
    assert str(capture).startswith("export in eval mode because torch.fx failed: TraceError")
    torch.testing.assert_close(gm(x), model(x))


def test_capture_export_skips_fx():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    gm = trace(model, (torch.randn(2, 4),), capture="export")
    assert gm.meta["capture"].method == "export" and not gm.meta["capture"].failures
    assert all(n.op != "call_module" for n in gm.graph.nodes)


def test_export_graph_returns_the_models_own_types():
    Pair = namedtuple("Pair", "left right")

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return Pair(self.a(x), [self.b(x), None])

    model, x = TwoHeads(), torch.randn(3, 4)
    out = trace(model, (x,), capture="export")(x)
    assert type(out) is Pair and isinstance(out.right, list) and out.right[1] is None
    torch.testing.assert_close(out, model(x))


def test_nodes_are_named_after_their_modules_and_read_parameters_where_used():
    model, x = net_and_input()
    gm = trace(model, (x,))
    names = [n.name for n in gm.graph.nodes]
    assert "layers_2_proj" in names          # the only op of layers.2.proj takes its name
    assert "layers_2_add" in names           # others add their op
    i = names.index("layers_2_proj_weight")
    assert names[i + 1:i + 3] == ["layers_2_proj_bias", "layers_2_proj"]
    assert not [n for n in gm.graph.nodes if n.op == "call_module" or
                n.target is torch.ops.aten._assert_tensor_metadata.default]


def test_export_graph_holds_the_models_own_state_under_its_names():
    model, x = net_and_input()
    gm = trace(model, (x,), capture="export")
    assert list(gm.state_dict()) == list(model.state_dict())      # `scale` is not persistent
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(gm.get_parameter(n) is p for n, p in model.named_parameters())
    assert gm.get_buffer("scale") is model.scale
    gm.train()                                # a plain GraphModule: modes can be set


# ---- the calling convention ----------------------------------------------------------------------

def test_any_batch_size_runs_and_other_sizes_are_refused_by_name():
    model, x = net_and_input()
    gm = trace(model, (x,), capture="export")
    for rows in (1, 3, 7):
        torch.testing.assert_close(gm(x[:1].repeat(rows, 1)), model(x[:1].repeat(rows, 1)))
    with pytest.raises(InputError, match=r"input 'x' has shape \(4, 6\).*\(\*, 8\)"):
        signature_of(gm).flatten_inputs((torch.randn(4, 6),))


def test_inputs_are_taken_as_the_example_gave_them():
    model, x = net_and_input()
    bias = torch.randn(4, 3)
    gm = trace(model, (x,), {"bias": bias}, capture="export")
    signature = signature_of(gm)
    assert signature.names == ("x", "bias") and signature.positional == 1
    values = signature.flatten_inputs((), {"bias": bias, "x": x})
    assert values[0] is x and values[1] is bias
    with pytest.raises(InputError, match="pass bias by keyword"):
        signature.flatten_inputs((x, bias))
    with pytest.raises(InputError, match="exported from an example without them"):
        signature.flatten_inputs((x,), {"bias": bias, "mask": bias})
    with pytest.raises(InputError, match="no value for input 'bias'"):
        signature.flatten_inputs((x,))


def test_fx_outputs_come_back_as_plain_containers():
    class Dicty(nn.Module):
        def forward(self, x):
            return {"y": [x + 1, x * 2]}

    gm = fx.symbolic_trace(Dicty())
    out = signature_of(gm).rebuild_outputs({"add": 1, "mul": 2})
    assert out == {"y": [1, 2]} and type(out) is dict and type(out["y"]) is list


# ---- errors ---------------------------------------------------------------------------------------

class Hopeless(nn.Module):
    def forward(self, x):
        if x.sum() > 0:          # a branch on a tensor's value: no front-end can follow it
            return x
        return -x


def test_when_nothing_captures_the_model_one_error_lists_every_front_end():
    with pytest.raises(TraceError) as info:
        trace(Hopeless(), (torch.randn(2, 3),))
    message = str(info.value)
    assert "- torch.fx:" in message and "- torch.export:" in message
    assert message.count("if x.sum() > 0:") == 2 and "test_export.py" in message
    assert "leaf_modules" in message and "torch.cond" in message


def test_export_needs_example_inputs():
    with pytest.raises(TraceError, match="needs example inputs"):
        trace(nn.Linear(2, 2), capture="export")


# ---- train mode, functionalize ---------------------------------------------------------------------

def test_a_model_in_train_mode_is_exported_in_train_mode_and_keeps_its_state_updates():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(inplace=True),
                          nn.Dropout(0.5)).train()
    x = torch.randn(8, 4)
    before = model[1].running_mean.clone()
    gm = functionalize(trace(model, (x,), capture="export"))
    assert gm.meta["capture"].training and "train mode" in str(gm.meta["capture"])
    torch.testing.assert_close(model[1].running_mean, before)   # capturing changed nothing
    targets = [str(n.target) for n in gm.graph.nodes]
    assert "aten.dropout.default" in targets and "aten.relu_.default" not in targets
    gm(x)                                                       # BatchNorm's updates stay
    assert model[1].num_batches_tracked.item() == 1
    assert not torch.equal(model[1].running_mean, before)


def test_functionalize_turns_aten_in_place_ops_out_of_place():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            y.add_(1)
            return torch.relu_(y) * 2

    model, x = InPlace(), torch.randn(3, 4)
    gm = functionalize(trace(model, (x,), capture="export"))
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"aten.add.Tensor", "aten.relu.default"} <= targets
    assert not {"aten.add_.Tensor", "aten.relu_.default"} & targets
    torch.testing.assert_close(gm(x), model(x))


# ---- codegen, placement, the plan -------------------------------------------------------------------

class Rotary(nn.Module):
    @torch.no_grad()               # exports as a higher-order op with a sub-GraphModule body
    def forward(self, x):
        return torch.cos(x) * 2, torch.sin(x)


class WithBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary, self.a, self.b = Rotary(), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        cos, sin = self.rotary(x)
        return self.b(torch.tanh(self.a(x)) * cos + sin)


@pytest.mark.parametrize("stages", [2, 3])
def test_a_higher_order_op_body_goes_with_the_stage_that_calls_it(stages):
    model, x = WithBody(), torch.randn(4, 4)
    pipe = assert_pipeline_matches(model, (x,), devices=["cpu"] * stages, chunks=2,
                                   backward=True, capture="export")
    (caller,) = [n for n in pipe.module.graph.nodes if n.op == "call_function"
                 and isinstance(n.target, torch._ops.HigherOrderOperator)]
    body = caller.args[1].target
    stage = pipe.stages[pipe.plan.partition.stage_of[caller.name]]
    assert isinstance(getattr(stage, body), fx.GraphModule)
    assert getattr(stage, body) is not getattr(pipe.module, body)   # its own copy, to place


class Tied(nn.Module):
    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)

    def forward(self, ids):
        return torch.tanh(self.mid(self.embed(ids))) @ self.embed.weight.t()


@pytest.mark.parametrize("get_attr_staged", [True, False], ids=["get_attr-staged", "unstaged"])
def test_each_stage_reads_the_parameters_it_uses_itself(get_attr_staged):
    model, ids = Tied(), torch.randint(0, 11, (4, 5))
    gm = trace(model, (ids,), capture="export")
    first_stage = {"embed_weight": 0, "embed": 0}
    stage_of = {n.name: first_stage.get(n.name, 1) for n in computing(gm)
                if get_attr_staged or n.op != "get_attr"}     # a partition may leave them out
    first, second = split_stages(gm, stage_of, ["cpu", "cpu"])
    assert second.inputs == ("embed",)                 # the weight is not sent...
    assert first.module.get_parameter("embed.weight") is model.embed.weight
    assert second.module.get_parameter("embed.weight") is model.embed.weight   # ...but read
    assert_pipeline_matches(model, (ids,), devices=["cpu"] * 2, chunks=2, backward=True,
                            capture="export")


def test_a_parameter_costs_its_first_reader_and_is_never_sent():
    model, ids = Tied(), torch.randint(0, 11, (4, 5))
    gm = annotate_costs(trace(model, (ids,), capture="export"), (ids,))
    nodes = {n.name: n for n in gm.graph.nodes}
    weight = model.embed.weight
    assert nodes["embed_weight"].meta["cost"].out_bytes == 0
    assert nodes["embed_weight"].meta["cost"].param_bytes == 0
    assert nodes["embed"].meta["cost"].param_bytes == weight.numel() * weight.element_size()


def test_place_makes_the_ops_create_tensors_on_the_new_device():
    class Positions(nn.Module):
        def forward(self, x):
            return x + torch.arange(x.shape[1], device=x.device)

    gm = trace(Positions(), (torch.randn(2, 5),), capture="export")
    devices = [a for n in gm.graph.nodes for a in (*n.args, *n.kwargs.values())
               if isinstance(a, torch.device)]
    assert devices == [torch.device("cpu")]
    place(gm, "meta")
    assert gm(torch.randn(2, 5, device="meta")).device.type == "meta"


def test_the_plan_lists_the_modules_of_each_stage():
    model, x = net_and_input()
    gm = trace(model, (x,), capture="export")
    names = [n.name for n in computing(gm)]
    cut = names.index("layers_2_relu")       # stage 1 starts inside layers.2, after its proj
    stages = split_stages(gm, {n: int(i >= cut) for i, n in enumerate(names)}, ["cpu", "cpu"])
    assert stage_modules(stages) == (
        ("layers.0-1", "layers.2.proj"),
        ("layers.2 (part)", "layers.2.norm", "layers.3", "head"))


def test_compile_runs_export_graphs_with_keyword_inputs_and_uneven_micro_batches():
    model, x = net_and_input(batch=7)
    bias = torch.randn(7, 3)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), {"bias": bias}, chunks=3)
    assert "captured by export" in str(pipe.plan) and "layers.0" in str(pipe.plan)
    out = pipe(x, bias=bias)
    assert out["aux"] is None
    assert_same_up_to_rounding(out, model(x, bias=bias))
    assert_same_up_to_rounding(pipe(x[:4], bias=bias[:4]), model(x[:4], bias=bias[:4]))


def test_a_batch_size_fixed_by_the_models_code_is_named_when_micro_batches_need_another():
    class FixedBatch(nn.Module):
        def forward(self, x):
            return x.reshape(4, 6) * 2           # literal sizes fix the batch for export

    x = torch.randn(4, 3, 2)
    gm = trace(FixedBatch(), (x,), capture="export")
    assert signature_of(gm).sizes == ((4, None, None),)      # 3 and 2 may vary, their product not
    signature_of(gm).flatten_inputs((torch.randn(4, 2, 3),))    # accepted: 2 x 3 is 6 too
    with pytest.raises(fxpipe.InputError, match=r"break a condition"):
        signature_of(gm).flatten_inputs((torch.randn(4, 3, 3),))
    with pytest.raises(fxpipe.InputError, match=r"(?s)the graph's is \(4, \*, \*\).*"
                                                r"dimension 0 is fixed to 4.*reshape\(4, 6\).*chunks=1"):
        fxpipe.compile(FixedBatch(), ["cpu"], (x,), chunks=2, capture="export")


def test_an_export_pipeline_captures_the_model_again_for_the_other_mode():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()
    reference = copy.deepcopy(model).train()
    x = torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, capture="export")
    pipe.train()                                   # BatchNorm on each micro-batch's statistics
    assert model.training is False                 # capturing again leaves the model's mode
    assert_same_up_to_rounding(pipe(x), torch.cat([reference(xc) for xc in x.tensor_split(2)]))
    assert_same_up_to_rounding(model[1].running_mean, reference[1].running_mean)
    pipe.eval()
    assert_same_up_to_rounding(pipe(x), model(x))


def test_an_export_graph_with_batchnorm_trains_with_the_models_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 2)).train()
    reference = copy.deepcopy(model)
    x, target = torch.randn(8, 4), torch.randn(8, 2)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, capture="export")
    loss = pipe.train_step(x, target, torch.nn.functional.mse_loss)
    expected = sum(torch.nn.functional.mse_loss(reference(xc), tc) / 2
                   for xc, tc in zip(x.tensor_split(2), target.tensor_split(2)))
    expected.backward()
    assert_same_training(model, reference, loss=(loss, expected))
