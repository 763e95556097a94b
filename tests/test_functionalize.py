import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.passes.errors import TraceError
from fxpipe.passes.functionalize import functionalize


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.lin(x)
        skip = h * 1.0
        h += skip                  # fx records an out-of-place add
        h = self.relu(h)           # in-place module
        h.mul_(2)                  # in-place method
        return h + x


def test_in_place_ops_become_out_of_place_with_the_same_result():
    model, x = InPlace(), torch.randn(3, 4)
    gm = functionalize(fx.symbolic_trace(model))
    code = gm.code
    assert ".mul_(" not in code and ".mul(" in code
    assert gm.relu.inplace is False
    torch.testing.assert_close(gm(x), model(x))


def test_the_users_model_keeps_its_in_place_module():
    model = InPlace()
    functionalize(fx.symbolic_trace(model))
    assert model.relu.inplace is True


def test_readers_after_a_mutation_read_the_new_value():
    def f(x):
        y = x * 2
        before = y + 1
        y.add_(10)
        return before, y * 3
    gm = functionalize(fx.symbolic_trace(f))
    x = torch.randn(5)
    torch.testing.assert_close(gm(x), f(x))
    (mul_3,) = [n for n in gm.graph.nodes if n.name == "mul_1"]
    assert mul_3.args[0].name == "add_"     # reads the mutation's result, not the stale value


@pytest.mark.parametrize("examples", [True, False], ids=["storage", "name"])
def test_a_write_on_an_input_or_a_view_of_one_is_refused_by_the_inputs_name(examples):
    def f(x):
        x[0].add_(1)
        return x * 2
    x = torch.zeros(3, 2)
    with pytest.raises(TraceError, match=r"writes in place on its input 'x'(.|\n)*"
                                         r"copy the input first: `x = x\.clone\(\)`"):
        functionalize(fx.symbolic_trace(f), (x,) if examples else None)
    torch.testing.assert_close(x, torch.zeros(3, 2))


def test_setitem_writes_a_copy():
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.mul, (x, 2.0))
    graph.call_function(operator.setitem, (y, 0, 5.0))
    graph.output(graph.call_function(torch.add, (y, 1.0)))
    gm = functionalize(fx.GraphModule(nn.Module(), graph))
    x = torch.ones(3)
    torch.testing.assert_close(gm(x), torch.tensor([6.0, 3.0, 3.0]))


# ---- aliases: a write on shared memory is an error, never a silent wrong answer -----------------

def with_stack_traces(model):
    tracer = fx.Tracer()
    tracer.record_stack_traces = True
    return fx.GraphModule(model, tracer.trace(model))


class WritesAView(nn.Module):
    def forward(self, x):
        h = x * 1
        y = torch.unsqueeze(h, 0)
        y.add_(1)                  # also changes h
        return h * 2


class ViewBeforeWrite(nn.Module):
    def forward(self, x):
        h = x * 1
        v = h[:, 0]
        h.add_(1)                  # also changes v
        return v * 2


@pytest.mark.parametrize("model, examples", [(ViewBeforeWrite(), True), (ViewBeforeWrite(), False),
                                             (WritesAView(), False)], ids=type)
def test_a_write_on_memory_another_value_reads_later_is_an_error(model, examples):
    x = torch.randn(3, 4)
    with pytest.raises(TraceError, match=r"'add_'.*read afterwards(.|\n)*h = h \+ 1"):
        functionalize(fx.symbolic_trace(model), (x,) if examples else None)


def test_a_write_through_a_view_is_carried_back_to_the_value_it_views():
    x = torch.randn(3, 4)
    gm = functionalize(fx.symbolic_trace(WritesAView()), (x,))
    assert ".add_(" not in gm.code
    torch.testing.assert_close(gm(x), WritesAView()(x))


def test_the_error_points_at_the_source_line():
    with pytest.raises(TraceError, match=r"test_functionalize\.py\", line \d+(.|\n)*h\.add_\(1\)"):
        functionalize(with_stack_traces(ViewBeforeWrite()), (torch.randn(3, 4),))


VIEWS = {
    "unsqueeze": lambda h: torch.unsqueeze(h, 0), "reshape": lambda h: torch.reshape(h, (-1,)),
    "squeeze": lambda h: torch.squeeze(h), "permute": lambda h: torch.permute(h, (1, 0)),
    "chunk": lambda h: torch.chunk(h, 2)[0], ".T": lambda h: h.T,
    "contiguous": lambda h: h.contiguous(), "flatten": lambda h: h.flatten(),
    "Identity": nn.Identity(), "Flatten": nn.Flatten(0),
}


# Views whose write functionalize carries back to the viewed value when it runs the example.
CARRIED_BACK = {"unsqueeze", "reshape", "squeeze", "permute", "contiguous", "flatten"}


def writes_through(view):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.view = view if isinstance(view, nn.Module) else None

        def forward(self, x):
            h = x * 1
            y = self.view(h) if self.view is not None else view(h)
            y.mul_(3)
            return h + 1
    return M()


@pytest.mark.parametrize("name, view", VIEWS.items(), ids=VIEWS.keys())
@pytest.mark.parametrize("examples", [True, False], ids=["storage", "name"])
def test_every_spelling_of_a_view_is_an_alias(name, view, examples):
    x = torch.randn(4, 4)
    if examples and name in CARRIED_BACK:
        gm = functionalize(fx.symbolic_trace(writes_through(view)), (x,))
        torch.testing.assert_close(gm(x), writes_through(view)(x))
        return
    with pytest.raises(TraceError, match="read afterwards"):
        functionalize(fx.symbolic_trace(writes_through(view)), (x,) if examples else None)


def test_a_written_view_whose_base_is_not_read_again_is_rewritten():
    def f(x):
        h = (x * 2).view(-1)       # the base, x * 2, has no other reader
        h.add_(1)
        return h * 3
    for examples in [(torch.randn(3, 4),), None]:
        gm = functionalize(fx.symbolic_trace(f), examples)
        assert ".add_(" not in gm.code
        x = torch.randn(3, 4)
        torch.testing.assert_close(gm(x), f(x))


def test_example_inputs_tell_a_copy_from_a_view():
    def f(x):
        h = x.t()                  # not contiguous: contiguous() copies
        y = h.contiguous()
        y.add_(1)
        return h * 2, y
    with pytest.raises(TraceError):                      # by name, contiguous may be a view
        functionalize(fx.symbolic_trace(f))
    x = torch.randn(3, 4)
    gm = functionalize(fx.symbolic_trace(f), (x,))
    torch.testing.assert_close(gm(x), f(x))


def test_running_the_example_leaves_inputs_and_buffers_as_they_were():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(inplace=True)).train()
    x = torch.randn(8, 4)
    before, given = model[1].running_mean.clone(), x.clone()
    functionalize(fx.symbolic_trace(model), (x,))
    torch.testing.assert_close(model[1].running_mean, before)
    assert model[1].num_batches_tracked.item() == 0
    torch.testing.assert_close(x, given)


def test_writes_to_buffers_stay():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return x * 2
    model, tracer = Counter(), fx.Tracer()
    tracer.proxy_buffer_attributes = True          # else fx reads the buffer while tracing
    gm = functionalize(fx.GraphModule(model, tracer.trace(model)), (torch.randn(3),))
    assert ".add_(" in gm.code and model.calls.item() == 0
    gm(torch.randn(3))
    assert model.calls.item() == 1


# ---- every spelling of an in-place op ------------------------------------------------------------

def check_rewritten(f, *inputs, absent=("_(", "inplace = True")):
    """`f` traced and functionalized (with and without example inputs) computes what `f` does,
    with no in-place op left."""
    for examples in [inputs, None]:
        gm = functionalize(fx.symbolic_trace(f), examples)
        for spelling in absent:
            assert spelling not in gm.code, gm.code
        fresh = [t.clone() for t in inputs]
        torch.testing.assert_close(gm(*fresh), f(*[t.clone() for t in inputs]))


def test_functional_calls_with_inplace_true():
    def f(x):
        h = x * 1
        r = F.relu(h, inplace=True)
        s = F.leaky_relu(h * 2, 0.1, True)         # inplace given positionally
        return h + 1, r, s
    check_rewritten(f, torch.randn(3, 4))


def test_zero_fill_and_copy():
    def f(x, src):
        a, b, c, d = x * 1, x * 2, x * 3, x * 4
        a.zero_()
        b.fill_(2.5)
        c.fill_(src[0, 0])                          # a 0-dim tensor value
        d.copy_(src[0])                             # broadcast over the rows
        e = (x * 5).long()
        e.copy_(src)                                # and cast to e's dtype
        return a + 1, b + 1, c + 1, d + 1, e + 1
    check_rewritten(f, torch.randn(3, 4), torch.randn(3, 4) * 10)


def test_random_writes_draw_the_same_numbers():
    def f(x):
        h = x * 1
        h.uniform_(-1, 1)
        g = x * 1
        g.bernoulli_(0.5)
        return h + 1, g + 1
    x = torch.randn(3, 4)
    for examples in [(x,), None]:
        gm = functionalize(fx.symbolic_trace(f), examples)
        assert ".uniform_(" not in gm.code and "on_copy(" in gm.code
        torch.manual_seed(0)
        expected = f(x)
        torch.manual_seed(0)
        torch.testing.assert_close(gm(x), expected)


def test_requires_grad_is_not_a_write_and_stays():
    def f(x):
        h = x.detach()
        h.requires_grad_()
        return h * 2
    gm = functionalize(fx.symbolic_trace(f), (torch.randn(3),))
    assert ".requires_grad_()" in gm.code
    out = gm(torch.randn(3))
    assert out.requires_grad


# ---- end to end ---------------------------------------------------------------------------------

class ReluThenChain(nn.Module):
    """The in-place relu's result is read at the end; h's other reader, a long chain, starts
    right away: without functionalize the relu lands in the last stage and the chain reads h
    before it is written."""

    def __init__(self, width=32, depth=8):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.chain = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                     for _ in range(depth)])

    def forward(self, x):
        h = self.inp(x)
        r = F.relu(h, inplace=True)
        return self.chain(h) + r


def test_compile_pipelines_an_inplace_relu_read_by_a_later_stage():
    torch.manual_seed(0)
    model, x = ReluThenChain().eval(), torch.randn(8, 32)
    with torch.no_grad():
        expected = model(x.clone())
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, repeats=1)
    first, last = pipe.stages[0].code, pipe.stages[-1].code
    assert "inplace = True" not in first + last
    assert "chain" in first and "chain" in last    # the chain spans both stages
    with torch.no_grad():
        assert_same_up_to_rounding(pipe(x), expected)
