"""Buffers written in forward: the pipeline applies each write once per micro-batch, in
micro-batch order, as the model called once per micro-batch does; compiling changes nothing."""

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.testing import assert_pipeline_matches
from fxpipe.passes.annotate_costs import annotate_costs
from fxpipe.passes.cost_model import cost_graph
from fxpipe.passes.functionalize import functionalize
from fxpipe.passes.randomness import seed_random_ops
from fxpipe.passes.state import state_units
from fxpipe.passes.capture import trace


class Counter(nn.Module):
    """Counts its calls."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls.add_(1)
        return self.b(torch.relu(self.a(x)))


class RunningMean(nn.Module):
    """Keeps a running mean of its inputs and subtracts the updated mean."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x):
        h = torch.relu(self.a(x))
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.b(h - self.mean)


def _state(model):
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("Model", [Counter, RunningMean])
def test_buffer_writes_apply_once_per_microbatch_in_order(Model, stages, capture):
    torch.manual_seed(0)
    model = Model()
    pipe = assert_pipeline_matches(model, (torch.randn(8, 4) + 1,), devices=["cpu"] * stages,
                                   chunks=4, backward=True, capture=capture)
    assert pipe.plan.partition.num_stages == stages


def test_a_counter_counts_every_microbatch_of_every_call():
    model = Counter()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (torch.randn(8, 4),), chunks=4)
    assert model.calls.item() == 0
    pipe(torch.randn(8, 4))
    pipe(torch.randn(6, 4))
    assert model.calls.item() == 8


def test_the_output_reads_the_running_mean_after_its_update():
    torch.manual_seed(0)
    model = RunningMean()
    x = torch.randn(8, 4) + 3
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=1)
    expected_mean = 0.1 * x.mean(0)
    expected = model.b(torch.relu(model.a(x)) - expected_mean)
    assert_same_up_to_rounding(pipe(x), expected)
    assert_same_up_to_rounding(model.mean, expected_mean)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("Model", [Counter, RunningMean])
def test_compile_leaves_the_models_state_as_it_found_it(Model, training):
    torch.manual_seed(0)
    model = Model().train(training)
    before = _state(model)
    tensors = {name: t for name, t in model.state_dict(keep_vars=True).items()}
    # chunks=1: verifying a running mean of each micro-batch on 2 refuses it as mixing the batch
    fxpipe.compile(model, ["cpu"] * 2, (torch.randn(8, 4),), chunks=2 if Model is Counter else 1)
    for name, t in model.state_dict(keep_vars=True).items():
        assert t is tensors[name], name
        torch.testing.assert_close(t, before[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_exported_batchnorm_updates_its_running_stats_per_microbatch(stages):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                          nn.BatchNorm1d(8), nn.Linear(8, 2)).train()
    before = _state(model)
    pipe = fxpipe.compile(model, ["cpu"] * stages, (torch.randn(8, 4),), chunks=4,
                          capture="export")
    assert pipe.plan.capture.method == "export"
    for name, t in _state(model).items():
        torch.testing.assert_close(t, before[name], rtol=0, atol=0, msg=name)
    assert_pipeline_matches(model, (torch.randn(8, 4) * 2 + 1,), devices=["cpu"] * stages,
                            chunks=4, backward=True, capture="export")


def test_every_node_touching_a_written_buffer_shares_one_stage():
    torch.manual_seed(0)
    model = RunningMean()
    x = torch.randn(8, 4)
    gm = annotate_costs(functionalize(trace(model, (x,)), (x,)), (x,), repeats=1)
    touching = [n.name for n in gm.graph.nodes if n.meta.get("state")]
    assert {"mul_", "add_", "sub"} <= set(touching)
    graph = cost_graph(gm)
    (unit,) = [members for members in graph.members if len(members) > 1]
    assert set(touching) <= set(unit)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=2, verify=False)
    stage_of = pipe.plan.partition.stage_of
    assert len({stage_of[name] for name in touching}) == 1
    assert set(stage_of) == {n.name for n in pipe.module.graph.nodes
                             if n.op not in ("placeholder", "output", "get_attr")}


def test_reads_after_a_write_read_through_the_write():
    gm = functionalize(trace(RunningMean(), (torch.randn(8, 4),)), (torch.randn(8, 4),))
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["sub"].args[1] is nodes["add_"]      # not the `get_attr` read before it
    assert nodes["add_"].args[0] is nodes["mul_"]


class Noise(nn.Module):
    """A user module drawing random numbers, with its own parameters."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) + torch.randn_like(x)


def test_a_routed_modules_parameters_are_counted_at_its_reader():
    model = nn.Sequential(nn.Linear(8, 8), Noise(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    gm = seed_random_ops(trace(model, (x,), leaf_modules=[Noise]))
    (routed,) = [n for n in gm.graph.nodes if n.op == "get_attr"
                 and isinstance(getattr(gm, n.target, None), nn.Module)]
    annotate_costs(gm, (x,), repeats=1, backward=True)
    (reader,) = [u for u in routed.users]
    assert reader.meta["cost"].param_bytes == (8 * 8 + 8) * 4
    assert sum(n.meta["cost"].param_bytes for n in gm.graph.nodes if n.op != "output") == \
        sum(p.numel() * p.element_size() for p in model.parameters())


class SharedNorm(nn.Module):
    """One BatchNorm called twice: both calls update its statistics."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.c(torch.relu(self.norm(self.b(torch.relu(self.norm(self.a(x)))))))


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("stages", [2, 3])
def test_a_module_updating_its_buffers_from_two_calls_keeps_them_in_one_stage(stages, capture):
    torch.manual_seed(0)
    model = SharedNorm().train()
    assert_pipeline_matches(model, (torch.randn(8, 4),), devices=["cpu"] * stages, chunks=4,
                            backward=True, capture=capture)


class CrossedStatistics(nn.Module):
    """Each buffer is read early and updated late from the other's reader: contracting each
    buffer's nodes alone would make a cycle, so they share one stage."""

    def __init__(self):
        super().__init__()
        self.register_buffer("first", torch.ones(4))
        self.register_buffer("second", torch.ones(4))
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        p = self.a(x * self.first)
        q = self.b(x * self.second)
        self.first.add_(q.detach().mean(0))
        self.second.add_(p.detach().mean(0))
        return torch.relu(p) + torch.relu(q)


@pytest.mark.parametrize("stages", [2, 3])
def test_buffers_whose_updates_cross_share_one_stage(stages):
    torch.manual_seed(0)
    model = CrossedStatistics()
    pipe = assert_pipeline_matches(model, (torch.randn(8, 4),), devices=["cpu"] * stages,
                                   chunks=4, backward=True)
    stage_of = pipe.plan.partition.stage_of
    touching = [n.name for n in pipe.module.graph.nodes if n.meta.get("state")]
    assert len(touching) >= 4 and len({stage_of[name] for name in touching}) == 1


# --- state_units: which nodes must share a stage ---------------------------------------------------

def units_by_definition(marks, preds):
    """`state_units` as its docstring defines it, slowly: nodes marked with a target together,
    each set's convex hull, and sets that overlap or reach each other both ways (through other
    sets, contracted) merged one pair at a time, until none are left."""
    n = len(preds)
    succs = [[i for i in range(n) if p in preds[i]] for p in range(n)]

    def reach(start, edges):
        seen, todo = set(), list(start)
        while todo:
            for j in edges[todo.pop()]:
                if j not in seen:
                    seen.add(j)
                    todo.append(j)
        return seen
    groups = {}
    for i, targets in enumerate(marks):
        for t in targets:
            groups.setdefault(t, set()).add(i)
    units = list(groups.values())
    while True:
        units = [u | (reach(u, succs) & reach(u, preds)) for u in units]
        below = [reach(u, succs) for u in units]
        k = len(units)
        reaches = [[a == b or bool(below[a] & units[b]) for b in range(k)] for a in range(k)]
        for m in range(k):
            for a in range(k):
                for b in range(k):
                    reaches[a][b] = reaches[a][b] or (reaches[a][m] and reaches[m][b])
        pair = next(((a, b) for a in range(k) for b in range(a + 1, k)
                     if units[a] & units[b] or (reaches[a][b] and reaches[b][a])), None)
        if pair is None:
            return sorted(sorted(u) for u in units)
        units[pair[0]] |= units.pop(pair[1])


@st.composite
def marked_dags(draw):
    n = draw(st.integers(1, 14))
    preds = [sorted(draw(st.sets(st.integers(0, i - 1), max_size=3))) if i else []
             for i in range(n)]
    marks = [draw(st.sets(st.sampled_from("abcde"), max_size=2)) for _ in range(n)]
    return marks, preds


@settings(max_examples=300, deadline=None)
@given(marked_dags())
def test_state_units_are_the_definitions_sets(case):
    marks, preds = case
    graph = fx.Graph()
    nodes = [graph.placeholder(f"n{i}") for i in range(len(preds))]
    for node, targets in zip(nodes, marks):
        node.meta["state"] = tuple(sorted(targets))
    found = state_units(nodes, preds)
    assert sorted(found) == units_by_definition(marks, preds)
    assert [u[0] for u in found] == sorted(u[0] for u in found)


def test_a_batchnorm_network_in_training_keeps_each_norm_alone():
    """Hundreds of BatchNorm nodes, each writing three buffers (marked as `annotate_costs`
    marks them): each norm is a set of its own. (Merged a pair at a time, as the definition
    above does, these took minutes: DenseNet's 121 norms, 190 s a configuration.)"""
    model = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
                            for _ in range(150)]).train()
    gm = trace(model, (torch.randn(2, 4, 3, 3),))
    nodes = list(gm.graph.nodes)
    for n in nodes:
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.BatchNorm2d):
            n.meta["state"] = tuple(f"{n.target}.{b}" for b in
                                    ("num_batches_tracked", "running_mean", "running_var"))
    index = {n: i for i, n in enumerate(nodes)}
    preds = [[index[p] for p in n.all_input_nodes] for n in nodes]
    units = state_units(nodes, preds)
    assert [[nodes[i].target for i in u] for u in units] == [
        [f"{k}.1"] for k in range(150)]
