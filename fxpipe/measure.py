"""Node costs measured as the stages will run them, and the model's own time to beat.

`Costs` measures the graph once per micro-batch size, device kind (a CPU kind per thread count)
and thread (the caller's, or a worker's as the stages of a pipeline run on), reusing what a
plan passed as `costs=` measured, and `calibrate`s each measurement to the whole graph's time
measured in the same conditions; `Baseline` times the model as given, whole, between those
measurements; `handoff_s` times the runtime's own hand-off between stages, which `priced_link`
prices, and `host_costs` what else a call costs the process (`HostCosts`: its start and end,
splitting and merging, the interpreter lock each node's call holds), which `priced_host` gives.

Costs live on nodes, measured as the stage will run the node: at each configuration's micro-batch
size, with its stages' intra-op threads, on a worker thread when the stages will run on workers (a
CPU op's scaling with threads differs there), then scaled so that they add up to the whole graph's
time measured in the same conditions (timing nodes one by one misses the dispatch between ops and
autograd's engine); on a GPU the whole run is timed by the host's clock until the GPU is done, so
launches count. What measuring wrote besides the costs (`annotate_costs.WRITTEN`) is reused with
them from `costs=plan`. Costs are measured on the graph as captured, so a saved plan's measurements
name its nodes; a split (`split_wide`) copies them onto the parts. A meta model's node costs are
not calibrated: that run would time drawing every weight and pass the whole model's weights through
memory once per repeat.

`Baseline` is sampled warm before and between the stages' measurements (median, spread).
`handoff_s` is an empty pipeline through the runtime's workers and queues, over the hand-offs the
cost model counts in it (fitted with the call's own start and end at two micro-batch counts,
cached per process and thread layout), which `priced_link` gives as the default link for CPU
stages; `lock_s` times tiny nodes on one thread and on several at once (the interpreter lock's
share of a node's call). `race` runs pipelines and the model on the example, interleaved
(calls, or in training train steps with the outputs' sum as the loss:
`runtime.calls.train_stages`), and keeps the least times.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.annotate_costs import WRITTEN, annotate_costs, bind_inputs
from fxpipe.passes.device import is_cpu, start_timer
from fxpipe.passes.codegen import placed_copy
from fxpipe.passes.materialize import holds_meta
from fxpipe.passes.cost_model import (DeviceSpec, HostCosts, Link, LinkFn, NodeCost,
                                      cost_graph, default_link)
from fxpipe.passes.errors import CostError
from fxpipe.passes.graph_values import tensors
from fxpipe.passes.randomness import microbatch_seed
from fxpipe.passes.stage import Stage
from fxpipe.passes.state import unchanged_state

from . import microbatch, search
from .devices import shared_memory, synchronize
from .runtime.calls import call_stages, runtime_of, train_stages
from .plan_data import Measurement, Plan
from .runtime import Runtime
from .reference import copied, unchanged
from .schedules import gpipe, simulate
from .wiring import Wiring

if TYPE_CHECKING:
    from .api import Recipe


class Costs:
    """The graph's node costs, measured once per micro-batch size, device kind (a CPU kind per
    thread count) and thread (the caller's, or a worker's as the stages of a pipeline run on),
    then calibrated; a configuration's costs are those of its devices' kinds."""

    def __init__(self, gm: fx.GraphModule, recipe: Recipe, training: bool,
                 between: Callable[[], None] = lambda: None):
        self.gm, self.recipe, self.training = gm, recipe, training
        self.between = between       # called after each measurement (`Baseline.sample`)
        self.measured: dict[tuple, dict[fx.Node, NodeCost]] = {}
        self.calibration: dict[tuple, tuple[float, float]] = {}
        self.marks: dict[tuple, dict[str, dict[str, Any]]] = {}
        saved = recipe.options.costs
        self.saved: Mapping[tuple, Measurement] = {
            key: m for key, m in (saved.measurements if saved is not None else {}).items()
            if key[3] == training}      # costs measured with backward, or without
        if self.saved:
            names = {n.name for n in gm.graph.nodes if n.op != "output"}
            known = next(iter(self.saved.values())).costs.keys()
            if names != set(known):
                raise CostError(
                    f"the costs passed with costs= were measured on another graph\n"
                    f"{len(names - set(known))} of this graph's {len(names)} nodes are not in "
                    f"it; pass the plan of this model, captured with the same options")

    def saved_measurements(self) -> dict[tuple, Measurement]:
        """Every measurement made or reused, by (the micro-batch's input shapes, kind, on a worker
        thread, with backward), each node's cost by name: what `compile(..., costs=plan)`
        reuses."""
        found = dict(self.saved)
        for (chunks, kind, worker), costs in self.measured.items():
            found[self._key(chunks, kind, worker)] = Measurement(
                {n.name: cost for n, cost in costs.items()},
                self.calibration[chunks, kind, worker], self.marks[chunks, kind, worker])
        return found

    def _key(self, chunks: int, kind: str, worker: bool) -> tuple:
        recipe = self.recipe
        first = microbatch.split((recipe.args, recipe.kwargs), chunks, recipe.input_dims)[0]
        shapes = tuple(tuple(t.shape) for t in tensors(first))    # what a node's cost depends on
        return (shapes, kind, worker, self.training)

    @staticmethod
    def devices(config: search.Config, specs: Sequence[DeviceSpec]) -> list[DeviceSpec]:
        """The configuration's devices, each CPU stage with its threads."""
        return shared_memory([replace(d, threads=d.threads or config.threads)
                              if is_cpu(d.name) else d
                              for d in specs[:config.num_stages]])

    def measure(self, config: search.Config, devices: Sequence[DeviceSpec]) -> search.Costed:
        """The graph costed as `config`'s stages run one of `config.chunks` micro-batches on
        `devices`: each kind measured on its device with its threads, on a worker thread of its
        own when the stages run on workers (several stages), where intra-op threads scale
        differently than on the caller's thread. Leaves those costs on the nodes."""
        worker = config.num_stages > 1
        kinds = list(dict.fromkeys(d.kind for d in devices))
        for device in {d.kind: d for d in devices}.values():
            key = (config.chunks, device.kind, worker)
            if key not in self.measured:
                self.measured[key] = self._measure(config.chunks, device, worker)
                self.between()
        for n in self.gm.graph.nodes:
            if n.op != "output":
                n.meta["costs"] = {k: self.measured[config.chunks, k, worker][n] for k in kinds}
                n.meta["cost"] = n.meta["costs"][kinds[0]]
        in_process = self.recipe.options.link_name in ("default", "measure")
        host = priced_host(devices) if in_process else HostCosts()
        return search.Costed(cost_graph(self.gm, kinds=kinds),
                             cost_graph(self.gm, training=self.training, kinds=kinds), host)

    def _measure(self, chunks: int, device: DeviceSpec, worker: bool) -> dict[fx.Node, NodeCost]:
        gm, recipe = self.gm, self.recipe
        reused = self.saved.get(self._key(chunks, device.kind, worker))
        if reused is not None:
            self.calibration[chunks, device.kind, worker] = reused.calibration
            self.marks[chunks, device.kind, worker] = dict(reused.marks)
            for n in gm.graph.nodes:     # as measuring writes them: the state units read these
                n.meta.update(reused.marks.get(n.name, {}))
            return {n: reused.costs[n.name] for n in gm.graph.nodes if n.op != "output"}
        args, kwargs = microbatch.split((recipe.args, recipe.kwargs), chunks,
                                        recipe.input_dims)[0]

        def run():
            with _intra_op_threads(device.threads):
                annotate_costs(gm, args, kwargs, device=device.name,
                               repeats=recipe.options.repeats, backward=self.training,
                               reuse_blocks=recipe.options.reuse_blocks,
                               progress=recipe.progress.nodes, materialize=recipe.plausible)
                self.calibration[chunks, device.kind, worker] = calibrate(
                    gm, args, kwargs, self.training, torch.device(device.name))
        _on_worker_thread(run) if worker else run()
        self.marks[chunks, device.kind, worker] = {
            n.name: {key: n.meta[key] for key in WRITTEN if key != "cost" and key in n.meta}
            for n in gm.graph.nodes}
        return {n: n.meta["cost"] for n in gm.graph.nodes if n.op != "output"}


def _on_worker_thread(fn: Callable[[], None]) -> None:
    """Call `fn` on a thread of its own, as the runtime runs a stage; its exception re-raised."""
    errors: list[BaseException] = []

    def call():
        try:
            fn()
        except BaseException as e:      # handed to the caller's thread
            errors.append(e)
    thread = threading.Thread(target=call, name="fxpipe-measure", daemon=True)
    thread.start()
    while thread.is_alive():            # with a timeout, so Ctrl-C reaches the caller
        thread.join(0.05)
    if errors:
        raise errors[0]


def calibrate(gm: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any], training: bool,
              device: torch.device | None = None, repeats: int = 3) -> tuple[float, float]:
    """Scale the nodes' measured costs so that they add up to the graph's own time, measured
    here in the same conditions (thread, threads, micro-batch); returns the factors applied to
    forward and backward times.

    Timing each node alone misses what runs between nodes (the dispatch of the next op, autograd's
    engine walking the whole graph, gradients accumulated across nodes), and adds what timing a
    node costs: the graph run whole measures what a stage will see. The median of `repeats` runs
    after a warm-up, on `device` (default: where `gm`'s parameters are; a copy placed there
    where `gm` is elsewhere), by the host's clock until the device's work is done (on a GPU the
    nodes' CUDA events time kernels alone; the graph's launches, which a small batch waits on,
    count here); buffers and random generators are left as they were.

    A graph holding meta tensors (planned from the meta device) is not calibrated: factors 1,
    the nodes' own times stand. Its whole run would time drawing every node's weights with the
    nodes (several times the graph's own time), and run the whole model's weights through memory
    once per repeat; its backward would keep them all alive at once.
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    node_fwd_s = sum(n.meta["cost"].fwd_s for n in nodes)
    node_bwd_s = sum(n.meta["cost"].bwd_s for n in nodes)
    device = device or next((t.device for t in gm.parameters()), torch.device("cpu"))
    measured = placed_copy(gm, device)
    inputs = bind_inputs(gm, *pytree.tree_map(
        lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, (args, kwargs)))
    if holds_meta(measured):
        return 1.0, 1.0
    params = [p for p in measured.parameters() if p.requires_grad]
    run = _positional(measured)
    forward_s, step_s = [], []
    with unchanged_state(measured), torch.random.fork_rng(devices=[]), microbatch_seed(0):
        for _ in range(repeats + 1):
            fresh = copied(inputs)
            elapsed_s = start_timer(device, wall=True)
            with torch.set_grad_enabled(training and bool(params)):
                out = run(*fresh)
                forward_s.append(elapsed_s())
                loss = sum(t.float().sum() for t in pytree.tree_leaves(out)
                           if isinstance(t, torch.Tensor) and t.requires_grad)
                if isinstance(loss, torch.Tensor):
                    torch.autograd.grad(loss, params, allow_unused=True)
            step_s.append(elapsed_s())
    forward = statistics.median(forward_s[1:])
    backward = max(0.0, statistics.median(step_s[1:]) - forward)
    scale = (forward / node_fwd_s if node_fwd_s > 0 else 1.0,
             backward / node_bwd_s if training and node_bwd_s > 0 else 1.0)
    for n in nodes:
        cost = n.meta["cost"]
        n.meta["cost"] = replace(cost, fwd_s=cost.fwd_s * scale[0], bwd_s=cost.bwd_s * scale[1])
    return scale


def _positional(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` as generated code taking one positional argument per placeholder (no `*args`, no
    defaults), as a stage takes its inputs; on `gm`'s own parameters."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in graph.nodes:
        if n.op == "placeholder":
            n.target, n.args = n.name, ()
    return fx.GraphModule(gm, graph)


@contextlib.contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` intra-op threads on this thread (None: as it is)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Baseline:
    """The model's own time for one batch, as given: whole, on its device, with the caller's
    threads (in training, forward and backward to every parameter): what a pipeline must beat.

    Measured warm (one run first, not counted), `first` samples at once, then one more at each
    `sample()` (a sample: one run, or several of a quick model): planning samples it between the stages' measurements (`Costs(between=...)`), so
    a disturbance of the machine that moves the stages' costs moves the baseline alike, and no
    single run sets it. `seconds` is the median of the runs, `spread` how far they disagree
    ((p90 - p10) / median, as the nodes' own spread). Each run leaves the model, its buffers and
    `.grad` as they were, and every device it uses synchronised.
    """

    def __init__(self, model: nn.Module, recipe: Recipe, training: bool, first: int = 3):
        self.model, self.recipe, self.training = model, recipe, training
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.devices = {t.device for t in [*model.parameters(), *model.buffers(),
                                           *tensors((recipe.args, recipe.kwargs))]}
        self.times: list[float] = []
        self._run()                        # warm-up
        for _ in range(first):
            self.sample()

    def sample(self) -> None:
        """More runs of the model, timed: one, or for a model quicker than `SAMPLE_S` as many
        as fill it (at most `SAMPLE_RUNS`), so that a quick model's median and spread rest on
        enough runs."""
        spent = 0.0
        for _ in range(self.SAMPLE_RUNS):
            self.times.append(self._run())
            spent += self.times[-1]
            if spent >= self.SAMPLE_S:
                return

    SAMPLE_S = 2e-3
    SAMPLE_RUNS = 10

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        return spread_of(self.times)

    def _run(self) -> float:
        model, recipe = self.model, self.recipe
        with unchanged(model), torch.set_grad_enabled(self.training and bool(self.params)):
            args, kwargs = copied(recipe.args), copied(recipe.kwargs)
            synchronize(*self.devices)
            start = time.perf_counter()
            out = model(*args, **kwargs)
            loss = sum(t.float().sum() for t in pytree.tree_leaves(out)
                       if isinstance(t, torch.Tensor) and t.requires_grad)
            if isinstance(loss, torch.Tensor):
                torch.autograd.grad(loss, self.params, allow_unused=True)  # .grad left alone
            synchronize(*self.devices)
            return time.perf_counter() - start


def spread_of(times: Sequence[float]) -> float:
    """How far repeated timings disagree: (p90 - p10) / median (0 for fewer than 2)."""
    if len(times) < 2:
        return 0.0
    ordered = sorted(times)
    at = lambda q: ordered[round(q * (len(ordered) - 1))]      # noqa: E731
    return (at(0.9) - at(0.1)) / statistics.median(ordered)


# An empty pipeline's micro-batch counts and timed runs of each, per thread layout (`host_costs`).
HANDOFF_CHUNKS = (2, 8)
HANDOFF_RUNS = 15


def handoff_s(threads: tuple[int | None, ...], cores: int) -> float:
    """The runtime's own cost of a hand-off between CPU stages on this machine, for stages with
    `threads` intra-op threads each on `cores` cores (`host_costs`)."""
    return _runtime_costs(threads, cores)[0]


def host_costs(threads: tuple[int | None, ...], cores: int) -> HostCosts:
    """What a call costs the process besides its stages' work, for CPU stages with `threads`
    intra-op threads each on `cores` cores: the call's start and end (the runtime's, which
    `handoff_s` fits, and the rest of the call's, `_call_work_s`), splitting and merging a
    leaf per micro-batch (`_call_work_s`), the time a node's call holds the interpreter lock
    (`lock_s`) and a waiting thread's wake-up (`wake_s`). Cached per process and thread
    layout."""
    fixed, split_s, merge_s = _call_work_s()
    return HostCosts(start_s=_runtime_costs(threads, cores)[1] + fixed, split_s=split_s,
                     merge_s=merge_s, lock_s=lock_s(min(max(cores, 2), LOCK_THREADS)),
                     wake_s=wake_s() if cores > 1 else 0.0)


@functools.lru_cache(maxsize=None)
def _runtime_costs(threads: tuple[int | None, ...], cores: int) -> tuple[float, float]:
    """The runtime's own cost of a hand-off between CPU stages, and of a call's start and end:
    calls of `HANDOFF_CHUNKS` micro-batches through stages returning what they receive, run
    `HANDOFF_RUNS` times each, interleaved, by the real runtime (workers, queues, seeds,
    records), each median fitted to `start + hand-off x units`: `units` is the cost model's
    prediction of that call at one second a hand-off (one received and one sent per stage and
    micro-batch; `search.predict_slots`' timeline, cores shared and, a hand-off being Python,
    the interpreter lock held as there). So an empty pipeline is predicted as measured, and
    each hop of a real one pays what the runtime costs here. About 50 ms, once a layout."""
    k = len(threads)
    stages = [Stage(i, _passing(), (f"v{i}",), (f"v{i + 1}",), torch.device("cpu"))
              for i in range(k)]
    wiring = Wiring.of(stages, [f"v{k}"])
    runtime = Runtime(stages, wiring, threads_per_stage=list(threads))
    times: dict[int, list[float]] = {chunks: [] for chunks in HANDOFF_CHUNKS}
    try:
        for run in range(HANDOFF_RUNS + 1):
            for chunks in HANDOFF_CHUNKS:
                inputs, timetable = [{"v0": torch.zeros(1)}] * chunks, gpipe(k, chunks)
                began = time.perf_counter()
                runtime.run(timetable, inputs, seeds=[0] * chunks)
                if run:                         # the first starts the workers
                    times[chunks].append(time.perf_counter() - began)
    finally:
        runtime.close()
    units = [max(slot.end_s for slot in simulate(
        gpipe(k, chunks), lambda action: 2.0, wiring.reads_from(False), cores=cores,
        demand=[t or 1 for t in threads], lock=lambda action: 1.0))
        for chunks in HANDOFF_CHUNKS]
    (few, many), (t_few, t_many) = units, [statistics.median(times[c]) for c in HANDOFF_CHUNKS]
    hop = max(t_many - t_few, 0.0) / (many - few) if many > few else t_many / many
    if hop <= 0:                              # noise: the call's time all hand-offs
        hop = t_many / many
    return hop, max(0.0, t_few - hop * few)


# The leaf a call splits and merges (`_call_work_s`), and the timed runs at each count.
CALL_WORK_SHAPE, CALL_WORK_RUNS = (64, 32), 21


@functools.lru_cache(maxsize=None)
def _call_work_s() -> tuple[float, float, float]:
    """A call's own work besides the runtime's: rows counted, one leaf split and merged as a call
    does, at `HANDOFF_CHUNKS` micro-batches (medians of `CALL_WORK_RUNS`), fitted to a fixed
    part and one per micro-batch: (fixed, split and merge per micro-batch and leaf)."""
    values, dims = {"x": torch.zeros(CALL_WORK_SHAPE)}, {"x": 0}
    times: dict[int, tuple[list[float], list[float]]] = {}
    for chunks in HANDOFF_CHUNKS:
        parts = microbatch.split_up_to(values, chunks, dims)
        split_s, merge_s = times[chunks] = [], []
        for _ in range(CALL_WORK_RUNS):
            began = time.perf_counter()
            microbatch.rows_of(values, dims)
            microbatch.split_up_to(values, chunks, dims)
            split_s.append(time.perf_counter() - began)
            began = time.perf_counter()
            microbatch.merge([(part["x"],) for part in parts], (0,))
            merge_s.append(time.perf_counter() - began)
    (few, many) = HANDOFF_CHUNKS
    fixed, per = 0.0, []
    for column in (0, 1):
        t_few, t_many = (statistics.median(times[c][column]) for c in HANDOFF_CHUNKS)
        slope = max(t_many - t_few, 0.0) / (many - few)
        per.append(slope)
        fixed += max(0.0, t_few - slope * few)
    return fixed, per[0], per[1]


# The interpreter lock's calibration: nodes of its graph, runs per thread, threads at most,
# rounds (`lock_s`).
LOCK_NODES, LOCK_RUNS, LOCK_THREADS, LOCK_ROUNDS = 32, 10, 4, 3


@functools.lru_cache(maxsize=None)
def lock_s(threads: int) -> float:
    """The most of a node's call that its thread holds the interpreter lock, here: `LOCK_NODES`
    tiny nodes (their call is the Python and dispatch around a kernel of next to nothing) run
    `LOCK_RUNS` times on one worker thread alone, then on `threads` at once, which take
    `threads` times as long where the lock is held throughout: the together time per node over
    `threads`, at most the time alone (median of `LOCK_ROUNDS`; about 20 ms, once a process)."""
    graph = _tiny_nodes(LOCK_NODES)
    x = torch.zeros(2, 4)

    def runs(barrier: threading.Barrier) -> None:
        with torch.no_grad(), _intra_op_threads(1):
            barrier.wait()
            for _ in range(LOCK_RUNS):
                graph(x)

    def timed(count: int) -> float:
        barrier = threading.Barrier(count + 1)
        workers = [threading.Thread(target=runs, args=(barrier,), name="fxpipe-measure",
                                    daemon=True) for _ in range(count)]
        for worker in workers:
            worker.start()
        barrier.wait()
        began = time.perf_counter()
        for worker in workers:
            worker.join()
        return time.perf_counter() - began
    timed(threads)                              # warm-up
    per_node = []
    for _ in range(LOCK_ROUNDS):
        alone, together = timed(1), timed(threads)
        per_node.append(min(alone, together / threads) / (LOCK_RUNS * LOCK_NODES))
    return statistics.median(per_node)


WAKE_TRIPS = 50         # round trips between two threads timed (`wake_s`)


@functools.lru_cache(maxsize=None)
def wake_s() -> float:
    """How long a waiting thread takes to run once another lets it (`HostCosts.wake_s`): two
    threads passing a turn back and forth by events `WAKE_TRIPS` times, the median trip over
    two. A few ms, once per process."""
    turns = [threading.Event(), threading.Event()]
    trips: list[float] = []

    def back() -> None:
        for _ in range(WAKE_TRIPS):
            turns[0].wait()
            turns[0].clear()
            turns[1].set()
    other = threading.Thread(target=back, name="fxpipe-measure", daemon=True)
    other.start()
    for _ in range(WAKE_TRIPS):
        began = time.perf_counter()
        turns[0].set()
        turns[1].wait()
        turns[1].clear()
        trips.append(time.perf_counter() - began)
    other.join()
    return statistics.median(trips) / 2


def _tiny_nodes(count: int) -> fx.GraphModule:
    """`count` nodes computing next to nothing: `Linear(4, 4)` calls and ReLUs in turn."""
    root = nn.Module()
    graph = fx.Graph()
    value = graph.placeholder("x")
    for i in range(count):
        if i % 2:
            value = graph.call_function(torch.relu, (value,))
        else:
            root.add_module(f"linear{i}", nn.Linear(4, 4))
            value = graph.call_module(f"linear{i}", (value,))
    graph.output(value)
    return fx.GraphModule(root, graph)


def _passing() -> fx.GraphModule:
    """A stage that computes nothing: it returns the value it received."""
    graph = fx.Graph()
    graph.output((graph.placeholder("x"),))
    return fx.GraphModule(nn.Module(), graph)


def priced_link(devices: Sequence[DeviceSpec]) -> LinkFn:
    """`default_link` with a hand-off between stages on the CPU (and to or from the driver)
    priced as this machine's runtime costs one for these devices' thread layout (`handoff_s`):
    how the default link prices a configuration's CPU stages. Devices not all CPUs keep
    `default_link`'s prices."""
    if not all(is_cpu(d.name) for d in devices):
        return default_link
    same = Link(latency_s=handoff_s(tuple(d.threads for d in devices), os.cpu_count() or 1))
    return functools.partial(default_link, same_device=same)


def priced_host(devices: Sequence[DeviceSpec]) -> HostCosts:
    """What a call costs the process besides the stages on `devices` (`host_costs`), where
    they are all CPU stages on threads of this process; else nothing priced (`HostCosts()`)."""
    if not all(is_cpu(d.name) for d in devices):
        return HostCosts()
    return host_costs(tuple(d.threads for d in devices), os.cpu_count() or 1)


class Race(NamedTuple):
    """What `race` measured: each pipeline's least time and the model's, the rounds run, and
    on CPUs the share of its threads' time the model's fastest run got (None where a GPU runs)."""

    pipelines_s: tuple[float, ...]
    model_s: float
    rounds: int
    cpu_share: float | None = None


def race(plans: Sequence[Plan], model: nn.Module, recipe: Recipe, rounds: int = 5,
         budget_s: float = 1.0) -> Race:
    """The plans' pipelines and the model run whole, on the example, timed in interleaved
    rounds (the order turning each round) after one warm-up each: the least time of each, and
    the rounds run (`rounds`, or fewer, at least 3, once `budget_s` is spent). In inference a
    run is a call, as `Pipeline.forward` makes it (`call_stages`); in training (the plans'
    mode) one train step with the sum of the outputs as the loss (`train_stages`) against the
    model's forward and backward. Each run ends with its devices' work done. Without side
    effects: `.grad`, the model's and the stages' buffers and the random generators are
    restored.

    On CPUs, also the process's CPU time over the model's fastest run, as a share of its
    threads' wall time: all its threads work through a run (OpenMP's wait by spinning), so a
    share well under 1 means other processes held the cores (0.99 here on a quiet machine, 0.71
    with one core busy)."""
    training = bool(plans[0].training)
    args, kwargs = recipe.args, recipe.kwargs
    devices = {t.device for t in [*model.parameters(), *model.buffers(), *tensors((args, kwargs))]}
    devices |= {torch.device(stage.device) for plan in plans for stage in plan.stages}
    params = [p for p in model.parameters() if p.requires_grad]

    runtimes = [runtime_of(plan) for plan in plans]

    def pipeline(plan: Plan, runtime: Runtime) -> Callable[[], None]:
        step = train_stages if training else call_stages
        return lambda: step(plan, runtime, copied(args), copied(kwargs))

    def whole() -> None:
        out = model(*copied(args), **copied(kwargs))
        loss = sum(t.float().sum() for t in pytree.tree_leaves(out)
                   if isinstance(t, torch.Tensor) and t.requires_grad)
        if training and isinstance(loss, torch.Tensor):
            torch.autograd.grad(loss, params, allow_unused=True)    # .grad left alone
    runs = [*map(pipeline, plans, runtimes), whole]
    times: list[list[tuple[float, float]]] = [[] for _ in runs]
    with contextlib.ExitStack() as kept:
        for runtime in runtimes:          # the raced pipelines' workers end with the race
            kept.callback(runtime.close)
        for module in {id(m): m for m in [model, *(p.graph for p in plans)]}.values():
            kept.enter_context(unchanged(module))
        kept.enter_context(torch.set_grad_enabled(training))
        for run in runs:
            run()
        start = time.perf_counter()
        for r in range(rounds):
            turn = r % len(runs)
            for i in [*range(turn, len(runs)), *range(turn)]:
                synchronize(*devices)
                began, cpu = time.perf_counter(), time.process_time()
                runs[i]()
                synchronize(*devices)
                times[i].append((time.perf_counter() - began, time.process_time() - cpu))
            if r >= 2 and time.perf_counter() - start > budget_s:
                break
    model_s, model_cpu_s = min(times[-1])
    share = (model_cpu_s / (model_s * torch.get_num_threads())
             if all(is_cpu(d) for d in devices) and model_s > 0 else None)
    return Race(tuple(min(t)[0] for t in times[:-1]), model_s, len(times[-1]), share)
