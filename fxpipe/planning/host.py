"""What a call costs this process besides its stages' work, measured on the machine at plan
time and cached per process and thread layout: the runtime's own hand-off between CPU stages
(`handoff_s`, which `priced_link` prices as the default link), a call's start and end,
splitting and merging its leaves, the time a node's call holds the interpreter lock and a waiting
thread's wake-up (`host_costs`, which `priced_host` gives as a `HostCosts`), and in a train step
each action's own work (`train_action_s`).

`handoff_s` is an empty pipeline through the runtime's workers and queues, over the hand-offs the
cost model counts in it (fitted with the call's own start and end at two micro-batch counts);
`train_action_s` the same pipeline's train steps against its calls; `lock_s` times tiny nodes on
one thread and on several at once (the interpreter lock's share of a node's call); `wake_s` two
threads passing a turn. Each takes tens of milliseconds, once. Where stages share a process and
cores, planning measures the lock on the graph itself instead (`lock_held`, with its costs).
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import threading
import time
from dataclasses import replace
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.cost_model import DeviceSpec, HostCosts, Link, LinkFn, default_link
from fxpipe.passes.device import is_cpu
from fxpipe.passes.materialize import holds_meta
from fxpipe.passes.randomness import microbatch_seed
from fxpipe.passes.stage import Stage

from ..runtime import Runtime, microbatch
from ..runtime.schedules import gpipe, simulate, timetable_for
from ..runtime.wiring import Wiring
from .whole import WholeRuns, computing


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` intra-op threads on this thread (None: as it is)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
    runtime = Runtime(stages, wiring, threads_per_stage=list(threads), name="fxpipe-probe")
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


@functools.lru_cache(maxsize=None)
def train_action_s(threads: tuple[int | None, ...], cores: int) -> float:
    """A training action's own runtime work besides its stage's and its hand-offs
    (`HostCosts.train_action_s`): train steps of `HANDOFF_CHUNKS` micro-batches through stages
    scaling what they receive by a parameter (each micro-batch's loss the sum of the last's
    output), and calls of the same, `HANDOFF_RUNS` times each, interleaved, by the real runtime.
    What a micro-batch adds to a step, less twice what it adds to a call (a backward's
    hand-offs are priced as a forward's are), over its forward and backward on each stage.
    About a quarter of a second, once a layout, for training plans only."""
    k = len(threads)
    stages = [Stage(i, _scaling(), (f"v{i}",), (f"v{i + 1}",), torch.device("cpu"))
              for i in range(k)]
    runtime = Runtime(stages, Wiring.of(stages, [f"v{k}"]), threads_per_stage=list(threads),
                      name="fxpipe-probe")
    times: dict[tuple[bool, int], list[float]] = {
        (training, chunks): [] for training in (False, True) for chunks in HANDOFF_CHUNKS}
    try:
        for run in range(HANDOFF_RUNS + 1):
            for training, chunks in times:
                began = time.perf_counter()
                runtime.run(timetable_for("gpipe", k, chunks, backward=training),
                            [{"v0": torch.zeros(1)}] * chunks, seeds=[0] * chunks,
                            loss_of=(lambda m, values: values[f"v{k}"].sum()) if training
                            else None)
                if run:                         # the first starts the workers
                    times[training, chunks].append(time.perf_counter() - began)
    finally:
        runtime.close()
    few, many = HANDOFF_CHUNKS
    added = {training: (statistics.median(times[training, many]) -
                        statistics.median(times[training, few])) / (many - few)
             for training in (False, True)}
    return max(0.0, added[True] - 2 * added[False]) / (2 * k)


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
        with torch.no_grad(), intra_op_threads(1):
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


def lock_held(gm: fx.GraphModule, args: tuple, kwargs: Mapping[str, Any], training: bool,
              device: torch.device, threads: int | None, repeats: int = 3
              ) -> tuple[float, float] | None:
    """How long each node of `gm` holds the interpreter lock, forward and backward
    (`HostCosts.lock_s`, `backward_lock_s`), measured as stages on threads of one process share
    it: the graph run on `LOCK_COPIES` threads at once (`threads` intra-op threads each, a core
    each), against its runs alone just before, each side at least `LOCK_LEAST_S`. Where runs at
    once take `r` times as long as alone, the share `f` of a run held is the one with which the
    simulator (`schedules.lock_slowdown`) has as many such runs take `r` times as long. Per
    node: `f` of the graph's time (its nodes' costs, `calibrate`d) over its nodes. None where
    the machine has too few cores for two copies, on a GPU (what its stages share is priced
    apart) and on meta."""
    nodes = computing(gm)
    copies = min(LOCK_COPIES, (os.cpu_count() or 1) // (threads or 1))
    if copies < 2 or not nodes or not is_cpu(device) or holds_meta(gm):
        return None
    runner = WholeRuns(gm, args, kwargs, training, device)
    with runner.kept():
        alone = runner.medians(runner.runs(repeats, LOCK_LEAST_S))
    stop, errors = threading.Event(), []
    started = [threading.Event() for _ in range(copies - 1)]

    def beside(started: threading.Event) -> None:
        try:
            with intra_op_threads(threads), microbatch_seed(0):
                while not stop.is_set():
                    runner.runs(0)
                    started.set()
        except BaseException as e:          # re-raised on the measuring thread
            errors.append(e)
            started.set()
    others = [threading.Thread(target=beside, args=(event,), name="fxpipe-measure", daemon=True)
              for event in started]
    with runner.kept():
        try:
            for other in others:
                other.start()
            for event in started:
                event.wait()
            together = None if errors else runner.medians(runner.runs(repeats, LOCK_LEAST_S))
        finally:
            stop.set()
            for other in others:
                other.join()
    if errors:
        raise errors[0]
    shares = [_held_share(t / a, copies) if a > 0 else 0.0 for t, a in zip(together, alone)]
    nodes_s = [sum(n.meta["cost"].fwd_s for n in nodes), sum(n.meta["cost"].bwd_s for n in nodes)]
    return (shares[0] * nodes_s[0] / len(nodes),
            shares[1] * nodes_s[1] / len(nodes) if training else 0.0)


# `lock_held`'s runs alone and at once each fill at least this long (a quick graph's medians
# then rest on many runs); the copies run at once: what two stages cost each other (more would
# hold more copies' activations at once, of a model planned near its memory).
LOCK_LEAST_S, LOCK_COPIES = 0.01, 2


def _held_share(slowdown: float, copies: int) -> float:
    """The share of its time each of `copies` alike runs holds the lock, where running at once
    took them `slowdown` times as long: the inverse of `schedules.lock_slowdown` for runs
    alike (each waits for the others' holds: 1 + (copies - 1) f^2; held in turn: copies x f),
    0 to 1."""
    if slowdown <= 1:
        return 0.0
    return min(1.0, ((slowdown - 1) / (copies - 1)) ** 0.5, slowdown / copies)


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


def _scaling() -> fx.GraphModule:
    """A stage scaling what it receives by a parameter: the least a stage trains."""
    root = nn.Module()
    root.register_parameter("scale", nn.Parameter(torch.ones(())))
    graph = fx.Graph()
    graph.output((graph.call_function(torch.mul, (graph.placeholder("x"),
                                                  graph.get_attr("scale"))),))
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


def priced_host(devices: Sequence[DeviceSpec], training: bool = False) -> HostCosts:
    """What a call (or in `training` a train step) costs the process besides the stages on
    `devices` (`host_costs`, `train_action_s`), where they are all CPU stages on threads of
    this process; else nothing priced (`HostCosts()`)."""
    if not all(is_cpu(d.name) for d in devices):
        return HostCosts()
    layout = (tuple(d.threads for d in devices), os.cpu_count() or 1)
    costs = host_costs(*layout)
    return replace(costs, train_action_s=train_action_s(*layout)) if training else costs
