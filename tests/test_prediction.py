"""The plan's prediction, its arithmetic on scripted costs (hand-offs included), its claim only
where it can stand by it, and the speed-up measured in use beside it (issue 51, item 1).

Node costs, the runtime's hand-off and the model's own time are scripted, so what is tested is
the arithmetic and the rules, never this machine's timings.
"""

import dataclasses
import os
import statistics

import pytest
import torch
from torch import nn

import fxpipe
import fxpipe.planning.measure
import fxpipe.plans.report
from fxpipe.passes.cost_model import SAME_DEVICE, DeviceSpec, Link, default_link

HANDOFF_S = 0.5e-3
MODEL_S = 10e-3


def chain():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]).eval(), torch.randn(8, 16)


@pytest.fixture
def scripted(scripted_costs, monkeypatch):
    """Every node 1 ms, a hand-off between CPU stages 0.5 ms, the model's own time 10 ms
    measured steadily."""
    monkeypatch.setattr(fxpipe.planning.measure, "handoff_s", lambda threads, cores: HANDOFF_S)
    monkeypatch.setattr(fxpipe.planning.measure.Baseline, "seconds", property(lambda self: MODEL_S))
    monkeypatch.setattr(fxpipe.planning.measure.Baseline, "spread", property(lambda self: 0.0))
    return scripted_costs


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="2 one-thread stages need 2 cores")
def test_the_prediction_prices_each_hand_off_as_the_runtime_costs_it(scripted):
    model, x = chain()
    plan = fxpipe.plan(model, ["cpu", "cpu"], (x,), chunks=4, threads_per_stage=1)
    # Two Linear nodes a stage (2 ms), each stage receiving one value and sending one per
    # micro-batch (the driver feeds the first and takes the last's): 2 hand-offs, 1 ms.
    for stage in plan.partition.stages:
        assert stage.compute_s == pytest.approx(2e-3)
        assert stage.comm_s == pytest.approx(2 * HANDOFF_S)
    # GPipe on 2 stages of 3 ms each, 4 micro-batches: (2 + 4 - 1) steps of 3 ms.
    assert plan.record.predicted_step_s == pytest.approx(5 * 3e-3)
    assert plan.record.unpipelined_s == MODEL_S
    assert plan.speedup == pytest.approx(MODEL_S / 15e-3)
    assert plan.claimed_speedup == plan.speedup
    assert f"{MODEL_S / 15e-3:.2f}x" in str(plan)
    # explain() prices the cuts as the plan did.
    assert plan.link_fn(*plan.partition.devices) == Link(latency_s=HANDOFF_S)


def test_the_hand_off_priced_is_the_one_measured_for_cpu_stages_only(monkeypatch):
    monkeypatch.setattr(fxpipe.planning.measure, "handoff_s", lambda threads, cores: HANDOFF_S)
    cpu = [DeviceSpec("cpu", threads=1), DeviceSpec("cpu", threads=1)]
    link = fxpipe.planning.measure.priced_link(cpu)
    assert link(*cpu) == Link(latency_s=HANDOFF_S)
    assert link(DeviceSpec("cpu"), cpu[0]) == Link(latency_s=HANDOFF_S)     # the driver's
    assert fxpipe.planning.measure.priced_link([DeviceSpec("cuda:0"), *cpu]) is default_link
    assert default_link(*cpu) == SAME_DEVICE


def test_the_hand_off_is_measured_once_per_thread_layout():
    fxpipe.planning.measure.handoff_s.cache_clear()
    first = fxpipe.planning.measure.handoff_s((1, 1), 2)
    assert 0 < first < 0.1 and fxpipe.planning.measure.handoff_s((1, 1), 2) == first
    assert fxpipe.planning.measure.handoff_s.cache_info().misses == 1


def test_the_model_is_timed_warm_between_the_stages_measurements(scripted_costs, monkeypatch):
    samples = []
    sample = fxpipe.planning.measure.Baseline.sample
    monkeypatch.setattr(fxpipe.planning.measure.Baseline, "sample",
                        lambda self: (samples.append(len(self.times)), sample(self)))
    measured = []
    measure = fxpipe.planning.measure.Costs._measure
    monkeypatch.setattr(fxpipe.planning.measure.Costs, "_measure",
                        lambda self, *a: (measured.append(len(samples)), measure(self, *a))[1])
    model, x = chain()
    plan = fxpipe.plan(model, ["cpu", "cpu"], (x,), num_stages="auto", chunks="auto")
    # 3 samples before any cost is measured, then one after each measurement.
    assert len(measured) == len(plan.record.measurements) > 1
    assert measured == list(range(3, 3 + len(measured)))
    assert len(samples) == 3 + len(measured)
    assert plan.record.unpipelined_spread is not None and plan.record.unpipelined_spread >= 0


def test_a_plan_claims_no_speed_up_where_its_figures_cannot_hold(scripted, monkeypatch):
    model, x = chain()
    plan = fxpipe.plan(model, ["cpu", "cpu"], (x,), chunks=4, threads_per_stage=1)
    monkeypatch.setattr(fxpipe.plans.report.os, "cpu_count", lambda: 1)
    assert plan.claimed_speedup is None
    assert "no speed-up claimed: the CPU stages ask for 2 threads on 1 core" in str(plan)
    monkeypatch.setattr(fxpipe.plans.report.os, "cpu_count", lambda: 2)
    assert plan.claimed_speedup == plan.speedup
    for unsteady in (dict(spread=0.4), dict(unpipelined_spread=0.4)):
        shaken = plan.with_record(**unsteady)
        assert shaken.claimed_speedup is None and "figures are unsteady" in str(shaken)
        assert f"{plan.speedup:.2f}x" not in str(shaken)


def test_the_speed_up_measured_in_use_sits_beside_the_predicted_one(scripted, monkeypatch):
    monkeypatch.setattr(fxpipe.plans.report.os, "cpu_count", lambda: 2)
    model, x = chain()
    with fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=4, threads_per_stage=1) as pipe:
        plan = pipe.plan
        pipe(x)
        assert "speedup" not in plan.observed and pipe.last_run.speedup is None   # warm-up
        pipe(x[:4])                     # other rows than the example's: not compared
        assert plan.observed["runs"] == 1
        times = []
        for _ in range(3):
            pipe(x)
            times.append(pipe.last_run.call_s)
        seen = plan.observed
        assert seen["runs"] == 4 and seen["times_s"] == times
        assert seen["speedup"] == pytest.approx(MODEL_S / statistics.median(times))
        assert pipe.last_run.speedup == seen["speedup"]
        assert pipe.last_run.predicted_speedup == plan.claimed_speedup
        assert "measured in use" in str(plan) and f"{plan.speedup:.2f}x predicted" in str(plan)
        # The scripted nodes (1 ms each) are far slower than the model's own: the two differ.
        assert "warning: the measured speed-up is" in str(plan)
        seen.update(speedup=0.5)
        assert "warning: the pipeline measured slower than the model run whole (0.50x)" in \
            str(plan)
        seen.update(step_s=plan.record.predicted_step_s * 1.2, speedup=plan.speedup / 1.2)
        assert "warning: the measured speed-up" not in str(plan)      # within 25%
        seen.update(step_s=plan.record.predicted_step_s * 1.3, speedup=plan.speedup / 1.3)
        assert "warning: the measured speed-up is 1.30x off" in str(plan)
