"""Buffers written in forward: the pipeline applies each write once per micro-batch, in
micro-batch order, as the model called once per micro-batch does; compiling changes nothing."""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.testing import assert_pipeline_matches
from fxpipe.passes.annotate_costs import annotate_costs
from fxpipe.passes.cost_model import cost_graph
from fxpipe.passes.functionalize import functionalize
from fxpipe.passes.randomness import seed_random_ops
from fxpipe.passes.trace import trace


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
    torch.testing.assert_close(pipe(x), expected)
    torch.testing.assert_close(model.mean, expected_mean)


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
