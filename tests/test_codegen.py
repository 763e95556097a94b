import pytest
import torch
import torch.fx as fx
from hypothesis import given, strategies as st
from torch import nn

from fxpipe.passes.codegen import split_stages
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.passes.errors import PartitionError


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(8, 2)

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        g = self.b(h) + y
        return {"out": self.c(torch.cat([h, g], dim=1)), "h": h}


def computing(gm):
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def run_stages(stages, inputs):
    env = dict(inputs)
    for stage in stages:
        out = stage.module(*(env[name] for name in stage.inputs))
        env.update(zip(stage.outputs, out))
    return env


@given(st.data())
def test_any_forward_assignment_gives_stages_that_compose_to_the_model(data):
    model = Branchy()
    gm = fx.symbolic_trace(model)
    k = data.draw(st.integers(1, 4))
    stage_of, current = {}, 0
    for n in computing(gm):             # a non-decreasing stage along the graph order
        current = data.draw(st.integers(current, k - 1))
        stage_of[n.name] = current
    stages = split_stages(gm, stage_of, ["cpu"] * k)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    env = run_stages(stages, {"x": x, "y": y})
    expected = model(x, y)
    assert_same_up_to_rounding(env["c"], expected["out"])
    assert_same_up_to_rounding(env["relu"], expected["h"])
    # every node in exactly one stage, under its own name
    names = [n.name for s in stages for n in computing(s.module)]
    assert sorted(names) == sorted(n.name for n in computing(gm))


def test_parameters_live_in_exactly_one_stage():
    gm = fx.symbolic_trace(Branchy())
    stage_of = {n.name: (0 if n.name in ("a", "relu") else 1) for n in computing(gm)}
    first, second = split_stages(gm, stage_of, ["cpu", "cpu"])
    assert {k for k, _ in first.module.named_parameters()} == {"a.weight", "a.bias"}
    assert {k for k, _ in second.module.named_parameters()} == {
        "b.weight", "b.bias", "c.weight", "c.bias"}
    assert first.outputs == ("relu",) and second.inputs == ("relu", "y")


def test_a_value_is_sent_straight_to_the_stage_that_reads_it():
    gm = fx.symbolic_trace(Branchy())
    order = [n.name for n in computing(gm)]
    stage_of = {name: min(i, 2) for i, name in enumerate(order)}   # a, relu, then the rest
    stages = split_stages(gm, stage_of, ["cpu"] * 3)
    assert "relu" in stages[2].inputs          # read by cat in stage 2, skipping stage 1... 
    assert stages[1].outputs == ("relu",)      # ...relu is produced by stage 1 only once
    assert stages[0].outputs == ("a",)


def test_backward_edges_are_refused():
    gm = fx.symbolic_trace(Branchy())
    stage_of = {n.name: 1 for n in computing(gm)}
    stage_of["c"] = 0
    with pytest.raises(PartitionError, match="later stage"):
        split_stages(gm, stage_of, ["cpu", "cpu"])


def test_stage_code_is_readable_python_with_the_models_names():
    gm = fx.symbolic_trace(Branchy())
    stage_of = {n.name: (0 if n.name in ("a", "relu") else 1) for n in computing(gm)}
    _, second = split_stages(gm, stage_of, ["cpu", "cpu"])
    assert "def forward(self, relu, y):" in second.module.code
    assert "self.c(cat)" in second.module.code
    assert type(second.module).__name__ == "Stage1"


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.tanh(torch.tanh(x @ self.w) @ self.w) @ self.w


def test_a_parameter_read_on_another_device_is_sent_once_from_its_home():
    from fxpipe.runtime.wiring import Wiring

    gm = fx.symbolic_trace(Tied())
    order = [n.name for n in computing(gm) if n.op != "get_attr"]   # matmul, tanh, matmul_1, ...
    stage_of = {name: min(i // 2, 2) for i, name in enumerate(order)}
    # stages 0 and 2 share a device, stage 1 is elsewhere ("meta": nothing runs, wiring only)
    stages = split_stages(gm, stage_of, ["cpu", "meta", "cpu"])
    readers = [s for s in stages if any(n.op != "get_attr" and "w" in [a.name for a in n.all_input_nodes]
                                        for n in s.module.graph.nodes)]
    assert len(readers) == 3
    assert "w" in stages[0].outputs and "w" not in stages[2].outputs     # sent by its home only
    assert "w" in stages[1].inputs and "w" not in stages[2].inputs       # a copy where it lives
    assert Wiring.of(stages, ["matmul_2"]).producer["w"] == 0
