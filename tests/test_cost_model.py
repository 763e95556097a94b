"""The cost model: per-kind node times, the lower bound for unrelated devices."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fxpipe.testing import DagCase, assignments, brute_force_partition, dags, recomputing_dags
from fxpipe.passes.cost_model import (CostGraph, DeviceSpec, KindTimes, Memory, NodeCost, Pricing,
                                      cost_graph, lower_bound_s, stage_costs)
from fxpipe.passes.errors import PartitionError
from fxpipe.passes.partition.lattice import _Lattice, _StageCost
from fxpipe.passes.partition.limits import Limits
from fxpipe.passes.partition.slicing import _slice

MS = 1e-3
CPU, GPU = DeviceSpec("cpu"), DeviceSpec("cuda:0")


def four_nodes(cpu_ms, gpu_ms) -> CostGraph:
    """x -> a -> b -> c -> d, the reference (cpu) times `cpu_ms`, the cuda:0 kind's `gpu_ms`."""
    n = len(cpu_ms) + 1
    return CostGraph(
        names=("x",) + tuple("abcd"[:n - 1]), time_s=(0.0,) + tuple(t * MS for t in cpu_ms),
        out_bytes=(0,) * n, param_bytes=(0,) * n,
        preds=((),) + tuple((i,) for i in range(n - 1)), is_input=(True,) + (False,) * (n - 1),
        to_output=(False,) * (n - 1) + (True,),
        kinds={"cuda:0": KindTimes((0.0,) + tuple(t * MS for t in gpu_ms), (0.0,) * n)})


def test_a_device_takes_its_kinds_time_over_its_speed():
    graph = four_nodes([1, 1, 10, 10], [5, 5, 0.5, 0.5])
    assert graph.device_times(GPU)[1:] == pytest.approx([5 * MS, 5 * MS, 0.5 * MS, 0.5 * MS])
    fast_gpu = DeviceSpec("cuda:0", speed=2.0)
    assert graph.device_times(fast_gpu)[3] == pytest.approx(0.25 * MS)
    # cuda:1 has no column: the reference time over its speed.
    assert graph.device_times(DeviceSpec("cuda:1", speed=4.0))[3] == pytest.approx(2.5 * MS)
    costs = stage_costs(graph, [-1, 0, 0, 1, 1], [CPU, GPU])
    assert [c.compute_s for c in costs] == pytest.approx([2 * MS, 1 * MS])


def test_lower_bound_weighs_unrelated_devices():
    # a, b are fast on cpu, c, d on the gpu. Weights in proportion to speed (1/3, 2/3) bound
    # the bottleneck by 4/3 ms; the best weights, 5/6 and 1/6, by 11/6 ms; the optimum is 2 ms.
    graph = four_nodes([1, 1, 10, 10], [5, 5, 0.5, 0.5])
    bound = lower_bound_s(graph, [CPU, GPU])
    assert bound == pytest.approx(11 / 6 * MS, rel=1e-6)
    assert bound <= brute_force_partition(graph, [CPU, GPU]).bottleneck_s


def test_lower_bound_of_related_devices_is_total_over_speed():
    graph = four_nodes([1, 2, 3, 4], [1, 2, 3, 4])
    devices = [CPU, DeviceSpec("cuda:0", speed=3.0), DeviceSpec("cuda:0", speed=3.0)]
    assert lower_bound_s(graph, devices) == pytest.approx(10 * MS / 7)
    assert lower_bound_s(four_nodes([1, 1, 9, 1], [1, 1, 9, 1]), devices) == pytest.approx(3 * MS)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_lower_bound_never_exceeds_the_optimum(case: DagCase):
    try:
        oracle = brute_force_partition(case.graph, case.devices)
    except PartitionError:
        return
    assert lower_bound_s(case.graph, case.devices) <= oracle.bottleneck_s * (1 + 1e-9)


def test_cost_graph_reads_each_kinds_cost_and_keeps_backward_apart():
    gm = fx.symbolic_trace(nn.Sequential(nn.ReLU(), nn.Tanh()))
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, (fwd, bwd) in {"input_1": (0, 0), "_0": (2, 4), "_1": (3, 6)}.items():
        nodes[name].meta["cost"] = NodeCost(fwd_s=fwd * MS, bwd_s=bwd * MS)
    nodes["_0"].meta["costs"] = {"cuda:0": NodeCost(fwd_s=1 * MS, bwd_s=1 * MS)}
    graph = cost_graph(gm, training=True, kinds=["cuda:0", "cpu/2"])
    assert graph.time_s == pytest.approx((0, 6 * MS, 9 * MS))
    assert graph.kind_times("cuda:0").fwd_s == pytest.approx((0, 1 * MS, 3 * MS))
    assert graph.kind_times("cuda:0").bwd_s == pytest.approx((0, 1 * MS, 6 * MS))
    assert graph.kind_times("cpu/2") == graph.kind_times(None)
    assert graph.kind_times(None).bwd_s == pytest.approx((0, 4 * MS, 6 * MS))
    assert graph.device_times(DeviceSpec("cuda:0", speed=2.0)) == pytest.approx(
        (0, 1 * MS, 4.5 * MS))
    inference = cost_graph(gm, kinds=["cuda:0"])
    assert inference.kind_times("cuda:0").bwd_s == (0.0, 0.0, 0.0)
    assert inference.device_times(GPU) == pytest.approx((0, 1 * MS, 3 * MS))
    assert torch.equal(gm(torch.ones(2)), torch.tanh(torch.ones(2)))   # the model is unchanged


def test_partition_puts_each_node_where_it_runs_fast():
    from fxpipe.passes.partition import partition

    graph = four_nodes([1, 1, 10, 10], [5, 5, 0.5, 0.5])
    result = partition(graph, [CPU, GPU])
    assert result.stage_of == {"a": 0, "b": 0, "c": 1, "d": 1}
    assert result.optimal
    assert result.bottleneck_s == brute_force_partition(graph, [CPU, GPU]).bottleneck_s
    assert result.stages[0].compute_s == pytest.approx(2 * MS)


# --- one set of rules, several views: exact, relaxed, incremental ---------------------------

def _valid_assignment(data, graph: CostGraph, k: int) -> list[int]:
    """A random valid stage for every node: never before a stage it reads from."""
    return data.draw(assignments(graph, k))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(memory=False), st.data())
def test_relaxed_stage_times_never_exceed_exact_ones(case: DagCase, data):
    pricing = Pricing(case.graph, case.devices)
    stage_of = _valid_assignment(data, case.graph, len(case.devices))
    exact = [c.time_s for c in pricing.stage_costs(stage_of)]
    relaxed = pricing.relaxed_stage_s(stage_of)
    for r, e in zip(relaxed, exact):
        assert r <= e * (1 + 1e-9) + 1e-15
    # They agree where the relaxation gives nothing away: one link, each value read by at most
    # one later stage.
    single_reader = all(len({stage_of[j] for j in case.graph.succs[i]} - {stage_of[i]}) <= 1
                        for i in case.graph.compute_nodes)
    if single_reader and len({d.name for d in case.devices}) == 1 and case.devices[0].name == "cpu":
        assert relaxed == pytest.approx(exact)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recomputing_dags())
def test_relaxed_recomputation_never_exceeds_what_the_stage_recomputes(drawn):
    # A stage that must recompute to fit is priced exactly at the part it recomputes, and the
    # relaxed views (the DP, slicing, the bound) at no more than that.
    case, stage_of = drawn
    pricing = Pricing(case.graph, case.devices, memory=case.memory)
    costs = pricing.stage_costs(stage_of)
    for r, c, d in zip(pricing.relaxed_stage_s(stage_of), costs, case.devices):
        if c.memory_bytes <= d.memory_bytes:     # else the relaxed views call it infeasible
            assert r <= c.time_s * (1 + 1e-9) + 1e-15


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(memory=False), st.data())
def test_the_dp_prices_a_stage_as_the_relaxed_rule_does(case: DagCase, data):
    graph, k = case.graph, len(case.devices)
    pricing = Pricing(graph, case.devices)
    stage_of = _valid_assignment(data, graph, k)
    lattice = _Lattice.ideals(graph, pricing.columns, pricing.forward_columns, Limits().ideals)
    bit = {node: b for b, node in enumerate(lattice.nodes)}
    index = {mask: at for at, mask in enumerate(lattice.masks)}
    relaxed = pricing.relaxed_stage_s(stage_of)
    below = 0
    for s in range(k):
        upto = below | sum(1 << bit[i] for i in graph.compute_nodes if stage_of[i] == s)
        pair = lattice.pair(index[below], index[upto])
        assert _StageCost(pricing, s)(pair) == pytest.approx(relaxed[s], abs=1e-12)
        below = upto


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(memory=False), st.integers(0, 2**20))
def test_the_slicing_keeps_exact_stage_times_as_it_goes(case: DagCase, limit_seed):
    graph = case.graph
    pricing = Pricing(graph, case.devices)
    order = graph.compute_nodes
    position = [-1] * len(graph)
    for at, i in enumerate(order):
        position[i] = at
    last = [max((position[j] for j in graph.succs[i]), default=-1) for i in range(len(graph))]
    limit = math.inf if limit_seed % 3 == 0 else lower_bound_s(graph, case.devices) * (
        1 + limit_seed / 2**18)
    found = _slice(pricing, order, position, last, limit, [0.0] * len(case.devices), {})
    if found is not None:
        stage_of, bottleneck = found
        assert bottleneck == pytest.approx(pricing.bottleneck_s(stage_of), rel=1e-9, abs=1e-15)
        assert bottleneck <= limit * (1 + 1e-9)


def test_stage_costs_keep_forward_and_backward_apart_per_kind():
    graph = CostGraph(
        names=("x", "a", "b"), time_s=(0.0, 3 * MS, 6 * MS), out_bytes=(0, 0, 0),
        param_bytes=(0, 0, 0), preds=((), (0,), (1,)), is_input=(True, False, False),
        to_output=(False, False, True),
        kinds={None: KindTimes((0.0, 1 * MS, 2 * MS), (0.0, 2 * MS, 4 * MS)),
               "cuda:0": KindTimes((0.0, 0.1 * MS, 0.2 * MS), (0.0, 0.3 * MS, 0.4 * MS))})
    cpu, gpu = stage_costs(graph, [-1, 0, 1], [CPU, DeviceSpec("cuda:0", speed=2.0)])
    assert cpu.backward_s == pytest.approx(2 * MS)
    assert cpu.forward_step_s == pytest.approx(1 * MS + cpu.comm_s)
    assert gpu.backward_s == pytest.approx(0.2 * MS)
    assert gpu.forward_step_s == pytest.approx(0.1 * MS + gpu.comm_s)
    assert gpu.time_s == pytest.approx(gpu.forward_step_s + gpu.backward_step_s - gpu.comm_s)


def test_the_partitioner_prices_the_part_a_stage_recomputes():
    # x -> matmul -> relu -> matmul_1 -> relu_1; each relu saves as much as its matmul. A stage
    # holding the first matmul and relu fits its device only recomputing, and recomputing the
    # relu alone (0.3 ms) suffices: the balanced cut wins. Priced as recomputing its whole
    # forward (3.3 ms), the cut fell after the first matmul, slower, and with no stage
    # recomputing there was nothing to re-price afterwards.
    from fxpipe.passes.partition import partition

    mb = 1_000_000
    fwd, bwd = (0.0, 3 * MS, 0.3 * MS, 3 * MS, 0.3 * MS), (0.0, 7 * MS, 0.7 * MS, 7 * MS, 0.7 * MS)
    graph = CostGraph(
        names=("x", "matmul", "relu", "matmul_1", "relu_1"),
        time_s=tuple(f + b for f, b in zip(fwd, bwd)), out_bytes=(mb,) * 5, param_bytes=(0,) * 5,
        preds=((), (0,), (1,), (2,), (3,)), is_input=(True, False, False, False, False),
        to_output=(False, False, False, False, True), kinds={None: KindTimes(fwd, bwd)},
        saved_bytes=(0, 10 * mb, 10 * mb, mb, mb), recomputable=(False, True, True, True, True))
    memory = Memory(in_flight=4, training=True, optimizer_state=0.0, recompute="auto")
    devices = [DeviceSpec("cpu", memory_bytes=70 * mb)] * 2
    found = partition(graph, devices, memory=memory)
    assert found.stage_names == (("matmul", "relu"), ("matmul_1", "relu_1"))
    first = found.stages[0]
    assert first.recomputed == ("relu",) and not first.recompute
    assert first.recompute_s == pytest.approx(0.3 * MS)
    assert first.memory_bytes <= 70 * mb < first.memory_kept_bytes
    assert found.optimal
    assert found.bottleneck_s == pytest.approx(
        brute_force_partition(graph, devices, memory=memory).bottleneck_s)
    whole = partition(replace(graph, recomputable=None), devices, memory=memory)
    assert whole.stage_names == (("matmul",), ("relu", "matmul_1", "relu_1"))
    assert not any(c.recompute or c.recomputed for c in whole.stages)
    assert found.bottleneck_s < whole.bottleneck_s - 0.5 * MS
