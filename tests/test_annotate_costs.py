import types

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxpipe.passes.device as device_module
from fxpipe.passes.annotate_costs import UNSTEADY, annotate_costs, bind_inputs, measurement_spread
from fxpipe.passes.capture import trace
from fxpipe.passes.cost_model import NodeCost
from fxpipe.passes.errors import CostError, InputError


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


def test_progress_counts_each_node_of_a_run_once_up_to_the_total():
    calls = []
    annotate_costs(fx.symbolic_trace(Shared()), (torch.randn(8, 4),), repeats=2,
                   progress=lambda done, total: calls.append((done, total)))
    total = calls[0][1]
    assert total == 4                     # x, lin, lin_1, bn: the output is not a node measured
    assert [done for done, _ in calls] == [1, 2, 3, 4] * (len(calls) // 4)


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


SCRIPT = {"durations_s": [], "calls": 0, "elapsed_s": 0.0}  # outside the module: no side effect


class Scripted(torch.nn.Module):
    """A leaf that takes a scripted sequence of durations, one per call, on the measuring clock.

    The durations advance a clock of the test's own rather than sleeping, so the timings read
    are the script's, exactly, however busy the machine is."""

    def forward(self, x):
        durations = SCRIPT["durations_s"]
        SCRIPT["elapsed_s"] += durations[min(SCRIPT["calls"], len(durations) - 1)]
        SCRIPT["calls"] += 1
        return x + 1


class Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.slow = Scripted()

    def forward(self, x):
        return self.slow(x) * 2


@pytest.fixture
def scripted_clock(monkeypatch):
    """annotate_costs reads a clock (its timers', `fxpipe.passes.device`) on which only the
    scripted leaf takes time."""
    clock = types.SimpleNamespace(perf_counter=lambda: SCRIPT["elapsed_s"])
    monkeypatch.setattr(device_module, "time", clock)


def scripted_graph(durations_s):
    SCRIPT["durations_s"] = [0.0]
    gm = trace(Holder(), (torch.randn(2, 2),), {}, leaf_modules=[Scripted])
    SCRIPT.update(durations_s=list(durations_s), calls=0)
    return gm


def calls():
    return SCRIPT["calls"]


def test_one_disturbed_repeat_moves_neither_the_cost_nor_the_number_of_runs_much(scripted_clock):
    # warm-up, then 5 repeats of which one is disturbed 20x, then steady runs
    gm = scripted_graph([0.01] * 3 + [0.2] + [0.01] * 20)
    annotate_costs(gm, (torch.randn(2, 2),), repeats=5)
    cost = next(n for n in gm.graph.nodes if n.target == "slow").meta["cost"]
    assert cost.fwd_s == pytest.approx(0.01)          # the median, not the disturbed repeat
    runs = calls()
    assert 1 + 5 < runs <= 1 + 15                    # unsteady: taken again, within the budget
    assert cost.spread < UNSTEADY                      # and steady once the outlier is a tail


def test_the_spread_is_read_off_the_repeats_and_bounded_runs_stop_there(scripted_clock):
    gm = scripted_graph([0.01, 0.01, 0.01, 0.01, 0.01, 0.03])
    annotate_costs(gm, (torch.randn(2, 2),), repeats=5, max_repeats=5)
    cost = next(n for n in gm.graph.nodes if n.target == "slow").meta["cost"]
    assert calls() == 6        # no run beyond the budget
    assert cost.spread == pytest.approx(2.0)   # (30 ms - 10 ms) / 10 ms
    assert measurement_spread(gm) == pytest.approx(cost.spread)  # the only node taking time


def test_a_steady_measurement_takes_the_repeats_asked_for(scripted_clock):
    gm = scripted_graph([0.01])
    annotate_costs(gm, (torch.randn(2, 2),), repeats=5)
    assert calls() == 6
