"""End to end: fxpipe.compile on generated and hand-written models, and its errors."""

import platform
import threading

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import fxpipe
from fxpipe.testing import assert_pipeline_matches, assert_same_up_to_rounding, models


@given(models(max_nodes=14), st.integers(1, 4), st.integers(1, 5))
def test_generated_models_match_on_any_stage_and_chunk_count(case, num_stages, chunks):
    model, inputs = case
    chunks = min(chunks, inputs[0].shape[0])
    num_nodes = len([n for n in torch.fx.symbolic_trace(model).graph.nodes
                     if n.op not in ("placeholder", "output", "get_attr")])
    num_stages = min(num_stages, num_nodes)
    pipe = assert_pipeline_matches(model, inputs, devices=["cpu"] * num_stages, chunks=chunks)

    stage_of = pipe.plan.partition.stage_of
    computing = [n.name for n in pipe.module.graph.nodes
                 if n.op not in ("placeholder", "output", "get_attr")]
    assert sorted(stage_of) == sorted(computing)              # every node in exactly one stage
    in_stages = [n.name for s in pipe.stages for n in s.graph.nodes
                 if n.op not in ("placeholder", "output", "get_attr")]
    assert sorted(in_stages) == sorted(computing)
    for stage in pipe.stages:           # parameter reads are copied to the stages that read them
        for n in stage.graph.nodes:
            if n.op == "get_attr":
                assert n.users
    for stage in pipe.stage_info:                                # no value flows backwards
        for name in stage.inputs:
            assert stage_of.get(name, -1) < stage.index


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.left = nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True))
        self.right = nn.Linear(width, width)
        self.norm = nn.LayerNorm(2 * width)

    def forward(self, x):
        return self.norm(torch.cat([self.left(x) + x, self.right(x)], dim=1))


class Net(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.blocks = nn.ModuleList(
            [Block(width), nn.Linear(2 * width, width), Block(width), nn.Linear(2 * width, 4)])

    def forward(self, x, bias=None):
        for block in self.blocks:
            x = block(x)
        return {"logits": x, "bias": bias} if bias is None else {"logits": x + bias}


def test_keyword_inputs_and_uneven_batches():
    model = Net().eval()
    x, bias = torch.randn(7, 16), torch.randn(7, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), {"bias": bias}, chunks=3)
    assert_same_up_to_rounding(pipe(x, bias=bias), model(x, bias=bias))
    assert_same_up_to_rounding(pipe(x[:5], bias=bias[:5]), model(x[:5], bias=bias[:5]))


def test_gradients_flow_through_the_pipeline_like_through_the_model():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    assert_pipeline_matches(model, (x,), devices=["cpu"] * 4, chunks=4, backward=True)


def test_all_stages_work_on_every_micro_batch():
    model, x = Net().eval(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 4, (x,), chunks=4)
    pipe(x)
    ran = sorted((e.action.stage, e.action.microbatch) for e in pipe.last_run.slots)
    assert ran == [(s, m) for s in range(4) for m in range(4)]


def test_the_plan_is_a_table_and_stage_code_is_printable():
    model, x = Net().eval(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2)
    text = str(pipe.plan)
    for column in ("stage", "device", "nodes", "predicted ms", "params MB", "sent"):
        assert column in text
    assert "captured by fx" in text
    assert pipe.stages[1].code.lstrip().startswith("def forward(self")


def test_state_dict_uses_the_models_names_and_loads_back():
    model, x = Net().eval(), torch.randn(4, 16)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2)
    assert set(pipe.state_dict()) == set(model.state_dict())
    assert {n for n, _ in pipe.named_parameters()} == {n for n, _ in model.named_parameters()}
    fresh = Net()
    fresh.load_state_dict(pipe.state_dict())
    assert_same_up_to_rounding(fresh.eval()(x), model(x))


# ---- bad input gets a clear FxpipeError ---------------------------------------------------------

@pytest.mark.parametrize("devices, message", [
    ([], "no devices"),
    (["banana"], "not a device"),
    ([f"cuda:{torch.cuda.device_count()}"], "does not exist"),   # one past the last GPU here
    (["meta"], "not supported"),
])
def test_bad_devices_are_refused(devices, message):
    with pytest.raises(fxpipe.DeviceError, match=message):
        fxpipe.compile(Net(), devices, (torch.randn(4, 16),))


def test_more_stages_than_the_graph_can_fill_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(fxpipe.PartitionError, match="too few for 5 stages"):
        fxpipe.compile(model, ["cpu"] * 5, (torch.randn(4, 4),))


def test_an_example_smaller_than_chunks_is_refused_but_a_smaller_call_runs_per_row():
    with pytest.raises(fxpipe.BatchError, match="2 rows cannot be split into 4"):
        fxpipe.compile(Net(), ["cpu"], (torch.randn(2, 16),), chunks=4)
    model = Net().eval()
    pipe = fxpipe.compile(model, ["cpu"], (torch.randn(4, 16),), chunks=4)
    x = torch.randn(3, 16)     # see tests/test_small_batch.py
    assert_same_up_to_rounding(pipe(x), model(x))
    assert pipe.last_run.microbatches == 3


class Double(nn.Module):
    def forward(self, x):
        return x * 2


def test_inputs_without_a_batch_dimension_are_refused():
    with pytest.raises(fxpipe.BatchError, match="no input has a batch dimension"):
        fxpipe.compile(Double(), ["cpu"], (torch.tensor(1.0),), chunks=2)


class Untraceable(nn.Module):
    def forward(self, x):
        while x.norm() > 1:
            x = x / 2
        return x


def test_an_untraceable_model_is_refused_with_its_source_line():
    with pytest.raises(fxpipe.TraceError, match="while x.norm"):
        fxpipe.compile(Untraceable(), ["cpu"], (torch.randn(2, 3),))


class Boom(nn.Module):
    def forward(self, x):
        if x.abs().max() > 100:
            raise ValueError("input too large")
        return x


class Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.boom = Boom()

    def forward(self, x):
        return self.boom(self.second(torch.relu(self.first(x))))


def test_a_failing_stage_is_named_and_the_pipeline_stays_usable():
    model, x = Fragile().eval(), torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=4)
    stage = pipe.plan.partition.stage_of["boom"]
    threads_before = set(threading.enumerate())
    bad = x.clone()
    bad[5] = 1e6       # lands in micro-batch 2
    with pytest.raises(fxpipe.StageError, match=rf"stage {stage} .* micro-batch 2[\s\S]*input too large") as info:
        pipe(bad)
    assert info.value.stage == stage and info.value.microbatch == 2
    workers = pipe._runtime.workers.threads
    assert set(threading.enumerate()) - threads_before == set(workers)   # parked, no others
    assert_same_up_to_rounding(pipe(x), model(x))
    assert pipe._runtime.workers.threads == workers                      # the same ones
    pipe.close()
    assert set(threading.enumerate()) == threads_before


def test_moving_a_pipeline_is_refused():
    pipe = fxpipe.compile(Net().eval(), ["cpu"], (torch.randn(2, 16),))
    with pytest.raises(fxpipe.FxpipeError, match="compile"):
        pipe.to("cpu")


class OneHeavyLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.heavy = nn.Linear(1024, 1024)

    def forward(self, x):
        h = self.heavy(x)                       # one node, split at most in its features
        for _ in range(6):
            h = torch.tanh(h) * 0.5
        return h


def test_auto_stage_count_stops_where_more_devices_stop_helping():
    model, x = OneHeavyLayer().eval(), torch.randn(256, 1024)
    auto = fxpipe.compile(model, ["cpu"] * 8, (x,), num_stages="auto")
    # Split along its features, the layer's parts run side by side on the input, the tail after
    # them. Whatever this machine's timings, the plan predicts the fewest stages within 2% of
    # the fastest, races it (and the runners-up) against the model and keeps the one measured
    # fastest, or the model as is where no pipeline is predicted (or measured) faster than it.
    plan, tie = auto.plan, fxpipe.planning.search.TIE
    pipelines = [c for c in plan.record.considered if c is not plan.record.considered[-1]]
    best_s = min(c.predicted_s for c in pipelines)
    fewest = min(c.config.num_stages for c in pipelines if c.predicted_s <= best_s * (1 + tie))
    if plan.runs_as_is:     # measured slower, on a machine too busy to tell, or predicted so
        assert plan.runs in (fxpipe.plans.plan_data.Runs.AS_IS_MEASURED,
                             fxpipe.plans.plan_data.Runs.AS_IS_BUSY) or \
            plan.record.considered[-1].predicted_s <= best_s / (1 - tie)
    else:
        raced = plan.record.raced[:-1]          # the pipelines raced (the model as is last)
        assert raced[0][0].num_stages == fewest
        assert plan.record.chosen.config == min(raced, key=lambda row: row[2])[0]
        assert plan.partition.num_stages == plan.record.chosen.config.num_stages
    every = fxpipe.compile(model, ["cpu"] * 8, (x,))
    assert every.plan.partition.num_stages == 8
    two = fxpipe.compile(model, ["cpu"] * 8, (x,), num_stages=2)
    assert two.plan.partition.num_stages == 2 and len(two.stages) == 2
    with pytest.raises(fxpipe.PartitionError, match="num_stages=9"):
        fxpipe.compile(model, ["cpu"] * 8, (x,), num_stages=9)


def test_the_plan_names_the_modules_each_stage_runs():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)]).eval()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (torch.randn(4, 8),))
    runs = pipe.plan.record.stage_modules
    assert [r[0].split("-")[0] for r in runs] == ["0", runs[1][0].split("-")[0]]
    assert all(len(r) == 1 and "-" in r[0] for r in runs)      # e.g. ("0-3",), ("4-7",)


def test_tuning_the_cpu_allocator_works_on_glibc_and_keeps_results_the_same():
    model, x = Net().eval(), torch.randn(8, 16)
    assert fxpipe.tune_cpu_allocator() == (platform.libc_ver()[0] == "glibc")
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    assert_same_up_to_rounding(pipe(x), model(x))


def test_autocast_reaches_the_stages():
    model, x = Net().eval(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, actual = model(x), pipe(x)
    assert actual["logits"].dtype == expected["logits"].dtype == torch.bfloat16
    assert_same_up_to_rounding(actual["logits"], expected["logits"])
