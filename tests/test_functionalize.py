import operator

import torch
import torch.fx as fx
from torch import nn

from passes.functionalize import functionalize


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


def test_inputs_are_not_written():
    def f(x):
        x.add_(1)
        return x * 2
    gm = functionalize(fx.symbolic_trace(f))
    x = torch.zeros(3)
    torch.testing.assert_close(gm(x), torch.full((3,), 2.0))
    torch.testing.assert_close(x, torch.zeros(3))


def test_setitem_writes_a_copy():
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.mul, (x, 2.0))
    graph.call_function(operator.setitem, (y, 0, 5.0))
    graph.output(graph.call_function(torch.add, (y, 1.0)))
    gm = functionalize(fx.GraphModule(nn.Module(), graph))
    x = torch.ones(3)
    torch.testing.assert_close(gm(x), torch.tensor([6.0, 3.0, 3.0]))
