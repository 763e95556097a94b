"""Planning captures the model once per mode (`fxpipe.planning.prepare`): a fixed or an "auto" compile,
its race and its whole-batch retry included, plans from one prepared graph; `pipe.train()` /
`pipe.eval()` captures once more, in the other mode. That the plans equal the model is what the
rest of the suite checks."""

from dataclasses import replace

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxpipe
import fxpipe.api
import fxpipe.planning.build
import fxpipe.planning.measure
from fxpipe.planning.measure import Race, fit_cost
from fxpipe.passes.cost_model import NodeCost
from fxpipe.planning.prepare import graph_copy


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU())
                                      for _ in range(6)])

    def forward(self, x):
        return self.layers(x)


class Mixing(Mlp):
    """Mixes the batch: micro-batches cannot compute what it computes."""

    def forward(self, x):
        return self.layers(x - x.mean(0))


@pytest.fixture
def captures(monkeypatch):
    """The successful fx traces made from here on (a failed one raises, and is not counted)."""
    made = []
    trace = fx.Tracer.trace

    def counted(self, root, *args, **kwargs):
        graph = trace(self, root, *args, **kwargs)
        made.append(type(root).__name__)
        return graph
    monkeypatch.setattr(fx.Tracer, "trace", counted)
    return made


@pytest.fixture
def raced(monkeypatch):
    """Every pipeline predicted faster than the model and measured slower: the race runs on the
    shortlist, then the model as is is realized (whatever this machine's timings)."""
    shortlists = []
    monkeypatch.setattr(fxpipe.planning.measure.Baseline, "seconds", property(lambda self: 1.0))
    monkeypatch.setattr(fxpipe.planning.build, "SHORTLIST_SLACK", 100.0)     # runners-up realized too

    def race(plans, model, recipe):
        shortlists.append(plans)
        return Race((0.004,) * len(plans), 0.002, 3)
    monkeypatch.setattr(fxpipe.planning.build, "race", race)
    return shortlists


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("num_stages", [2, "auto"])
def test_one_capture_per_mode(captures, raced, training, num_stages):
    torch.manual_seed(0)
    model, x = Mlp().train(training), torch.randn(8, 16)
    with fxpipe.compile(model, ["cpu"] * 2, (x,), num_stages=num_stages, chunks="auto") as pipe:
        assert captures == ["Mlp"]
        if num_stages == "auto":       # the race ran, on several plans, then the model as is
            assert len(raced) == 1 and len(raced[0]) >= 2 and pipe.plan.runs_as_is
        pipe.train(not training)       # the other mode: one capture more
        assert captures == ["Mlp"] * 2
        pipe.train(training)           # back: planned already
        assert captures == ["Mlp"] * 2


def test_the_whole_batch_retry_captures_once(captures):
    torch.manual_seed(0)
    model, x = Mixing().eval(), torch.randn(8, 16)
    with fxpipe.compile(model, ["cpu"] * 2, (x,)) as pipe:    # 2 per stage: a BatchError
        assert pipe.plan.chunks == 1
        torch.testing.assert_close(pipe(x), model(x))
    assert captures == ["Mixing"]


def test_realize_leaves_the_prepared_graph_as_it_was(monkeypatch):
    """Each plan is cut from a copy: the prepared graph keeps its nodes (none split) and the
    model's tensors, while the plan's graph holds what its stages hold."""
    recipes = []
    of = fxpipe.planning.recipe.Recipe.of
    monkeypatch.setattr(fxpipe.planning.recipe.Recipe, "of",
                        staticmethod(lambda *args: recipes.append(of(*args)) or recipes[-1]))
    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(8, 16)
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), verify=False)
    (prepared,) = recipes[0].prepared.values()
    gm = prepared.gm
    assert plan.graph is not gm and plan.graph.graph is not gm.graph
    copied = graph_copy(gm)
    assert [n.name for n in copied.graph.nodes] == [n.name for n in gm.graph.nodes]
    assert copied.code == gm.code and copied.meta == gm.meta
    own = dict(model.named_parameters())
    assert all(t is own[name] for name, t in gm.named_parameters())


def test_recipe_is_frozen():
    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(8, 16)
    with fxpipe.compile(model, ["cpu"] * 2, (x,)) as pipe:
        with pytest.raises(AttributeError):
            pipe._recipe.options = None


def test_a_fitted_cost_lies_between_the_measured_ones():
    low = NodeCost(fwd_s=1.0, bwd_s=2.0, out_bytes=100, saved_bytes=10, new_bytes=None)
    high = NodeCost(fwd_s=3.0, bwd_s=6.0, out_bytes=300, saved_bytes=30, new_bytes=300)
    assert fit_cost(low, high, 0.0) == low
    assert fit_cost(low, high, 0.5) == NodeCost(fwd_s=2.0, bwd_s=4.0, out_bytes=200,
                                                saved_bytes=20, new_bytes=None)
    assert fit_cost(low, high, 1.0) == replace(high, new_bytes=None)


def scripted_costs(monkeypatch, seconds):
    """Each node measured to cost `seconds(rows)` forward and backward (the rest as measured),
    whatever this machine's timings; returns the (chunks, worker) measured, in order."""
    measured = []
    measure = fxpipe.planning.measure.Costs._measure

    def scripted(self, chunks, device, worker):
        found = measure(self, chunks, device, worker)
        measured.append((chunks, worker))
        s = seconds(self.rows(chunks))
        return {n: replace(cost, fwd_s=s, bwd_s=s) for n, cost in found.items()}
    monkeypatch.setattr(fxpipe.planning.measure.Costs, "_measure", scripted)
    return measured


def test_auto_measures_the_ends_and_the_chosen_size_where_costs_are_affine_in_rows(
        monkeypatch, raced):
    """Node costs affine in rows (a fixed cost per call, then per row): the fewest and the
    most micro-batches are measured, the sizes between weighed on costs fitted between them,
    and only the one chosen is measured before it is realized; the race takes the measured."""
    measured = scripted_costs(monkeypatch, lambda rows: 1.5e-3 + 1e-3 * rows)
    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(8, 16)
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), num_stages="auto", chunks="auto")
    chosen = raced[0][0].record.chosen.config         # chosen on its prediction, then raced
    assert chosen.chunks not in (1, 8)        # a size between the ends
    pipelined = [c for c, worker in measured if worker]
    assert pipelined == [1, 8, chosen.chunks]
    assert all(p.record.chosen.config.chunks in pipelined for p in raced[0])
    exact = {c.config.chunks: c.predicted_s for c in plan.record.considered[:-1]}
    assert exact[chosen.chunks] == min(exact.values())


def test_auto_measures_every_size_where_the_fit_is_off(monkeypatch, raced):
    """Costs far from affine in rows (the sizes between the ends three times what the ends'
    fit says, as where a kernel changes with the size): the size chosen on the fit, measured,
    is predicted far from its fitted prediction, and every size is measured before the
    choice."""
    measured = scripted_costs(monkeypatch, lambda rows: (2e-3 + 1e-3 * rows) *
                              (1 if rows in (1, 8) else 3))
    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(8, 16)
    fxpipe.plan(model, ["cpu"] * 2, (x,), num_stages="auto", chunks="auto")
    assert sorted(c for c, worker in measured if worker) == [1, 2, 4, 8]


def test_the_model_as_is_takes_its_own_time_over_the_nodes_a_pipeline_measured_at_its_rows(
        monkeypatch, raced):
    """The model as is is not measured node by node on its threads: its nodes are those a
    pipeline's stage measured at the whole batch's rows, scaled to add up to its own measured
    time (scripted 1 s here), and its plan says so."""
    scripted_costs(monkeypatch, lambda rows: 1.5e-3 + 1e-3 * rows)
    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(8, 16)
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), num_stages="auto", chunks="auto")
    kind = plan.partition.devices[0].kind         # the caller's threads
    assert plan.runs_as_is
    assert not [key for key in plan.record.measurements if key[1] == kind and not key[2]]
    assert plan.partition.stages[0].time_s == pytest.approx(1.0, rel=1e-3)   # and hand-offs
    assert "measured one by one for a pipeline stage" in str(plan)
