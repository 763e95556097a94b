"""The plan's prediction, its arithmetic on scripted costs (hand-offs, a call's own work and the
interpreter lock included), its claim only where it can stand by it, and the speed-up measured in
use beside it (issue 51, item 1).

Node costs, the runtime's hand-off, what a call costs besides its stages and the model's own time
are scripted, so what is tested is the arithmetic and the rules, never this machine's timings.
"""

import dataclasses
import os
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
import fxpipe.planning.host
import fxpipe.planning.measure
import fxpipe.passes.cost_model
import fxpipe.plans.report
from fxpipe.passes.cost_model import SAME_DEVICE, DeviceSpec, HostCosts, Link, default_link
from fxpipe.runtime.schedules import Action, Phase, simulate
from test_reading_the_plan import PAGE, unexplained

HANDOFF_S = 0.5e-3
MODEL_S = 10e-3


def chain():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]).eval(), torch.randn(8, 16)


@pytest.fixture
def scripted(scripted_costs, monkeypatch):
    """Every node 1 ms, a hand-off between CPU stages 0.5 ms, a call's own work and the
    interpreter lock nothing (`host`), the model's own time 10 ms measured steadily."""
    monkeypatch.setattr(fxpipe.planning.host, "handoff_s", lambda threads, cores: HANDOFF_S)
    host(monkeypatch, HostCosts())
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
    monkeypatch.setattr(fxpipe.planning.host, "handoff_s", lambda threads, cores: HANDOFF_S)
    cpu = [DeviceSpec("cpu", threads=1), DeviceSpec("cpu", threads=1)]
    link = fxpipe.planning.host.priced_link(cpu)
    assert link(*cpu) == Link(latency_s=HANDOFF_S)
    assert link(DeviceSpec("cpu"), cpu[0]) == Link(latency_s=HANDOFF_S)     # the driver's
    assert fxpipe.planning.host.priced_link([DeviceSpec("cuda:0"), *cpu]) is default_link
    assert default_link(*cpu) == SAME_DEVICE


def host(monkeypatch, costs: HostCosts) -> None:
    """Script what a call costs the process besides its stages."""
    monkeypatch.setattr(fxpipe.planning.host, "host_costs", lambda threads, cores: costs)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="2 one-thread stages need 2 cores")
def test_the_prediction_prices_the_call_s_own_work(scripted, monkeypatch, tmp_path):
    # Split, seeds, merge, the runtime's start and end: 0.2 ms a call, 0.1 ms per micro-batch
    # for the one input leaf, 0.3 ms for the one output leaf.
    host(monkeypatch, HostCosts(start_s=0.2e-3, split_s=0.1e-3, merge_s=0.3e-3))
    model, x = chain()
    plan = fxpipe.plan(model, ["cpu", "cpu"], (x,), chunks=4, threads_per_stage=1)
    call_s = 0.2e-3 + 4 * (0.1e-3 + 0.3e-3)
    assert plan.record.predicted_step_s == pytest.approx(5 * 3e-3 + call_s)
    # The stages' timeline starts after the call's own work; its last action ends the call.
    slots = plan.predict()
    assert min(slot.start_s for slot in slots) == pytest.approx(call_s)
    assert max(slot.end_s for slot in slots) == pytest.approx(plan.record.predicted_step_s)
    assert plan.speedup == pytest.approx(MODEL_S / plan.record.predicted_step_s)
    # print(plan) says what the prediction holds besides the stages; the page explains it.
    assert "besides the stages: the call's own work 1.800 ms" in str(plan)
    assert unexplained(str(plan), PAGE.read_text()) == []
    # A saved plan predicts the same step.
    loaded = fxpipe.load_plan(plan.save(tmp_path / "plan"))
    assert loaded.record.host == plan.record.host
    predicted_s = plan.record.predicted_step_s
    assert max(slot.end_s for slot in loaded.predict()) == pytest.approx(predicted_s)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="2 one-thread stages need 2 cores")
@pytest.mark.parametrize("lock_s, wake_s, step_s", [
    # Each forward: 2 nodes of 1 ms and 2 hand-offs of 0.5 ms (3 ms), holding the lock for the
    # hand-offs and `lock_s + wake_s` a node. None: the stages overlap as if it were not there.
    (0.0, 0.0, 5 * 3e-3),
    # Half of each action (1.5 of 3 ms): two at once each wait for the other's holds half the
    # time, 1 + 0.5 x 0.5 as long: 0F0 alone (3 ms), three overlapping pairs (3.75 ms each),
    # 1F3 alone (3 ms).
    (0.25e-3, 0.0, (3 + 3 * 3.75 + 3) * 1e-3),
    # Two thirds: 1 + (2/3)^2 = 13/9 as long where they overlap, 13/3 ms a pair.
    (0.5e-3, 0.0, (3 + 13 + 3) * 1e-3),
    # The same, half of it the wake-up of the thread waiting for the lock.
    (0.25e-3, 0.25e-3, (3 + 13 + 3) * 1e-3),
    # Every node's call holds it throughout (a node of 1 ms takes no more than its compute):
    # the stages take turns, 8 actions of 3 ms one after the other.
    (5e-3, 0.0, 8 * 3e-3),
])
def test_stages_holding_the_interpreter_lock_take_turns(scripted, monkeypatch, lock_s, wake_s,
                                                        step_s):
    host(monkeypatch, HostCosts(lock_s=lock_s, wake_s=wake_s))
    model, x = chain()
    plan = fxpipe.plan(model, ["cpu", "cpu"], (x,), chunks=4, threads_per_stage=1)
    assert plan.record.predicted_step_s == pytest.approx(step_s)
    assert max(slot.end_s for slot in plan.predict()) == pytest.approx(plan.record.predicted_step_s)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="2 one-thread stages need 2 cores")
def test_the_lock_measured_on_the_graph_prices_forwards_and_backwards(scripted, monkeypatch):
    # The graph measured on two threads at once: each node holds the lock 0.5 ms in its
    # backward, nothing in its forward. A backward (2 nodes of 1 ms, 2 hand-offs of 0.5 ms)
    # holds it 2 of its 3 ms; the tiny nodes' lock (`host_costs`) gives way to the graph's.
    host(monkeypatch, HostCosts(lock_s=1e-3, wake_s=1e-3))
    monkeypatch.setattr(fxpipe.planning.measure, "lock_held", lambda *a, **k: (0.0, 0.5e-3))
    model, x = chain()
    plan = fxpipe.plan(model.train(), ["cpu", "cpu"], (x,), chunks=4, threads_per_stage=1,
                       schedule="gpipe")
    assert plan.record.host == HostCosts(lock_s=0.0, wake_s=0.0, backward_lock_s=0.5e-3)
    assert all(m.lock == (0.0, 0.5e-3) for m in plan.record.measurements.values())
    # Forwards hold it for their hand-offs alone (1 of 3 ms): 0F0, 3 pairs at once each
    # 1 + (1/3)^2 as long (10/3 ms a pair), 1F3; then 1B alone, 3 pairs of backwards each
    # 1 + (2/3)^2 as long (13/3 ms a pair), 0B alone.
    assert plan.record.predicted_step_s == pytest.approx((3 + 10 + 3 + 3 + 13 + 3) * 1e-3)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="2 one-thread stages need 2 cores")
def test_a_train_step_prices_the_runtime_s_own_work_per_action(scripted, monkeypatch):
    # Each action of a train step costs the runtime 1 ms of Python besides its stage's 3 ms:
    # 4 ms, a quarter of it holding the lock. Two at once each take 1 + 1/4 x 1/4 as long
    # (4.25 ms): forwards 4 + 3 x 4.25 + 4 ms, backwards the same. A call pays none of it.
    monkeypatch.setattr(fxpipe.planning.host, "train_action_s", lambda threads, cores: 1e-3)
    model, x = chain()
    called = fxpipe.plan(model, ["cpu", "cpu"], (x,), chunks=4, threads_per_stage=1)
    assert called.record.predicted_step_s == pytest.approx(5 * 3e-3)
    trained = fxpipe.plan(model.train(), ["cpu", "cpu"], (x,), chunks=4, threads_per_stage=1,
                          schedule="gpipe")
    assert trained.record.host.train_action_s == 1e-3
    assert trained.record.predicted_step_s == pytest.approx(2 * (4 + 3 * 4.25 + 4) * 1e-3)


@settings(max_examples=50, deadline=None)
@given(share=st.floats(0.0, 1.0), copies=st.integers(2, 4))
def test_the_share_measured_is_the_one_the_simulator_slows_alike_runs_by(share, copies):
    # `lock_held` reads a share off runs at once: the one with which `simulate` has as many
    # alike runs take as long as they took.
    from fxpipe.planning.host import _held_share
    from fxpipe.runtime.schedules import lock_slowdown
    slowdown = lock_slowdown(share, (copies - 1) * share)
    assert _held_share(slowdown, copies) == pytest.approx(share, abs=1e-9)
    timetable = [[Action(s, 0, Phase.FORWARD)] for s in range(copies)]
    slots = simulate(timetable, lambda a: 1.0, {s: [] for s in range(copies)},
                     lock=lambda a: share)
    assert max(slot.end_s for slot in slots) == pytest.approx(slowdown)


def test_the_lock_is_measured_where_stages_share_a_process_and_cores(monkeypatch):
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    for node in gm.graph.nodes:
        node.meta["cost"] = fxpipe.passes.cost_model.NodeCost(fwd_s=1e-4, bwd_s=1e-4)
    x, cpu = torch.randn(2, 4), torch.device("cpu")
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    held = fxpipe.planning.host.lock_held(gm, (x,), {}, True, cpu, threads=1)
    assert held is not None and all(0 <= t <= 1e-4 for t in held)     # at most the node
    # Two copies need two cores each for two threads: none here.
    assert fxpipe.planning.host.lock_held(gm, (x,), {}, True, cpu, threads=3) is None
    forward, backward = fxpipe.planning.host.lock_held(gm, (x,), {}, False, cpu, threads=2)
    assert backward == 0.0


def test_a_graph_split_to_balance_costs_the_call_what_the_unsplit_one_does():
    # A candidate whose wide nodes are split (`search.consider`) is costed again on the split
    # graph: its call's own work and the interpreter lock are still priced, so it is weighed
    # against the others on the same terms.
    from fxpipe.planning import search
    from fxpipe.passes.cost_model import NodeCost, cost_graph
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    for node in gm.graph.nodes:
        node.meta["cost"] = NodeCost(fwd_s=1e-3, bwd_s=2e-3, out_bytes=64)
    host = HostCosts(start_s=1e-3, lock_s=1e-5)
    like = search.Costed(cost_graph(gm), cost_graph(gm, training=False), host)
    assert search._costed(gm, like, training=False).host == host


def test_the_simulator_lets_one_action_hold_the_lock_at_a_time():
    # Two stages reading nothing from each other, one action of 1 s each, holding the lock
    # a share of it: each waits for the other's holds (1 + f x g as long), and shares adding
    # up to more than 1 take at least their sum.
    timetable = [[Action(0, 0, Phase.FORWARD)], [Action(1, 0, Phase.FORWARD)]]
    for shares, end in [((0.0, 0.0), 1.0), ((0.5, 0.5), 1.25), ((0.75, 0.75), 1.5625),
                        ((1.0, 1.0), 2.0), ((1.0, 0.0), 1.0), ((0.9, 0.1), 1.09)]:
        slots = simulate(timetable, lambda a: 1.0, {0: [], 1: []},
                         lock=lambda a: shares[a.stage])
        assert max(slot.end_s for slot in slots) == pytest.approx(end), shares
    # Processor sharing still holds beside it: 2 one-thread stages on 1 core.
    slots = simulate(timetable, lambda a: 1.0, {0: [], 1: []}, cores=1, demand=[1, 1],
                     lock=lambda a: 0.5)
    assert max(slot.end_s for slot in slots) == pytest.approx(2.0)


def test_host_costs_are_measured_once_per_thread_layout():
    layout = ((1, 1), 97)        # a core count of its own: measured here, once
    misses = fxpipe.planning.host._runtime_costs.cache_info().misses
    first = fxpipe.planning.host.host_costs(*layout)
    assert 0 < fxpipe.planning.host.handoff_s(*layout) < 0.1
    assert fxpipe.planning.host.host_costs(*layout) == first
    assert fxpipe.planning.host._runtime_costs.cache_info().misses == misses + 1
    assert first.start_s >= 0 and first.split_s >= 0 and first.merge_s >= 0
    assert 0 < first.lock_s < 0.1 and 0 < first.wake_s < 0.1
    misses = fxpipe.planning.host.train_action_s.cache_info().misses
    action_s = fxpipe.planning.host.train_action_s(*layout)
    assert 0 <= action_s < 0.1 and fxpipe.planning.host.train_action_s(*layout) == action_s
    assert fxpipe.planning.host.train_action_s.cache_info().misses == misses + 1


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


def test_a_training_plan_of_mostly_python_stages_claims_no_speed_up(scripted):
    """A train step's own Python is not priced: where a stage's forward and backward both hold
    the interpreter lock most of their time, a training plan claims nothing; an inference plan
    still does, and so does a training plan whose forwards alone are mostly Python."""
    model, x = chain()
    called = fxpipe.plan(model, ["cpu", "cpu"], (x,), chunks=4, threads_per_stage=1)
    trained = fxpipe.plan(model.train(), ["cpu", "cpu"], (x,), chunks=4, threads_per_stage=1)
    # Each stage: forward 2 ms of nodes and 1 ms of hand-offs, backward the same.
    assert trained.training and trained.claimed_speedup is not None
    python, forwards = HostCosts(lock_s=1.0, backward_lock_s=1.0), HostCosts(lock_s=1.0)
    assert called.with_record(host=python).claimed_speedup is not None  # a call's Python is priced
    assert trained.with_record(host=forwards).claimed_speedup is not None
    assert trained.with_record(host=forwards).record.host.lock_share(
        trained.partition.stages[0], False) == pytest.approx(1 / 3)     # its hand-offs
    mostly = trained.with_record(host=python)
    assert mostly.claimed_speedup is None
    assert ("forward holds the interpreter lock 100% of its time and its backward 100%, so its "
            "work is mostly Python") in " ".join(str(mostly).split())


def test_an_early_measured_speed_up_off_the_prediction_says_the_pipeline_may_be_warming(
        scripted):
    model, x = chain()
    plan = fxpipe.plan(model, ["cpu", "cpu"], (x,), chunks=4, threads_per_stage=1)
    slow = plan.record.unpipelined_s / plan.claimed_speedup * 2          # 2x off
    for runs, warming in [(3, True), (40, False)]:
        plan.observed.update(runs=runs, times_s=[slow], step_s=slow,
                             speedup=plan.record.unpipelined_s / slow)
        text = str(plan)
        assert "warning: the measured speed-up is 2.00x off the predicted one" in text
        assert ("a fresh pipeline's first 2-16 calls ran 2-5x slower" in text) == warming


@pytest.mark.parametrize("warm_s, timed", [(0.01, [0.05, 0.01, 0.01]), (0.2, [1.0, 1.0, 1.0])])
def test_a_quick_model_runs_untimed_before_each_sample(monkeypatch, warm_s, timed):
    """The stages' measurements between samples leave the model cold (`cold` here): a model
    quicker than `REWARM_S` runs once untimed before each sample after the first; a slower
    one does not (the first run after a measurement is timed: 5x its warm time here)."""
    Baseline = fxpipe.planning.measure.Baseline
    cold, ran = [True], []

    def run(self):
        ran.append(cold[0])
        seconds, cold[0] = 5 * warm_s if cold[0] else warm_s, False
        return seconds
    monkeypatch.setattr(Baseline, "_run", run)
    baseline = Baseline.__new__(Baseline)
    baseline.times = []
    for _ in range(3):
        cold[0] = True            # a stage's measurement ran
        baseline.sample()
    assert baseline.times == timed
    assert len(ran) == (5 if warm_s < Baseline.REWARM_S else 3)


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
    # The model's runs all slowed alike (steady) far past its stages' whole work: disturbed.
    work_s = sum(s.compute_s for s in plan.partition.stages) * plan.chunks
    slowed = plan.with_record(unpipelined_s=4 * work_s, unpipelined_spread=0.0)
    assert slowed.claimed_speedup is None and "the figures disagree" in str(slowed)
    assert plan.with_record(unpipelined_s=2 * work_s).claimed_speedup is not None


def test_the_speed_up_measured_in_use_sits_beside_the_predicted_one(scripted, monkeypatch):
    monkeypatch.setattr(fxpipe.plans.report.os, "cpu_count", lambda: 2)
    host(monkeypatch, HostCosts(start_s=1.0))   # predicted over a second: no call takes that
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
        # The scripted call (over a second) is far slower than the real one: the two differ.
        assert "warning: the measured speed-up is" in str(plan)
        seen.update(speedup=0.5)
        assert "warning: the pipeline measured slower than the model run whole (0.50x)" in \
            str(plan)
        seen.update(step_s=plan.record.predicted_step_s * 1.2, speedup=plan.speedup / 1.2)
        assert "warning: the measured speed-up" not in str(plan)      # within 25%
        seen.update(step_s=plan.record.predicted_step_s * 1.3, speedup=plan.speedup / 1.3)
        assert "warning: the measured speed-up is 1.30x off" in str(plan)
