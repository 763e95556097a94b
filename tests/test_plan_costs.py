"""The plan is made in the conditions the stages run in, and compares itself with the model."""

import dataclasses
import threading
import time

import pytest
import torch
from torch import nn

import fxpipe
import fxpipe.planning.measure
import fxpipe.plans.prediction


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh()).eval()


@pytest.mark.parametrize("threads", [1, 2])
def test_costs_are_measured_with_the_threads_each_stage_runs_with(monkeypatch, threads):
    seen = []

    def measuring(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return annotate_costs(*args, **kwargs)

    annotate_costs = fxpipe.planning.measure.annotate_costs
    monkeypatch.setattr(fxpipe.planning.measure, "annotate_costs", measuring)
    caller = torch.get_num_threads()
    fxpipe.compile(mlp(), ["cpu", "cpu"], (torch.randn(8, 16),), chunks=2,
                   threads_per_stage=threads)
    assert seen == [threads]
    assert torch.get_num_threads() == caller


@pytest.mark.parametrize("devices", [1, 2])
def test_costs_are_measured_on_the_thread_the_stages_run_on(monkeypatch, devices):
    seen = []

    def measuring(*args, **kwargs):
        seen.append(threading.current_thread() is threading.main_thread())
        return annotate_costs(*args, **kwargs)

    annotate_costs = fxpipe.planning.measure.annotate_costs
    monkeypatch.setattr(fxpipe.planning.measure, "annotate_costs", measuring)
    fxpipe.compile(mlp(), ["cpu"] * devices, (torch.randn(8, 16),))
    assert seen == [devices == 1]     # one stage runs on the caller's thread, several on workers


class Sleeps(nn.Module):
    """A leaf whose time is known: at least 20 ms per call."""

    def forward(self, x):
        time.sleep(0.02)
        return x * 2


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.sleeps = nn.Linear(4, 4), Sleeps()

    def forward(self, x):
        return self.sleeps(self.fc(x)).relu()


def test_node_costs_are_scaled_to_the_graphs_own_time_keeping_their_proportions():
    from fxpipe.passes.cost_model import NodeCost
    from fxpipe.passes.capture import trace

    x = torch.randn(2, 4)
    gm = trace(Slow(), (x,), {}, leaf_modules=[Sleeps])
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    for i, n in enumerate(nodes):          # costs as wrong as can be: 1, 2, 3 microseconds
        n.meta["cost"] = NodeCost(fwd_s=(i + 1) * 1e-6)
    forward, _ = fxpipe.planning.measure.calibrate(gm, (x,), {}, training=False)
    times = [n.meta["cost"].fwd_s for n in nodes]
    assert sum(times) >= 0.02             # the whole graph sleeps 20 ms
    assert forward == pytest.approx(sum(times) / 6e-6)
    assert times == pytest.approx([t * 1e-6 * forward for t in (1, 2, 3)])


def test_the_plan_compares_the_pipeline_with_the_model_run_whole():
    pipe = fxpipe.compile(mlp(), ["cpu", "cpu"], (torch.randn(8, 16),), chunks=2)
    plan = pipe.plan
    predicted = max(slot.end_s for slot in pipe.predict())
    assert plan.record.predicted_step_s == pytest.approx(predicted)
    assert plan.record.unpipelined_s > 0 and plan.record.unpipelined_threads == torch.get_num_threads()
    assert plan.speedup == pytest.approx(plan.record.unpipelined_s / predicted)
    assert "model unpipelined" in str(plan)


def test_a_plan_predicted_slower_than_the_model_says_so():
    plan = fxpipe.compile(mlp(), ["cpu", "cpu"], (torch.randn(8, 16),), chunks=2).plan
    plan = plan.with_record(spread=0.0, unpipelined_spread=0.0)   # measured steadily
    work_s = sum(s.compute_s for s in plan.partition.stages) * plan.chunks   # figures that agree
    slower = plan.with_record(predicted_step_s=2 * work_s, unpipelined_s=work_s)
    faster = plan.with_record(predicted_step_s=work_s, unpipelined_s=2 * work_s)
    assert "0.50x" in str(slower) and "predicted slower than the model" in str(slower)
    assert "2.00x" in str(faster) and "slower" not in str(faster)


def test_training_plans_compare_a_training_step():
    model = mlp().train()
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 16),), chunks=2)
    assert all(p.grad is None for p in model.parameters())       # timing left .grad alone
    assert pipe.plan.record.predicted_step_s == pytest.approx(
        max(slot.end_s for slot in pipe.predict(training=True)))


class Threads(nn.Module):
    """A leaf recording the intra-op threads in effect where it runs."""

    seen: list = []

    def forward(self, x):
        Threads.seen.append(torch.get_num_threads())
        return x + 1


class TwoParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.first, self.second = Threads(), Threads()

    def forward(self, x):
        return self.second(self.b(self.first(self.a(x))))


def test_each_kind_of_device_is_measured_with_its_threads_and_runs_with_them(monkeypatch):
    measured = []

    def measuring(*args, **kwargs):
        measured.append(torch.get_num_threads())
        return annotate_costs(*args, **kwargs)

    annotate_costs = fxpipe.planning.measure.annotate_costs
    monkeypatch.setattr(fxpipe.planning.measure, "annotate_costs", measuring)
    devices = [fxpipe.DeviceSpec("cpu", threads=2), fxpipe.DeviceSpec("cpu", threads=1)]
    x = torch.randn(4, 8)
    pipe = fxpipe.compile(TwoParts().eval(), devices, (x,), leaf_modules=[Threads], chunks=1)
    assert sorted(measured) == [1, 2]
    nodes = [n for n in pipe.module.graph.nodes if "costs" in n.meta]
    assert nodes and all(set(n.meta["costs"]) == {"cpu/2", "cpu/1"} for n in nodes)
    assert [d.kind for d in pipe.plan.partition.devices] == ["cpu/2", "cpu/1"]
    stage_of = pipe.plan.partition.stage_of
    Threads.seen = []
    pipe(x)
    expected = [2 if stage_of["first"] == 0 else 1, 2 if stage_of["second"] == 0 else 1]
    assert Threads.seen == expected


def test_the_plan_shows_how_steady_the_measurement_was():
    pipe = fxpipe.compile(mlp(), ["cpu", "cpu"], (torch.randn(8, 16),), chunks=2)
    spread = pipe.plan.record.spread
    assert spread is not None and spread >= 0
    unsteady = pipe.plan.with_record(spread=1.5)
    assert "spread 150%, unsteady" in str(unsteady) and "compile again" in str(unsteady)
    assert "compile again" not in str(pipe.plan.with_record(spread=0.02,
                                                         unpipelined_spread=0.02))


def test_the_prediction_prices_each_stage_on_its_own_kind_of_device():
    devices = [fxpipe.DeviceSpec("cpu", threads=2), fxpipe.DeviceSpec("cpu", threads=1)]
    pipe = fxpipe.compile(TwoParts().eval(), devices, (torch.randn(4, 8),), chunks=2,
                          leaf_modules=[Threads])
    part = pipe.plan.partition
    for s, (device, stage) in enumerate(zip(part.devices, part.stages)):
        own = sum(n.meta["costs"][device.kind].fwd_s for n in pipe.module.graph.nodes
                  if part.stage_of.get(n.name) == s)
        assert stage.compute_s == pytest.approx(own / device.speed)
        alone = fxpipe.plans.prediction.predict_slots(part, 2, "gpipe", False, {0: [], 1: [0]})
        durations = [slot.end_s - slot.start_s for slot in alone if slot.action.stage == s]
        assert durations == pytest.approx([stage.forward_step_s] * 2)
    # 3 threads on 2 cores: where the stages overlap, they share the cores.
    end = max(slot.end_s for slot in pipe.predict())
    assert end == pytest.approx(pipe.plan.record.predicted_step_s)
    assert end >= max(slot.end_s for slot in alone)
