"""Repeated blocks measured once, and estimates where a node cannot run (`passes/blocks.py`,
`annotate_costs(reuse_blocks=..., max_node_bytes=...)`): which nodes repeat which, the costs
they take, and plans made with and without reuse computing the model."""

from __future__ import annotations

import collections
import json

import pytest
import torch
import torch.fx as fx
from torch import nn
from hypothesis import given, strategies as st
from torch.fx.passes.shape_prop import ShapeProp

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.passes.annotate_costs import annotate_costs
from fxpipe.passes.blocks import block_of, repeated_blocks
from fxpipe.passes.errors import CostError
from fxpipe.passes.capture import trace

import transformers  # noqa: F401  (a test dependency: its absence must fail, not skip)


class Layer(nn.Module):
    def __init__(self, hidden: int = 16, width: int = 8):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, hiddens=(16, 16, 16, 16)):
        super().__init__()
        self.layers = nn.ModuleList(Layer(h) for h in hiddens)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def captured(model: nn.Module, capture: str) -> fx.GraphModule:
    x = torch.randn(4, 8)
    gm = trace(model, (x,), capture=capture)
    if capture == "fx":          # what a run records; export's nodes carry their own
        ShapeProp(gm).propagate(x)
    return gm


def by_name(repeats: dict[fx.Node, fx.Node]) -> dict[str, str]:
    return {n.name: first.name for n, first in repeats.items()}


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_identical_layers_repeat_the_first_node_for_node(capture):
    gm = captured(Stack(), capture)
    repeats = repeated_blocks(gm)
    layer = {k: [n for n in gm.graph.nodes if block_of(n) == f"layers.{k}"] for k in range(4)}
    assert len(layer[0]) == (4 if capture == "fx" else 8)    # export: weights, biases as nodes
    assert by_name(repeats) == {n.name: first.name for k in (1, 2, 3)
                                for n, first in zip(layer[k], layer[0])}


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_layers_of_other_widths_repeat_nothing_and_equal_ones_repeat_the_first(capture):
    assert repeated_blocks(captured(Stack(hiddens=(16, 32, 64)), capture)) == {}
    gm = captured(Stack(hiddens=(16, 32, 16)), capture)
    assert {block_of(n) for n in repeated_blocks(gm)} == {"layers.2"}
    assert {block_of(first) for first in repeated_blocks(gm).values()} == {"layers.0"}


@given(hiddens=st.lists(st.sampled_from([4, 8, 16]), min_size=1, max_size=5))
def test_each_layer_repeats_the_first_layer_of_its_width(hiddens):
    gm = captured(Stack(hiddens=tuple(hiddens)), "fx")
    repeated = {block_of(n): block_of(first) for n, first in repeated_blocks(gm).items()}
    assert repeated == {f"layers.{k}": f"layers.{hiddens.index(h)}"
                        for k, h in enumerate(hiddens) if hiddens.index(h) < k}


def test_a_block_of_unknown_types_repeats_nothing():
    gm = trace(Stack(), (torch.randn(4, 8),), capture="fx")     # no values recorded
    assert repeated_blocks(gm) == {}


def test_inputs_of_other_shapes_repeat_nothing():
    class TwoWidths(nn.Module):       # the same layers, read at other batch sizes
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(2))

        def forward(self, x):
            return self.layers[0](x), self.layers[1](x[:2])
    gm = captured(TwoWidths(), "fx")
    assert repeated_blocks(gm) == {}


def llama_and_gpt2():
    common = dict(vocab_size=64, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=32, use_cache=False, **common))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=4, n_positions=32, use_cache=False, **common))
    return {"llama": (llama, "model.layers"), "gpt2": (gpt2, "transformer.h")}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_decoder_layers_reuse_the_first_layers_costs(name):
    model, container = llama_and_gpt2()[name]
    ids = torch.randint(0, 64, (2, 8))
    gm = annotate_costs(trace(model.eval(), (), {"input_ids": ids}), (), {"input_ids": ids},
                        repeats=2)
    nodes = {n.name: n for n in gm.graph.nodes}
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        cost, block = n.meta["cost"], block_of(n)
        if block in (f"{container}.1", f"{container}.2"):
            first = nodes[cost.reused_from]
            assert cost.source == "reused" and block_of(first) == f"{container}.0"
            assert first.meta["cost"].source == "measured"
            assert (cost.fwd_s, cost.bwd_s, cost.spread) == (
                first.meta["cost"].fwd_s, first.meta["cost"].bwd_s, first.meta["cost"].spread)
            assert cost.out_bytes == first.meta["cost"].out_bytes
        else:
            assert cost.source == "measured" and cost.reused_from == ""


CALLS: collections.Counter = collections.Counter()     # outside the model: no side effect


class Counted(nn.Module):
    """A layer kept whole (a leaf) that counts its calls."""

    def __init__(self, index: int):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.index = index

    def forward(self, x):
        CALLS[self.index] += 1
        return torch.relu(self.lin(x))


class CountedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(Counted(k) for k in range(3)))

    def forward(self, x):
        return self.layers(x).sum(-1)


@pytest.mark.parametrize("backward", [False, True])
def test_a_repeat_runs_in_the_first_run_only_and_keeps_its_own_bytes(backward):
    model, x = CountedStack(), torch.randn(4, 8)
    gm = trace(model, (x,), capture="fx", leaf_modules=[Counted])
    CALLS.clear()
    annotate_costs(gm, (x,), repeats=3, max_repeats=3, backward=backward)
    per_run = 2 if backward else 1          # the backward's timing runs the node again
    assert CALLS[0] == per_run * (1 + 3)    # warm-up and repeats
    assert CALLS[1] == CALLS[2] == per_run  # the first run only
    costs = {n.name: n.meta["cost"] for n in gm.graph.nodes if n.op != "output"}
    assert [costs[f"layers_{k}"].source for k in range(3)] == ["measured", "reused", "reused"]
    assert costs["layers_2"].fwd_s == costs["layers_0"].fwd_s
    assert costs["layers_2"].out_bytes == 4 * 8 * 4
    if backward:    # relu keeps its output: each layer's own, measured in the first run
        assert costs["layers_2"].saved_bytes == costs["layers_0"].saved_bytes > 0
    assert costs["sum_1"].source == "measured" and costs["sum_1"].fwd_s > 0


def test_without_reuse_every_node_is_measured():
    gm = annotate_costs(captured(Stack(), "fx"), (torch.randn(4, 8),), repeats=1,
                        reuse_blocks=False)
    assert {n.meta["cost"].source for n in gm.graph.nodes if n.op != "output"} == {"measured"}


def test_plans_with_and_without_reuse_compute_the_model(tmp_path, monkeypatch):
    # Block reuse alone: on a loaded machine a noisy Linear may look costly enough to split
    # across stages (split_wide), which adds nodes of its own to the counts below.
    monkeypatch.setattr(fxpipe.planning.search, "wide_nodes", lambda *args: {})
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(8, 8)
    plans = {reuse: fxpipe.plan(model, ["cpu"] * 3, (x,), chunks=2, repeats=2,
                                reuse_blocks=reuse) for reuse in (True, False)}
    for reuse, plan in plans.items():
        nodes = [n.name for n in plan.graph.graph.nodes if n.op not in ("placeholder", "output")]
        assert set(plan.partition.stage_of) >= set(nodes)
        assert sorted(set(plan.partition.stage_of.values())) == [0, 1, 2]
        assert plan.partition.bottleneck_s >= plan.partition.lower_bound_s * (1 - 1e-9)
        with torch.no_grad():
            assert_same_up_to_rounding(fxpipe.Pipeline(plan)(x), model(x))
    calls = 4 * 4 + 1                           # fx: 4 calls in each of 4 layers, and the head
    assert f"node costs: {calls} measured, 0 reused" in str(plans[False])
    assert f"node costs: {calls - 3 * 4} measured, {3 * 4} reused" in str(plans[True])
    saved = json.loads((plans[True].save(tmp_path / "plan") / "plan.json").read_text())
    assert saved["cost_sources"] == {"measured": calls - 12, "reused": 12, "estimated": 0}
    assert {c["source"] for kinds in saved["costs"].values() for c in kinds.values()} == {
        "measured", "reused"}


def test_reuse_blocks_must_be_a_bool():
    with pytest.raises(CostError, match="reuse_blocks='yes'"):
        fxpipe.plan(Stack(), ["cpu"], (torch.randn(4, 8),), reuse_blocks="yes")


def test_nodes_over_the_byte_limit_are_estimated_and_their_values_flow_on():
    model, x = Stack(hiddens=(16, 64, 16)), torch.randn(4, 8)
    limit = 8 * 64 * 4       # layers.1's up and down hold more weights than this
    gm = annotate_costs(captured(model, "fx"), (x,), repeats=2, backward=True,
                        max_node_bytes=limit)
    costs = {n.name: n.meta["cost"] for n in gm.graph.nodes if n.op != "output"}
    assert {name for name, c in costs.items() if c.source == "estimated"} == {
        "layers_1_up", "layers_1_down"}
    for name in ("layers_1_up", "layers_1_down"):
        assert costs[name].fwd_s > 0 and costs[name].bwd_s > 0 and costs[name].spread == 0
        assert costs[name].out_bytes == 4 * (64 if name.endswith("up") else 8) * 4
    assert costs["layers_2_up"].source == "reused"           # layers.2 repeats layers.0
    assert costs["head"].source == "measured"
    assert [n.meta["shapes"] for n in gm.graph.nodes if n.name == "head"] == [((4, 3),)]


def test_a_weight_over_the_limit_stays_on_meta_and_its_readers_are_estimated():
    model, x = Stack(hiddens=(16, 64, 16)), torch.randn(4, 8)
    gm = annotate_costs(captured(model, "export"), (x,), repeats=1, max_node_bytes=8 * 48 * 4)
    sources = {n.name: n.meta["cost"].source for n in gm.graph.nodes if n.op != "output"}
    assert {name for name, source in sources.items() if source == "estimated"} == {
        "layers_1_up_weight", "layers_1_up", "layers_1_down_weight", "layers_1_down"}
    assert sources["layers_1_up_bias"] == sources["layers_1_relu"] == "measured"


def test_an_output_over_the_limit_stays_on_meta_and_its_readers_are_estimated():
    def f(x):
        wide = x.repeat(1, 64)           # 4 x 512 floats: over the limit
        return wide.sum(-1) + x.sum(-1)
    gm = annotate_costs(fx.symbolic_trace(f), (torch.randn(4, 8),), repeats=1,
                        max_node_bytes=4 * 64 * 4)
    sources = {n.name: n.meta["cost"].source for n in gm.graph.nodes if n.op != "output"}
    assert sources == {"x": "measured", "repeat": "estimated", "sum_1": "estimated",
                       "sum_2": "measured", "add": "measured"}


@torch.library.custom_op("fxpipe_test::gpu_only", mutates_args=(), device_types="cuda")
def gpu_only(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@gpu_only.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_node_without_a_kernel_here_is_estimated():
    def f(x):
        return torch.relu(gpu_only(x @ x.T))
    gm = annotate_costs(fx.symbolic_trace(f), (torch.randn(16, 16),), repeats=2)
    costs = {n.name: n.meta["cost"] for n in gm.graph.nodes if n.op != "output"}
    assert costs["gpu_only_default"].source == "estimated"
    assert costs["gpu_only_default"].fwd_s > 0
    assert costs["relu"].source == "measured" and costs["matmul"].source == "measured"


def test_nothing_able_to_run_is_refused_naming_the_node_and_the_fix():
    with pytest.raises(CostError, match=r"'layers_0_up' cannot run on cpu\n.* max_node_bytes"):
        annotate_costs(captured(Stack(), "fx"), (torch.randn(4, 8),), repeats=1,
                       max_node_bytes=0)


# ---- on meta: repeats known from the capture's types, never run ------------------------------

def _recorded(gm: fx.GraphModule) -> dict[str, tuple]:
    """What measuring records on each node besides its times."""
    return {n.name: (c.out_bytes, c.new_bytes, c.views, c.saved_bytes, c.param_bytes, c.source,
                     c.reused_from, n.meta["output_kept"], n.meta.get("state"),
                     n.meta["shapes"])
            for n in gm.graph.nodes if n.op != "output" for c in [n.meta["cost"]]}


@pytest.mark.parametrize("backward", [False, True])
def test_on_meta_repeats_never_run_and_record_what_a_run_of_every_layer_records(
        backward, monkeypatch):
    """A decoder built on meta: the capture's types say which layers repeat the first, so only
    the first layer's weights are ever read (a 405B layer is 6.4 GB, drawn and run 126 times
    otherwise); each node's bytes, views, kept values and sources are those found by a first
    run through every layer (the repeats found from its types, as for a model holding values)."""
    import fxpipe.passes.annotate_costs.reuse as reuse_module
    from fxpipe.weights import Init

    config = transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=32, use_cache=False, vocab_size=64,
        bos_token_id=0, eos_token_id=1, pad_token_id=0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    init = Init(model, seed=0).for_planning(model)
    gm = trace(model, (), {"input_ids": ids}, capture="export")
    layers_read: list[set[str]] = []

    def measured():
        read: set[str] = set()

        def materialize(like, device):
            read.update(name.split(".")[2] for name in like if ".layers." in name)
            return init.read(like, device)
        annotate_costs(gm, (), {"input_ids": ids}, repeats=1, max_repeats=1,
                       backward=backward, materialize=materialize)
        layers_read.append(read)
        return _recorded(gm)
    early = measured()
    monkeypatch.setattr(reuse_module, "meta_types", lambda gm: None)    # as before: run all
    every_layer_run = measured()
    assert layers_read == [{"0"}, {"0", "1", "2"}]
    assert early == every_layer_run
    assert [recorded[5] for recorded in early.values()].count("reused") > 0    # the source

