"""Planning captures the model once per mode (`fxpipe.planning.prepare`): a fixed or an "auto" compile,
its race and its whole-batch retry included, plans from one prepared graph; `pipe.train()` /
`pipe.eval()` captures once more, in the other mode. That the plans equal the model is what the
rest of the suite checks."""

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxpipe
import fxpipe.api
import fxpipe.planning.build
import fxpipe.planning.measure
from fxpipe.planning.measure import Race
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
