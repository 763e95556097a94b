"""Re-materialisation: a stage keeps only its inputs and recomputes its activations in the
backward; the step's loss, gradients and model state equal those without it."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding
from fxpipe.passes.cost_model import Pricing, cost_graph
from fxpipe.testing.memory import can_measure
from nets import NormDrop


def step(pipe, x, target):
    """One train_step from seed 1: its loss.

    Steps with and without recomputing are compared by `assert_same_training(..., buffers=True)`:
    loss, every gradient, every buffer (BatchNorm's statistics updated once per micro-batch,
    not again where recomputed) equal up to rounding: other stage counts sum in another order,
    and a value that is small because large terms cancel (the gradient of a bias right before a
    BatchNorm, zero in exact arithmetic) carries their rounding, so each set is compared within
    epsilons of its own largest magnitude (all the gradients together)."""
    torch.manual_seed(1)
    return pipe.train_step(x, target, F.mse_loss)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recomputing_gives_the_same_step_dropout_and_batchnorm_included(schedule):
    torch.manual_seed(0)
    model, x, target = NormDrop().train(), torch.randn(16, 8), torch.randn(16, 8)
    twin = copy.deepcopy(model)
    runs = {}
    for recompute, m in (("never", model), ("always", twin)):
        pipe = fxpipe.compile(m, ["cpu"] * 3, (x,), chunks=4, schedule=schedule,
                              recompute=recompute)
        assert pipe.plan.recompute == recompute
        runs[recompute] = step(pipe, x, target)
    assert_same_training(twin, model, loss=(runs["always"], runs["never"]), buffers=True)
    assert model.norm.num_batches_tracked.item() == 4


@pytest.mark.parametrize("recompute", ["always", "runs"])
def test_a_recomputing_step_reads_no_tensor_on_the_host(recompute, host_reads):
    """Putting the buffers back after a recomputed backward compares nothing on the host (on a
    GPU each comparison would wait for it), and the step is unchanged."""
    from fxpipe.passes.recompute import checkpoint_regions
    torch.manual_seed(0)
    model, x, target = NormDrop().train(), torch.randn(16, 8), torch.randn(16, 8)
    twin = copy.deepcopy(model)
    plain = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4)
    pipe = fxpipe.compile(twin, ["cpu"] * 2, (x,), chunks=4,
                          recompute="always" if recompute == "always" else "never")
    if recompute == "runs":
        for stage in pipe.plan.stages:
            checkpoint_regions(stage.module, {n.name for n in stage.module.graph.nodes
                                              if n.op == "call_module"})
    step(plain, x, target)     # a first step checks that loss_fn is a mean over rows,
    step(pipe, x, target)      # reading its verdict on the host once: later steps do not
    expected = step(plain, x, target)
    host_reads.clear()
    got = step(pipe, x, target)
    assert host_reads == []
    assert_same_training(twin, model, loss=(got, expected), buffers=True)


def test_a_recomputing_stage_keeps_only_its_inputs_until_its_backward():
    from fxpipe.runtime import StageExecutor
    from fxpipe.passes.codegen import split_stages
    import torch.fx as fx

    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64)))
    (stage,) = split_stages(gm, {n.name: 0 for n in gm.graph.nodes
                                 if n.op not in ("placeholder", "output")}, ["cpu"])
    x = torch.randn(8, 4)
    kept = {}
    for recompute in (False, True):
        saved = []
        executor = StageExecutor(stage, backward_for=[0], recompute=recompute)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            out = executor.forward(0, {stage.inputs[0]: x})
        kept[recompute] = len(saved)
        (name,) = stage.outputs
        executor.backward(0, [{name: [torch.ones_like(out[name])]}])
    assert kept[True] == 0 < kept[False]


def test_recompute_is_checked():
    with pytest.raises(fxpipe.FxpipeError, match="recompute='sometimes'"):
        fxpipe.compile(NormDrop(), ["cpu"], (torch.randn(4, 8),), recompute="sometimes")


def test_the_plan_shows_each_stages_training_memory_kept_and_recomputed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).train()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (torch.randn(32, 64),), chunks=4,
                          schedule="gpipe", optimizer="adam")
    plan = pipe.plan
    assert any(plan.stage_saved_bytes)
    part = plan.partition
    graph = cost_graph(plan.graph, training=True)
    stage_of = [part.stage_of.get(name, -1) for name in graph.names]
    pricing = Pricing(graph, part.devices, memory=part.memory)
    for s, (cost, held) in enumerate(zip(part.stages,
                                         pricing.training_held(stage_of, pricing.tally(stage_of)))):
        params = held.param_bytes
        assert params == plan.stage_param_bytes[s]
        state = 3 * params                  # weights and Adam's two moments, throughout
        saved, received = held.saved_bytes, held.received_bytes
        assert saved == plan.stage_saved_bytes[s] and received == cost.received_bytes
        transient, temp = held.backward_bytes, held.grad_temp_bytes
        kept = saved - held.moved_bytes      # a later stage in the same memory takes the rest
        # GPipe holds every micro-batch as the first backward starts, one fewer with every
        # gradient made as the later ones run; and besides, what it sent that its reader may
        # not have taken yet (at most every other micro-batch's values or gradients).
        least = state + max(4 * (kept + received) + transient,
                            params + 3 * (kept + received) + transient + temp)
        waiting = 3 * (cost.sent_bytes + received)
        assert least <= cost.memory_kept_bytes <= least + waiting
        assert cost.memory_kept_bytes == part.memory.need(s, held)
        # recomputing, it keeps what it received, and one micro-batch's saved values while its
        # backward runs
        least = state + saved + max(4 * received + transient,
                                    params + 3 * received + transient + temp)
        assert least <= cost.memory_recomputing_bytes <= least + waiting
        assert cost.memory_recomputing_bytes == part.memory.need(s, held, True)
        assert cost.memory_bytes == cost.memory_kept_bytes and not cost.recompute
    assert "memory in training" in str(plan)
    inference = fxpipe.compile(model.eval(), ["cpu"] * 2, (torch.randn(32, 64),))
    assert not any(inference.plan.stage_saved_bytes)
    assert "memory in training" not in str(inference.plan)


class Chain(nn.Module):
    """Activations that dominate the weights, narrow between blocks, with dropout and
    BatchNorm to recompute."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[layer for _ in range(2) for layer in (
            nn.Linear(32, 256), nn.BatchNorm1d(256), nn.GELU(), nn.Dropout(0.2),
            nn.Linear(256, 32))])

    def forward(self, x):
        return self.layers(x)


def capped(cap):
    """Two stages on the CPU, `cap` each (they share the device's memory_bytes)."""
    return [fxpipe.DeviceSpec("cpu", memory_bytes=2 * cap)] * 2


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_auto_recomputes_where_a_stage_would_not_fit_and_the_step_is_unchanged(schedule):
    torch.manual_seed(0)
    model, x, target = Chain().train(), torch.randn(1024, 32), torch.randn(1024, 32)
    options = dict(chunks=4, schedule=schedule, optimizer="sgd")
    free = fxpipe.compile(model, ["cpu"] * 2, (x,), **options).plan.partition.stages
    cap = max(c.memory_kept_bytes for c in free)
    while True:     # the first cap, in steps of 0.95, that no partition keeping activations meets
        cap *= 0.95
        try:
            fxpipe.compile(model, capped(cap), (x,), verify=False, **options)
        except fxpipe.PartitionError as e:
            assert "recompute='auto'" in str(e)
            break
    twin = copy.deepcopy(model)
    auto = fxpipe.compile(twin, capped(cap), (x,), recompute="auto", **options)
    stages = auto.plan.partition.stages
    assert all(c.memory_bytes <= cap for c in stages)
    recomputes = [whole or bool(nodes) for whole, nodes in
                  zip(auto.plan.stage_recompute, auto.plan.record.stage_recomputed)]
    assert recomputes == [c.memory_kept_bytes > cap for c in stages] and any(recomputes)
    never = fxpipe.compile(model, ["cpu"] * 2, (x,), **options)
    expected, got = step(never, x, target), step(auto, x, target)
    assert_same_training(twin, model, loss=(got, expected), buffers=True)


def test_a_model_that_fits_nowhere_is_told_the_memory_that_would_do():
    from fxpipe.passes.cost_model import CostGraph, DeviceSpec, Memory, format_bytes
    from fxpipe.passes.partition import partition
    from fxpipe.passes.partition.orders import least_memory_bytes

    n = 8
    graph = CostGraph(names=("x",) + tuple(f"n{i}" for i in range(n)),
                      time_s=(0.0,) + (1e-3,) * n, out_bytes=(1000,) * (n + 1),
                      param_bytes=(0,) + (50_000,) * n,
                      preds=((),) + tuple(((i,)) for i in range(n)),
                      is_input=(True,) + (False,) * n, to_output=(False,) * n + (True,),
                      saved_bytes=(0,) + (20_000,) * n)
    memory = Memory(in_flight=(4, 4), training=True, optimizer_state=2.0, recompute="auto")
    least = least_memory_bytes(graph, 2, memory)
    with pytest.raises(fxpipe.PartitionError, match=format_bytes(least)):
        partition(graph, [DeviceSpec("cpu", memory_bytes=0.9 * least)] * 2, memory=memory)
    fits = partition(graph, [DeviceSpec("cpu", memory_bytes=least)] * 2, memory=memory)
    assert max(c.memory_bytes for c in fits.stages) <= least
    with pytest.raises(fxpipe.PartitionError):   # within 1% of the least, for a chain
        partition(graph, [DeviceSpec("cpu", memory_bytes=0.98 * least)] * 2, memory=memory)


MEASURE = """
import json, torch, torch.nn.functional as F
import fxpipe
from fxpipe.testing.memory import peak_bytes, return_freed_memory
from test_recompute import Chain
return_freed_memory()
torch.manual_seed(0)
model, x = Chain().train(), torch.randn(2048, 32)
options = dict(chunks=4, optimizer="sgd", verify=False, repeats=1)
cap = float("inf")
if {recompute!r} == "auto":      # the first cap, in steps of 0.95, that "never" cannot meet
    free = fxpipe.compile(model, ["cpu"] * 2, (x,), **options).plan.partition.stages
    cap = max(c.memory_kept_bytes for c in free)
    while True:
        cap *= 0.95
        try:
            fxpipe.compile(model, [fxpipe.DeviceSpec("cpu", memory_bytes=cap)] * 2, (x,),
                           **options)
        except fxpipe.PartitionError:
            break
pipe = fxpipe.compile(model, [fxpipe.DeviceSpec("cpu", memory_bytes=cap)] * 2, (x,),
                      recompute={recompute!r}, **options)
assert {recompute!r} != "auto" or any(pipe.plan.stage_recompute + pipe.plan.record.stage_recomputed)
stages, weights = pipe.plan.partition.stages, pipe.plan.stage_param_bytes
peak = peak_bytes(lambda: pipe.train_step(x, torch.zeros(2048, 32), F.mse_loss))
print(json.dumps([peak, sum(c.memory_bytes - w for c, w in zip(stages, weights))]))
"""


@pytest.mark.skipif(not can_measure(), reason="needs Linux's /proc counters")
@pytest.mark.parametrize("recompute", ["never", "always", "auto"])
def test_the_planned_memory_bounds_a_measured_step(recompute):
    import json
    import os
    import subprocess
    import sys
    # Run from this file's folder: `python -c` puts the working directory first on the path,
    # so the script imports this module's Chain.
    out = subprocess.run([sys.executable, "-c", MEASURE.format(recompute=recompute)],
                         cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    measured, predicted = json.loads(out.stdout.strip().splitlines()[-1])
    # The step's gradients and activations, resident at its peak, against the plan's stages
    # (the weights were there before); the margin covers what the model leaves out: gradients
    # of activations in flight during a backward, the allocator's rounding to pages. (Measured
    # here: 1.09x "never", 0.84x "always", 1.06x to 1.10x "auto".)
    assert 0.5 * predicted <= measured <= 1.5 * predicted, (measured, predicted)


def all_but_linears(stage):
    """BatchNorm, GELU and the dropout draw, not the Linears."""
    return {n.name for n in stage.module.graph.nodes if n.op != "output" and
            not (n.op == "call_module" and isinstance(stage.module.get_submodule(n.target),
                                                      nn.Linear))
            and n.op != "placeholder" and not n.is_impure()}


def last_batchnorm(stage):
    """One BatchNorm recomputed, the other kept (its saved running statistics must stay valid
    while the recomputed one's are put back)."""
    norms = [n.name for n in stage.module.graph.nodes if n.op == "call_module" and
             isinstance(stage.module.get_submodule(n.target), nn.BatchNorm1d)]
    return set(norms[-1:])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("recomputed, stages", [(all_but_linears, 2), (last_batchnorm, 1)])
def test_runs_of_recomputed_nodes_give_the_same_step_dropout_and_batchnorm_included(
        schedule, recomputed, stages):
    from fxpipe.passes.recompute import Recomputed, checkpoint_regions
    torch.manual_seed(0)
    model, x, target = Chain().train(), torch.randn(64, 32), torch.randn(64, 32)
    twin = copy.deepcopy(model)
    options = dict(chunks=4, schedule=schedule)
    plain = fxpipe.compile(model, ["cpu"] * 2, (x,), **options)
    partial = fxpipe.compile(twin, ["cpu"] * stages, (x,), **options)
    for stage in partial.plan.stages:
        checkpoint_regions(stage.module, recomputed(stage))
    assert any(isinstance(m, Recomputed) for s in partial.plan.stages for m in s.module.modules())
    expected, got = step(plain, x, target), step(partial, x, target)
    assert_same_training(twin, model, loss=(got, expected), buffers=True)
    # A plain call whose backward is the caller's: nothing recomputed, buffers written once.
    outputs = []
    for pipe in (plain, partial):
        torch.manual_seed(2)
        out = pipe(x)
        out.sum().backward()
        outputs.append(out)
    assert_same_up_to_rounding(outputs[1], outputs[0], what="output")
    assert_same_training(twin, model, buffers=True)


def test_a_stage_input_named_for_recomputation_stays_an_input():
    """Inputs compute nothing, so a run never takes one in: a stage reading `relu` from
    another keeps it as its input when every node named like it is to be recomputed."""
    import torch.fx as fx
    from fxpipe.passes.recompute import checkpoint_regions

    def f(relu, x):
        return torch.relu(relu + x) * 2
    gm = fx.symbolic_trace(f)
    relu, x = torch.randn(3, 4), torch.randn(3, 4)
    expected = gm(relu, x)
    checkpoint_regions(gm, {n.name for n in gm.graph.nodes if "relu" in n.name})
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["relu", "x"]
    assert "recomputed_0" in gm.code
    torch.testing.assert_close(gm(relu, x), expected)


def test_a_run_drawing_first_recomputes_the_same_dropout_on_another_thread():
    """A GPU's backward runs on autograd's thread for that device, where no micro-batch seed is
    set: a recomputed run whose first draw starts from the seed carries the seed along."""
    import threading
    import torch.fx as fx
    from fxpipe.passes.randomness import microbatch_seed, seed_random_ops
    from fxpipe.passes.recompute import checkpoint_regions, recomputing

    def f(x):
        return torch.sin(F.dropout(x, 0.5, True) * 2)
    plain = seed_random_ops(fx.symbolic_trace(f))
    regions = checkpoint_regions(copy.deepcopy(plain), {
        n.name for n in plain.graph.nodes if n.op == "call_function"})
    assert "recomputed_0" in regions.code
    x = torch.randn(64, 8)

    def on_another_thread(work):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()

    def gradient(gm, run_backward):
        leaf = x.clone().requires_grad_()
        with microbatch_seed(7), recomputing():
            out = gm(leaf)
        run_backward(lambda: out.sum().backward())
        return leaf.grad
    expected = gradient(plain, lambda work: work())
    assert (expected == 0).any() and (expected != 0).any()     # dropout dropped some, not all
    torch.testing.assert_close(gradient(regions, on_another_thread), expected)


def costed_chain():
    """a -> cheap -> costly -> cheap2 -> out, each keeping 100 bytes of its own and its output
    kept by its reader; known forward times."""
    import torch.fx as fx
    from fxpipe.passes.cost_model import NodeCost

    def f(x):
        return torch.relu(torch.relu(x) @ x).exp()
    gm = fx.symbolic_trace(f)
    times = {"relu": 1e-6, "matmul": 1e-3, "relu_1": 1e-6, "exp": 2e-6}
    for n in gm.graph.nodes:
        n.meta["cost"] = NodeCost()
        if n.op in ("call_function", "call_method"):
            n.meta["cost"] = NodeCost(fwd_s=times[n.name], out_bytes=100, saved_bytes=200)
            n.meta["output_kept"] = True
    return gm


def test_the_cheapest_runs_are_recomputed_until_the_stage_fits():
    from fxpipe.passes.cost_model import (Held, Memory, choose_recomputed, cost_graph,
                                          stage_memory, stage_nodes)
    graph = cost_graph(costed_chain(), training=True)
    nodes = stage_nodes(graph, graph.compute_nodes, graph.kind_times(None).fwd_s)   # one stage
    # Four micro-batches in flight, nothing held but what the nodes save.
    rules = dict(memory=Memory(in_flight=4, training=True, optimizer_state=0.0), stage=0,
                 held=Held())
    assert stage_memory(nodes, set()).kept_bytes == 800
    # Recomputing relu_1 and exp: the run keeps its input (matmul's output, counted there) and
    # its output (leaving the stage), 100 bytes, instead of 400.
    both = stage_memory(nodes, {"relu_1", "exp"})
    assert (both.kept_bytes, both.transient_bytes) == (400 + 100, 400)
    assert both.extra_s == pytest.approx(3e-6)
    choice = choose_recomputed(nodes, **rules, capacity=4 * 500 + 400)
    assert set(choice.nodes) == {"relu_1", "exp"}          # not the matmul: it costs 1 ms
    assert choose_recomputed(nodes, **rules, capacity=4 * 800).nodes == ()
    assert choose_recomputed(nodes, **rules, capacity=100) is None
