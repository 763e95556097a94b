import pytest
import torch
import torch.fx as fx
from torch import nn

from passes.annotate_costs import annotate_costs, bind_inputs
from passes.cost_model import NodeCost
from passes.errors import CostError, InputError


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(self.lin(x)))   # `lin` is called twice


def test_every_node_gets_a_cost_with_output_bytes():
    gm = annotate_costs(fx.symbolic_trace(Shared()), (torch.randn(8, 4),), repeats=2)
    for n in gm.graph.nodes:
        if n.op != "output":
            assert isinstance(n.meta["cost"], NodeCost) and n.meta["cost"].fwd_s > 0
            assert n.meta["cost"].out_bytes == 8 * 4 * 4


def test_parameters_are_counted_once_at_their_first_user():
    gm = annotate_costs(fx.symbolic_trace(Shared()), (torch.randn(8, 4),), repeats=1)
    owned = {n.name: n.meta["cost"].param_bytes for n in gm.graph.nodes if n.op != "output"}
    assert owned == {"x": 0, "lin": (16 + 4) * 4, "lin_1": 0,
                     "bn": (4 + 4 + 4 + 4) * 4 + 8}     # weight, bias, mean, var; int64 count


def test_buffers_the_model_updates_are_restored():
    model = Shared().train()
    gm = fx.symbolic_trace(model)
    annotate_costs(gm, (torch.randn(8, 4) + 5,), repeats=3)
    torch.testing.assert_close(model.bn.running_mean, torch.zeros(4))
    assert model.bn.num_batches_tracked.item() == 0


def test_a_failing_node_is_named():
    def f(x):
        return torch.matmul(x, x)      # (3, 4) @ (3, 4) does not fit
    with pytest.raises(CostError, match="matmul"):
        annotate_costs(fx.symbolic_trace(f), (torch.randn(3, 4),), repeats=1)


def test_inputs_bind_by_position_keyword_and_default():
    def f(a, b, c=2.0):
        return a * b + c
    gm = fx.symbolic_trace(f)
    assert bind_inputs(gm, (1.0,), {"b": 3.0}) == [1.0, 3.0, 2.0]
    with pytest.raises(InputError, match="'b'"):
        bind_inputs(gm, (1.0,), {})
    with pytest.raises(InputError, match="not inputs"):
        bind_inputs(gm, (1.0, 2.0), {"d": 1})
