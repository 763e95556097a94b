"""A node too costly for one stage is split along its output features (`passes/split_wide.py`):
alone on a GraphModule, and in planning, where the parts go to different stages. Outputs,
gradients and the model's parameters stay the model's. Costs are scripted (no timing asserted).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding
from fxpipe.planning import search
from fxpipe.plans import prediction
from fxpipe.passes.cost_model import DeviceSpec, NodeCost, StageCost
from fxpipe.passes.errors import PartitionError
from fxpipe.passes.partition import Partition
from fxpipe.passes.split_wide import split_wide, splittable, wide_nodes
from fxpipe.passes.capture import trace
from nets import Head


class ConvHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3), nn.Tanh())
        self.head = nn.Conv2d(8, 24, 3, padding=1, stride=2)

    def forward(self, x):
        return self.head(self.body(x))


class TiedLM(nn.Module):
    """A language model whose output layer reads the embedding's weight (as GPT-2's does)."""

    def __init__(self, vocab=300, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.mix(self.embed(ids)))


def built(model_class):
    torch.manual_seed(0)
    return model_class().train()


EXAMPLES = {Head: lambda: torch.randn(8, 16), ConvHead: lambda: torch.randn(4, 3, 10, 10),
            TiedLM: lambda: torch.randint(0, 300, (8, 5))}


# A split input gradient is a sum over the parts: the same terms, added in another order,
# equal up to rounding (epsilons of the largest gradient: `fxpipe.testing`).
TOLERANCE = dict(what="gradient")


def gradients(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def loss_fn(out, target):
    return F.mse_loss(out, target)


def token_loss(logits, ids):
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


# --- the pass alone ------------------------------------------------------------------------------

@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("model_class", [Head, ConvHead, TiedLM])
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_the_pass_alone_keeps_outputs_and_gradients(model_class, capture, parts):
    model, x = built(model_class), EXAMPLES[model_class]()
    gm = trace(model, (x,), {}, capture=capture)
    (head,) = [n for n in gm.graph.nodes if n.name == "head"]
    assert splittable(gm, head)
    expected = model(x)
    expected.square().mean().backward()
    expected_grads = gradients(model)
    model.zero_grad()
    split_wide(gm, {"head": parts})
    assert "head" not in {n.name for n in gm.graph.nodes}
    assert len([n for n in gm.graph.nodes if n.name.startswith("head_part_")]) == parts
    out = gm(x)
    out.square().mean().backward()
    assert_same_up_to_rounding(out, expected)
    assert_same_up_to_rounding(gradients(model), expected_grads, **TOLERANCE)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 9), st.integers(2, 9), st.booleans(),
       st.sampled_from(["linear", "addmm", "mm", "matmul"]))
def test_any_number_of_parts_computes_the_same(features, parts, bias, op):
    """F.linear, addmm, mm and matmul by a weight, split into 2 to `features` parts."""
    parts = min(parts, features)
    torch.manual_seed(features)
    weight = nn.Parameter(torch.randn(features, 5))
    b = nn.Parameter(torch.randn(features)) if bias or op == "addmm" else None

    class Op(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.b = weight, b

        def forward(self, x):
            if op == "linear":
                return F.linear(x, self.weight, self.b)
            if op == "addmm":
                return torch.addmm(self.b, x, self.weight.T)
            return (torch.mm if op == "mm" else torch.matmul)(x, self.weight.T)

    model = Op()
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(3, 5)
    if op != "linear":       # a weight read through `.T` has a shape only a front-end records
        from torch.fx.passes.shape_prop import ShapeProp
        ShapeProp(gm).propagate(x)
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (
        F.linear, torch.addmm, torch.mm, torch.matmul)]
    split_wide(gm, {node.name: parts})
    assert_same_up_to_rounding(gm(x), model(x))


def test_costs_are_shared_among_the_parts_by_their_features():
    gm = torch.fx.symbolic_trace(built(Head))
    for n in gm.graph.nodes:
        ms = {"head": 9, "x": 0, "output": 0}.get(n.name, 1)
        n.meta["cost"] = NodeCost(fwd_s=ms * 1e-3, out_bytes=96)
    assert wide_nodes(gm, 3) == {"head": 12}        # 9 ms of 13: over a third; 4 parts a stage
    assert wide_nodes(gm, 2) == {"head": 8}
    assert wide_nodes(gm, 30)["head"] == 96         # at most one part per output feature
    for n in gm.graph.nodes:
        n.meta["cost"] = dataclasses.replace(n.meta["cost"], bwd_s=n.meta["cost"].fwd_s)
    assert wide_nodes(gm, 3, training=True) == {"head": 3}    # in training, one per stage

    assert wide_nodes(gm, 1) == {}
    split_wide(gm, {"head": 2})
    parts = [n.meta["cost"] for n in gm.graph.nodes if n.name.startswith("head_part_")]
    assert [c.fwd_s for c in parts] == pytest.approx([0.0045, 0.0045])
    assert sum(c.out_bytes for c in parts) == 96
    # Slices and the join cost what the cheapest op does: splitting is never free.
    glue = [n.meta["cost"] for n in gm.graph.nodes if n.name.startswith(("head_weight_",
                                                                          "head_bias_",
                                                                          "head_cat"))]
    assert len(glue) == 5 and all(c.fwd_s == pytest.approx(0.001) for c in glue)
    assert glue[0].out_bytes == 48 * 32 * 4            # half the weight, read by part 0


def test_a_node_that_cannot_be_split_is_refused_by_name():
    gm = torch.fx.symbolic_trace(built(Head))
    with pytest.raises(PartitionError, match=r"'body_1'[\s\S]*not a node split_wide splits"):
        split_wide(gm, {"body_1": 2})
    with pytest.raises(PartitionError, match=r"'nothing'[\s\S]*no such node"):
        split_wide(gm, {"nothing": 2})
    with pytest.raises(PartitionError, match="96 output features"):
        split_wide(gm, {"head": 97})


# --- in planning ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("model_class, capture", [(Head, "fx"), (Head, "export"),
                                                  (ConvHead, "fx"), (ConvHead, "export")])
def test_a_split_head_trains_as_the_model_on_several_stages(scripted_costs, model_class,
                                                             capture, stages):
    scripted_costs["head"] = 40.0       # 40 ms of 44: no stage count balances it whole
    model, x = built(model_class), EXAMPLES[model_class]()
    target = model(x).detach().normal_()
    reference = copy.deepcopy(model)
    loss_fn(reference(x), target).backward()
    pipe = fxpipe.compile(model, ["cpu"] * stages, (x,), chunks=2, capture=capture)
    split = dict(pipe.plan.record.chosen.split)
    assert split["head"] >= 2
    stage_of = pipe.plan.partition.stage_of
    part_stages = {stage_of[f"head_part_{i}"] for i in range(split["head"])}
    assert len(part_stages) > 1, "the parts run on several stages"
    assert "split to balance the stages" in str(pipe.plan)
    assert_same_up_to_rounding(pipe(x), reference(x))
    loss = pipe.train_step(x, target, loss_fn)
    assert_same_training(model, reference, loss=(loss, loss_fn(reference(x), target)))
    assert set(pipe.state_dict()) == set(reference.state_dict())


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_split_head_tied_to_the_embedding_trains_the_one_parameter(scripted_costs, capture):
    scripted_costs["head"] = 40.0
    model, ids = built(TiedLM), EXAMPLES[TiedLM]()
    reference = copy.deepcopy(model)
    token_loss(reference(ids), ids).backward()
    pipe = fxpipe.compile(model, ["cpu"] * 3, (ids,), chunks=2, capture=capture)
    assert dict(pipe.plan.record.chosen.split)["head"] >= 2
    loss = pipe.train_step(ids, ids, token_loss)
    assert model.head.weight is model.embed.weight
    assert_same_up_to_rounding(model.embed.weight.grad, reference.embed.weight.grad,
                               **TOLERANCE)
    assert_same_training(model, reference, loss=(loss, token_loss(reference(ids), ids)))
    state = pipe.state_dict()
    assert set(state) == set(reference.state_dict())
    assert state["embed.weight"].shape == (300, 16)
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()     # the one tied weight steps once
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert_same_up_to_rounding(model.embed.weight, reference.embed.weight)


def test_a_split_is_kept_only_where_it_lowers_the_bottleneck(scripted_costs):
    scripted_costs["head"] = 1.5    # over a share of 4 stages, but the nodes around it cost more
    model, x = built(Head), EXAMPLES[Head]()
    pipe = fxpipe.compile(model, ["cpu"] * 4, (x,), chunks=2)
    assert pipe.plan.record.chosen.split == ()
    assert "head" in pipe.plan.partition.stage_of


def test_a_head_that_two_parts_cannot_balance_is_split_finer(scripted_costs):
    """On 2 stages a body of 40 ms and a head of 70: in 2 parts (35 ms, each with its slices) a
    stage holds the body and one part, or both parts, no better than the head whole; in 4 the
    stages balance near 60 ms."""
    scripted_costs.update(body_0=37.0, head=70.0)   # the body's 4 nodes: 37 + 1 + 1 + 1 ms
    model, x = built(Head).eval(), EXAMPLES[Head]()
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2)
    assert dict(plan.record.chosen.split)["head"] > 2
    assert plan.partition.bottleneck_s < 0.9 * 70e-3
    assert_same_up_to_rounding(fxpipe.Pipeline(plan)(x), model(x))


def test_part_counts_cover_the_coarse_and_the_fine():
    assert search.part_counts(2, 8) == [2, 4, 8]
    assert search.part_counts(4, 16) == [2, 3, 4, 8, 16]
    assert search.part_counts(3, 5) == [2, 3]      # no more parts than output features


def test_a_saved_plan_with_a_split_node_loads_and_equals_the_model(scripted_costs, tmp_path):
    scripted_costs["head"] = 40.0
    model, x = built(Head), EXAMPLES[Head]()
    plan = fxpipe.plan(model, ["cpu"] * 3, (x,), chunks=2)
    assert plan.record.chosen.split
    plan.save(tmp_path / "plan")
    loaded = fxpipe.Pipeline(fxpipe.load_plan(tmp_path / "plan"))
    assert_same_up_to_rounding(loaded(x), model(x))
    assert set(loaded.state_dict()) == set(model.state_dict())
    # Its measurements are of the graph as captured: planning again from them splits it again.
    again = fxpipe.plan(model, ["cpu"] * 3, (x,), chunks=2,
                        costs=fxpipe.load_plan(tmp_path / "plan"))
    assert again.record.chosen.split == plan.record.chosen.split


def test_gpt2_head_is_split_and_no_stage_idles(scripted_costs):
    """GPT-2's vocabulary head as one node costs as much as the rest of the model: on 4 stages
    it is the bottleneck alone, and the partitioner may leave a stage next to empty. Split, the
    stages balance."""
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=4000,
                                     n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 4000, (4, 8))
    gm = trace(model, (), {"input_ids": ids, "use_cache": False})
    computing = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    scripted_costs["lm_head"] = float(len(computing))      # the head: as much as all the rest
    plan = fxpipe.plan(model, ["cpu"] * 4, example_kwargs={"input_ids": ids}, chunks=2)
    assert dict(plan.record.chosen.split)["lm_head"] >= 2
    bottleneck = plan.partition.bottleneck_s
    assert all(stage.time_s >= search.NEAR_EMPTY * bottleneck for stage in plan.partition.stages)
    assert bottleneck < len(computing) * 1e-3, "below the head's whole cost"
    pipe = fxpipe.Pipeline(plan)
    assert_same_up_to_rounding(pipe(input_ids=ids).logits, model(input_ids=ids).logits)


# --- near-empty stages ----------------------------------------------------------------------------

def candidate(stage_ms, predicted_s=1.0):
    costs = tuple(StageCost(compute_s=ms * 1e-3, comm_s=0.0, memory_bytes=0, sent_bytes=0,
                            received_bytes=0, num_nodes=1) for ms in stage_ms)
    part = Partition({}, (DeviceSpec("cpu"),) * len(costs), costs, max(stage_ms) * 1e-3,
                     max(stage_ms) * 1e-3, True)
    return prediction.Candidate(prediction.Config(len(costs), 2, "gpipe", 1), predicted_s, 0, part)


def test_a_stage_doing_next_to_nothing_is_named_when_the_stage_count_was_asked_for():
    idle = candidate([10.0, 0.09, 9.0])
    chosen, reason = search.choose([idle], None)
    assert chosen is idle
    assert "stage 1 does next to nothing (0.090 ms" in reason and "num_stages=3 was asked" in reason
    assert prediction.notes(idle) == ["stage 1 does next to nothing: under 5% of the bottleneck"]
    assert prediction.notes(candidate([10.0, 9.0])) == []


def test_fewer_stages_as_fast_win_over_a_stage_doing_next_to_nothing():
    idle, fewer = candidate([10.0, 0.09, 9.0], 1.0), candidate([10.0, 9.1], 1.01)
    assert search.choose([idle, fewer], None)[0] is fewer
    faster = candidate([10.0, 0.09, 9.0], 0.5)
    chosen, reason = search.choose([faster, fewer], None)
    assert chosen is faster and "fewer stages are predicted over 2% slower" in reason


def test_a_split_tied_head_trains_as_the_model_across_processes(scripted_costs, tmp_path):
    """Under torchrun (one process per stage), every rank holding the tied weight (the
    embedding's, and a part's) ends the step with its whole gradient, the model's; a part whose
    slice the home stage sends holds no parameter."""
    from test_distributed import held_by, ran, results, tied_batch
    scripted_costs["linear"] = 40.0      # the tied output layer, `F.linear(h, emb.weight)`
    model, x, target, pipe, out = ran(tmp_path, 3, 3, **tied_batch())
    assert dict(pipe.plan.record.chosen.split)["linear"] >= 2
    assert len(held_by(tmp_path / "plan", "emb.weight")) >= 2
    ranks = results(out, 3)
    assert_same_up_to_rounding(ranks[-1]["loss"], F.mse_loss(model(x), target))
    F.mse_loss(model(x), target).backward()
    expected = dict(model.named_parameters())
    for rank, got in enumerate(ranks):
        assert_same_up_to_rounding(got["grads"],
                                   {name: expected[name].grad for name in got["grads"]},
                                   what=f"rank {rank}: gradient")
    assert {name for r in ranks for name in r["grads"]} == set(expected)
