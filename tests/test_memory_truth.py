"""What a stage holds: the cost model's liveness estimate by hand, the relaxed views as lower
bounds of the exact one, the GPU allocator's arithmetic, and the prediction against what stages
hold as they run (`fxpipe.runtime.memory`, itself against torch's `MemTracker`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.passes.cost_model import (CostGraph, DeviceSpec, Memory, Pricing,
                                      cublas_workspace_bytes, forward_peak, gpu_block_bytes,
                                      gpu_segment_bytes, standalone_held)
from fxpipe.passes.partition.lattice import _Lattice
from fxpipe.passes.partition.limits import Limits
from fxpipe.runtime.memory import track_memory
from fxpipe.testing import DagCase, assignments, dags

MB = 1_000_000


def graph_of(preds: dict[str, tuple[str, ...]], out_mb: dict[str, float], *,
             views: dict[str, str] = {}, outputs: tuple[str, ...] = ()) -> CostGraph:
    """A hand-made graph: input "x", then the nodes of `preds` in order; a node in `views`
    views the value it names (no memory of its own)."""
    names = ["x", *preds]
    index = {n: i for i, n in enumerate(names)}
    read = {p for ps in preds.values() for p in ps}
    out = tuple(int(out_mb.get(n, 0) * MB) for n in names)
    return CostGraph(
        names=tuple(names), time_s=(0.0,) + (1e-3,) * len(preds), out_bytes=out,
        param_bytes=(0,) * len(names),
        preds=((),) + tuple(tuple(index[p] for p in ps) for ps in preds.values()),
        is_input=(True,) + (False,) * len(preds),
        to_output=tuple(n in outputs or (n != "x" and n not in read) for n in names),
        new_bytes=tuple(0 if n in views else b for n, b in zip(names, out)),
        views=tuple((index[views[n]],) if n in views else () for n in names))


def peak_mb(graph: CostGraph) -> float:
    return forward_peak(graph, graph.compute_nodes) / MB


# --- the liveness estimate, by hand ---------------------------------------------------------

def test_a_chain_holds_a_value_until_its_reader_ran():
    # x(1) -> a(4) -> b(4) -> c(2): while b runs, a and b live; then b and c.
    graph = graph_of({"a": ("x",), "b": ("a",), "c": ("b",)}, {"x": 1, "a": 4, "b": 4, "c": 2})
    assert peak_mb(graph) == 1 + 4 + 4     # what it received lives through the forward
    # every value made, as the rule before this one counted: 11 MB
    assert sum(graph.out_bytes) / MB == 11


def test_a_skip_connection_keeps_its_value_alive():
    # a(4) is read again by d: it lives through b and c.
    graph = graph_of({"a": ("x",), "b": ("a",), "c": ("b",), "d": ("a", "c")},
                     {"x": 1, "a": 4, "b": 3, "c": 3, "d": 4})
    assert peak_mb(graph) == 1 + 4 + 3 + 4     # d runs: x, a, c (its inputs) and d
    chain = graph_of({"a": ("x",), "b": ("a",), "c": ("b",), "d": ("c",)},
                     {"x": 1, "a": 4, "b": 3, "c": 3, "d": 4})
    assert peak_mb(chain) == 1 + 4 + 3         # without the skip: a and b, or c and d


def test_a_view_of_a_large_value_keeps_its_base_and_takes_nothing():
    # v views a(8): v costs nothing, and a lives as long as v is read (by c, last).
    graph = graph_of({"a": ("x",), "v": ("a",), "b": ("v",), "c": ("b", "v")},
                     {"x": 1, "a": 8, "v": 8, "b": 2, "c": 2}, views={"v": "a"})
    assert peak_mb(graph) == 1 + 8 + 2 + 2
    copied = graph_of({"a": ("x",), "v": ("a",), "b": ("v",), "c": ("b", "v")},
                      {"x": 1, "a": 8, "v": 8, "b": 2, "c": 2})
    assert peak_mb(copied) == 1 + 8 + 8         # a copy holds both while it is made


def test_values_sent_live_until_the_forward_ends_and_outputs_wait_for_the_join():
    graph = graph_of({"a": ("x",), "b": ("a",), "c": ("b",)}, {"x": 1, "a": 4, "b": 2, "c": 2},
                     outputs=("a",))
    assert peak_mb(graph) == 1 + 4 + 2 + 2     # a is returned: it lives to the end
    held = standalone_held(graph, graph.compute_nodes)
    assert held.returned_bytes == 6 * MB
    one, four = Memory(), Memory(microbatches=4)
    assert one.need(0, held) == 9 * MB
    # four micro-batches: the other three's outputs wait for the join, which copies all four
    assert four.need(0, held) == max(9 + 3 * 6, 2 * 4 * 6) * MB


# --- the relaxed views are lower bounds of the exact one -------------------------------------

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(dags(), dags(training=True)), st.data())
def test_every_relaxed_view_prices_memory_at_most_as_the_exact_one(case: DagCase, data):
    graph, k, memory = case.graph, len(case.devices), case.memory
    stage_of = data.draw(assignments(graph, k))
    pricing = Pricing(graph, case.devices, memory=memory)
    tallies = pricing.tally(stage_of)
    exact = pricing.stage_costs(stage_of)
    lattice = _Lattice.ideals(graph, pricing.columns, pricing.forward_columns, Limits().ideals)
    bit = {node: b for b, node in enumerate(lattice.nodes)}
    index = {mask: at for at, mask in enumerate(lattice.masks)}
    below = 0
    for s, (tally, cost) in enumerate(zip(tallies, exact)):
        relaxed = tally.held
        assert memory.need(s, relaxed) <= cost.memory_kept_bytes
        if memory.training:
            assert memory.need(s, relaxed, True) <= cost.memory_recomputing_bytes
        members = [i for i in graph.compute_nodes if stage_of[i] == s]
        upto = below | sum(1 << bit[i] for i in members)
        pair = lattice.pair(index[below], index[upto])     # the DP's stage: the same sums
        assert memory.need(s, pair.held) == memory.need(s, relaxed)
        below = upto


# --- the GPU's allocator and libraries: arithmetic only ---------------------------------------

def test_the_caching_allocator_rounds_blocks_and_segments():
    assert gpu_block_bytes(0) == 0
    assert gpu_block_bytes(1) == gpu_block_bytes(512) == 512
    assert gpu_block_bytes(513) == 1024
    assert gpu_segment_bytes(100) == 2 << 20               # small requests share 2 MiB
    assert gpu_segment_bytes(1 << 20) == 2 << 20
    assert gpu_segment_bytes((1 << 20) + 1) == 20 << 20    # up to 10 MiB: 20 MiB segments
    assert gpu_segment_bytes(10 << 20) == 10 << 20         # larger: rounded to 2 MiB
    assert gpu_segment_bytes((10 << 20) + 1) == 12 << 20


def test_cublas_takes_a_workspace_per_stream():
    assert cublas_workspace_bytes((9, 0)) == 32 << 20     # Hopper
    assert cublas_workspace_bytes((8, 0)) == (8 << 20) + (128 << 10)
    assert cublas_workspace_bytes(None) == 32 << 20


def test_gpu_stages_count_the_workspace_and_not_the_context():
    graph = graph_of({"a": ("x",), "b": ("a",)}, {"x": 1, "a": 4, "b": 4})
    cpu, gpu = (Pricing(graph, [DeviceSpec(name)] * 2,
                        memory=Memory(gpu_overhead_bytes=32 << 20)).stage_costs([-1, 0, 1])
                for name in ("cpu", "cuda:0"))
    assert [g.memory_bytes - c.memory_bytes for c, g in zip(cpu, gpu)] == [32 << 20] * 2


# --- measured: the stages' own allocations ------------------------------------------------------

class Convs(nn.Module):
    def __init__(self):
        super().__init__()
        layers, channels = [], 3
        for _ in range(3):
            layers += [nn.Conv2d(channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
            channels = 16
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(),
                                                  nn.Linear(1024, 256)) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


MODELS = {"convs": (Convs, (16, 3, 32, 32)), "residual": (Residual, (64, 256))}


def old_need(plan) -> list[int]:
    """The figure before the liveness model, inference: every value the stage makes and
    receives, with its parameters."""
    from fxpipe.passes.cost_model import cost_graph
    part = plan.partition
    graph = cost_graph(plan.graph)
    stage_of = [part.stage_of.get(name, -1) for name in graph.names]
    return [t.held.param_bytes + t.held.activation_bytes
            for t in Pricing(graph, part.devices, memory=part.memory).tally(stage_of)]


def unwaited_need(plan) -> list[int]:
    """The inference prediction with nothing waiting for a later stage: what the predicted
    timeline adds to it depends on the stages' measured speeds, which another machine (or a
    busier hour) may not share."""
    from fxpipe.passes.cost_model import cost_graph
    part = plan.partition
    graph = cost_graph(plan.graph)
    stage_of = [part.stage_of.get(name, -1) for name in graph.names]
    pricing = Pricing(graph, part.devices, memory=part.memory)
    held = pricing.inference_held(stage_of, pricing.tally(stage_of))
    return [h.param_bytes + part.memory.inference_bytes(h._replace(across_bytes=0))
            for h in held]


def measured(pipe, x, training: bool) -> dict[int, int]:
    if training:        # made before the tracking (which charges it to the stage it reads)
        with torch.no_grad():
            target = torch.zeros_like(pipe(x))

    def once():
        if training:
            pipe.train_step(x, target, F.mse_loss)
        else:
            with torch.no_grad():
                pipe(x)
    once()
    for p in pipe.parameters():
        p.grad = None
    with track_memory() as found:
        once()
    return found.peak_bytes


def test_the_tracker_agrees_with_torchs_mem_tracker():
    from torch.distributed._tools.mem_tracker import MemTracker
    torch.manual_seed(0)
    model, x = Convs().eval(), torch.randn(16, 3, 32, 32)
    pipe = fxpipe.compile(model, ["cpu"], (x,), num_stages=1, chunks=2, verify=False, repeats=1)
    with pipe:
        ours = measured(pipe, x, False)[0]
        tracker = MemTracker()
        tracker.track_external(pipe)
        with torch.no_grad(), tracker:
            pipe(x)
        theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    # torch's also counts the caller's batch (there before the call: not a stage's)
    assert ours + x.numel() * x.element_size() == pytest.approx(theirs, rel=0.05)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("training", [False, True])
def test_the_prediction_is_what_stages_hold(name, stages, training):
    torch.manual_seed(0)
    make, shape = MODELS[name]
    model, x = make().train(training), torch.randn(*shape)
    pipe = fxpipe.compile(model, ["cpu"] * stages, (x,), num_stages=stages, chunks=4,
                          training=training, optimizer="sgd", verify=False, repeats=1)
    with pipe:
        found = measured(pipe, x, training)
    unwaited = None if training else unwaited_need(pipe.plan)
    for s, cost in enumerate(pipe.plan.partition.stages):
        # within 25%: what the caller gave (the input batch) is predicted, not measured. In
        # inference what waits for a later stage is read off the predicted timeline, from the
        # stages' measured speeds: CPU stages sharing busy cores may keep up to every other
        # micro-batch's values waiting, or none where the receiver keeps up.
        late = 0 if training else 3 * (cost.sent_bytes - (cost.sent_bytes if s == stages - 1
                                                           else 0))
        least = cost.memory_bytes if training else unwaited[s]
        assert least <= cost.memory_bytes
        assert 0.75 * least <= found[s] <= 1.25 * (cost.memory_bytes + late), \
            (s, cost.memory_bytes, least, found)
    if not training and name == "convs" and stages == 1:   # every value made, counted before
        (old,) = old_need(pipe.plan)
        assert old / found[0] > 1.5, (old, found)


class Rotary(nn.Module):
    """A product with a table no gradient reaches (as a rotary embedding's): autograd keeps
    the table for the gradient of the other factor, and nothing of that factor."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)
        self.register_buffer("freq", torch.linspace(0, 1, 256))

    def forward(self, x):
        table = torch.cos(x.new_ones(x.shape[0], 1) * self.freq)
        return self.down(torch.relu(self.up(x) * table))


def test_what_nodes_keep_is_what_the_models_backward_keeps():
    torch.manual_seed(0)
    model, x = Rotary().train(), torch.randn(64, 64)
    plan = fxpipe.plan(model, ["cpu"], (x,), training=True, optimizer="sgd", verify=False,
                       repeats=1)
    planned = sum(n.meta["cost"].saved_bytes for n in plan.graph.graph.nodes
                  if "cost" in n.meta)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    # x, the table and the ReLU's output: not up(x), which a rule giving every float value a
    # gradient counted (a decoder's rotary products, 8 MB over on two layers)
    assert planned == sum(kept.values()) == (64 * 64 + 2 * 64 * 256) * 4


class WideOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = nn.Linear(64, 64), nn.Linear(64, 4096)

    def forward(self, x):
        return self.head(torch.relu(self.inner(x)))


def test_a_training_stage_holds_its_outputs_until_their_backward():
    # No node keeps the head's output, but the stage holds it per micro-batch until that
    # one's backward runs: a quarter of what the stage holds here. One stage: no timing.
    torch.manual_seed(0)
    model, x = WideOut().train(), torch.randn(64, 64)
    pipe = fxpipe.compile(model, ["cpu"], (x,), chunks=4, training=True, optimizer="sgd",
                          verify=False, repeats=1)
    with pipe:
        found = measured(pipe, x, True)
    (cost,) = pipe.plan.partition.stages
    assert cost.memory_bytes == pytest.approx(found[0], rel=0.05)


def test_a_stages_backward_holds_what_it_sent_and_what_a_later_stage_took():
    # A conv net on three stages, one micro-batch: a ReLU's output, sent and kept by the next
    # stage's convolution, is the sender's again as its own backward reads it (it was the
    # later stage's from its forward). The rule before missed two activations of seven.
    torch.manual_seed(0)
    model, x = Convs().train(), torch.randn(16, 3, 32, 32)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), num_stages=3, chunks=1, training=True,
                          optimizer="sgd", verify=False, repeats=1)
    with pipe:
        found = measured(pipe, x, True)
    from fxpipe.passes.cost_model import cost_graph
    part = pipe.plan.partition
    graph = cost_graph(pipe.plan.graph, training=True)
    stage_of = [part.stage_of.get(name, -1) for name in graph.names]
    pricing = Pricing(graph, part.devices, memory=part.memory)
    held = pricing.training_held(stage_of, pricing.tally(stage_of))
    for s, cost in enumerate(part.stages):
        # Over by at most what it sent that the later stage kept: alive as the sender's
        # backward runs (its executor holds it), measured as the later stage's where the
        # sender's backward does not read it. Under by a fifth at most (the rule before: 0.64x;
        # another CPU's convolution kernels may hold a workspace of their own).
        assert 0.8 * found[s] <= cost.memory_bytes <= 1.1 * found[s] + held[s].moved_bytes, \
            (s, cost.memory_bytes, found)


def test_a_plan_that_fits_by_what_stages_hold_is_no_longer_refused():
    # The 8B case at a small scale: two stages on one device, each given a share of its memory
    # that holds what the stage holds, not every value it makes.
    torch.manual_seed(0)
    model, x = Convs().eval(), torch.randn(16, 3, 32, 32)
    options = dict(num_stages=2, chunks=4, verify=False, repeats=1)
    free = fxpipe.plan(model, ["cpu"] * 2, (x,), **options)
    need = max(c.memory_bytes for c in free.partition.stages)
    old = max(old_need(free))
    cap = 1.05 * need
    assert cap < old         # the rule before refused this
    plan = fxpipe.plan(model, [DeviceSpec("cpu", memory_bytes=2 * cap)] * 2, (x,),
                       costs=free, **options)
    assert all(c.memory_bytes <= cap for c in plan.partition.stages)
    with fxpipe.Pipeline(plan) as pipe:
        found = measured(pipe, x, False)
    # what they hold, within the bound above, but for messages waiting as the stages' speeds
    # have it: on busy cores, up to every later micro-batch's values sent
    late = [3 * c.sent_bytes if s == 0 else 0 for s, c in enumerate(plan.partition.stages)]
    assert all(found[s] <= 1.25 * (cap + late[s]) for s in found), (found, cap, late)


# --- measured beside predicted: last_run and print(plan) ------------------------------------

def test_last_run_records_each_stages_peak_when_the_pipeline_measures_memory(tmp_path):
    torch.manual_seed(0)
    model, x = Residual().train(), torch.randn(64, 256)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), num_stages=2, chunks=4, training=True,
                          optimizer="sgd", verify=False, repeats=1)
    with pipe:
        target = torch.zeros(64, 256)
        pipe.train_step(x, target, F.mse_loss)
        assert pipe.last_run.peak_bytes is None and not pipe.plan.observed   # off by default
        assert "memory measured" not in str(pipe.plan)
        for p in pipe.parameters():
            p.grad = None
        pipe.measure_memory = True
        with track_memory() as outside:       # the same run, tracked from outside too
            pipe.train_step(x, target, F.mse_loss)
        peaks = pipe.last_run.peak_bytes
        assert peaks == outside.peak_bytes and sorted(peaks) == [0, 1]
        for s, cost in enumerate(pipe.plan.partition.stages):
            # the stage's parameters, its gradients, and more
            assert peaks[s] > 2 * pipe.plan.stage_param_bytes[s]
            assert 0.75 * cost.memory_bytes <= peaks[s] <= 1.25 * cost.memory_bytes
        lines = str(pipe.plan).splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("memory measured"))
        assert "a train step of 4 micro-batches" in lines[at]
        for s in range(2):      # stage, predicted, measured, their ratio
            row = lines[at + 3 + s].split()
            assert row[0] == str(s) and float(row[-1]) == pytest.approx(
                pipe.plan.partition.stages[s].memory_bytes / peaks[s], abs=0.01)
        # a run of other micro-batches than the plan priced is shown, not set beside it
        pipe.train_step(x[:2], target[:2], F.mse_loss)
        lines = str(pipe.plan).splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("memory measured"))
        assert "a train step of 2 micro-batches; the plan priced train steps of 4" in lines[at]
        for s in range(2):      # no prediction, no ratio
            row = lines[at + 3 + s].split()
            assert row[1] == "-" and row[-1] == "-"
        # a saved plan keeps no measurement
        loaded = fxpipe.load_plan(pipe.plan.save(tmp_path / "plan"))
        assert loaded.observed == {} and "memory measured" not in str(loaded)


def test_a_model_run_as_is_measures_its_one_stage():
    torch.manual_seed(0)
    model, x = Convs().eval(), torch.randn(16, 3, 32, 32)
    pipe = fxpipe.compile(model, ["cpu"], (x,), num_stages=1, chunks=1, verify=False,
                          repeats=1)
    with pipe:
        pipe.measure_memory = True
        with torch.no_grad():
            pipe(x)
        with torch.no_grad(), track_memory() as outside:
            model(x)
    assert list(pipe.last_run.peak_bytes) == [0]
    # the model's own forward, with its parameters: what the same forward holds, tracked
    # whole, plus the parameters (there before it ran)
    params = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert pipe.last_run.peak_bytes[0] == outside.live_peak_bytes[-1] + params


@pytest.mark.parametrize("optimizer, state", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 0.0),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1.0),
    (lambda ps: torch.optim.Adam(ps), 2.0),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), 3.0),
    (lambda ps: torch.optim.RMSprop(ps, momentum=0.5, centered=True), 3.0),
    (lambda ps: torch.optim.Adagrad(ps), 1.0)])
def test_an_optimizer_given_is_read_for_its_state(optimizer, state):
    from fxpipe.options import optimizer_state_factor
    assert optimizer_state_factor(optimizer(nn.Linear(4, 4).parameters())) == state


def test_an_optimizer_of_another_kind_is_read_off_the_state_it_holds():
    model = nn.Linear(8, 8)
    opt = torch.optim.Adamax(model.parameters())      # exp_avg and exp_inf: 2x
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    from fxpipe.options import optimizer_state_factor
    assert optimizer_state_factor(opt) == 2.0
    torch.manual_seed(0)
    x = torch.randn(64, 256)
    plan = fxpipe.plan(Residual().train(), ["cpu"], (x,), training=True, verify=False,
                       repeats=1, optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(),
                                                            lr=0.1, momentum=0.9))
    assert plan.partition.memory.optimizer_state == 1.0


def test_the_plan_states_the_cuda_context_outside_the_stages_memory():
    from types import SimpleNamespace

    from fxpipe.passes.cost_model import CUDA_CONTEXT_BYTES, format_bytes
    from fxpipe.report import _cuda_context
    on = lambda *names: SimpleNamespace(partition=SimpleNamespace(
        devices=[DeviceSpec(n) for n in names]))
    assert _cuda_context(on("cpu", "cpu:1")) == []
    (line,) = _cuda_context(on("cuda:1", "cpu", "cuda:0", "cuda:0"))
    assert "(cuda:0, cuda:1)" in line and format_bytes(CUDA_CONTEXT_BYTES) in line
    assert "not charged against a device's memory_bytes" in line
