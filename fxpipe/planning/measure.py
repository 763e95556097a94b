"""Node costs measured as the stages will run them, and the model's own time to beat.

`Costs` measures the graph once per micro-batch size, device kind (a CPU kind per thread count)
and thread (the caller's, or a worker's as the stages of a pipeline run on), reusing what a
plan passed as `costs=` measured, and `calibrate`s each measurement to the whole graph's time
measured in the same conditions (`fitted`: the sizes between two measured ones interpolated,
for weighing; `as_is`: the model as is, scaled to its own time); `Baseline` times the model as
given, whole, between those measurements. What a call costs the process besides its stages (the
runtime's hand-offs, the call's own work) is `host.py`'s; so is the interpreter lock, but where
stages share a process and the cores let them run at once, `lock_held` measures it on the graph
itself, with the costs (its runs on threads at once against alone).

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
`race` runs pipelines and the model on the example, interleaved (calls, or in training train
steps with the outputs' sum as the loss: `runtime.calls.train_stages`), and keeps the least
times.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.annotate_costs import WRITTEN, annotate_costs
from fxpipe.passes.device import is_cpu
from fxpipe.passes.cost_model import DeviceSpec, HostCosts, NodeCost, cost_graph
from fxpipe.passes.errors import CostError
from fxpipe.passes.graph_values import tensors

from ..runtime import microbatch
from . import search
from ..runtime.devices import shared_memory, synchronize
from ..runtime.calls import call_stages, runtime_of, train_stages
from ..plans.plan_data import Measurement, Plan
from ..runtime import Runtime
from .host import intra_op_threads, lock_held, priced_host
from .whole import WholeRuns, computing
from .reference import copied, unchanged

if TYPE_CHECKING:
    from .recipe import Recipe


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
        self.locks: dict[tuple, tuple[float, float] | None] = {}     # `lock_held`, per node
        self.marks: dict[tuple, dict[str, dict[str, Any]]] = {}
        self.scaled: dict[tuple, dict[fx.Node, NodeCost]] = {}     # the model as is (`as_is`)
        self.costed: dict[tuple, tuple[Mapping, search.Costed]] = {}     # by `_costed`
        saved = recipe.options.costs
        self.saved: Mapping[tuple, Measurement] = {
            key: m for key, m in (saved.record.measurements if saved is not None else {}).items()
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
                self.calibration[chunks, kind, worker], self.marks[chunks, kind, worker],
                self.locks.get((chunks, kind, worker)))
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
        if len(devices) == 1 and (config.chunks, devices[0].kind, worker) in self.scaled:
            return self._costed({devices[0].kind: self.scaled[config.chunks, devices[0].kind,
                                                              worker]}, devices)     # `as_is`
        for device in {d.kind: d for d in devices}.values():
            key = (config.chunks, device.kind, worker)
            if key not in self.measured:
                self.measured[key] = self._measure(config.chunks, device, worker)
                self.between()
        return self._costed({d.kind: self.measured[config.chunks, d.kind, worker]
                             for d in devices}, devices,
                            [self.locks.get((config.chunks, d.kind, worker)) for d in devices])

    def is_measured(self, config: search.Config, devices: Sequence[DeviceSpec]) -> bool:
        """Whether `config`'s costs on `devices` were measured (or reused from `costs=`), not
        only fitted."""
        return all((config.chunks, d.kind, config.num_stages > 1) in self.measured or
                   self._key(config.chunks, d.kind, config.num_stages > 1) in self.saved
                   for d in devices)

    def fitted(self, config: search.Config, devices: Sequence[DeviceSpec]
               ) -> search.Costed | None:
        """The graph costed as `measure` would cost it, each node's cost interpolated in the
        micro-batch's rows between the two nearest sizes measured on either side, in the same
        kind and thread (`fit_cost`): what a node costs is about affine in its rows (a fixed
        cost per call, then time per row), so configurations are weighed on this and only those
        that may be chosen are measured (`fxpipe.planning.prepare.weigh` checks the fit on each).
        None where no measured sizes bracket the configuration's, or it was measured."""
        if self.is_measured(config, devices):
            return None
        worker, rows = config.num_stages > 1, self.rows(config.chunks)
        found, locks = {}, {}
        for kind in dict.fromkeys(d.kind for d in devices):
            sizes = {self.rows(c): c for c, k, w in self.measured if k == kind and w == worker}
            below = [r for r in sizes if r < rows]
            above = [r for r in sizes if r > rows]
            if not below or not above:
                return None
            low, high = max(below), min(above)
            at_low, at_high = (self.measured[sizes[r], kind, worker] for r in (low, high))
            at = (rows - low) / (high - low)
            found[kind] = {n: fit_cost(at_low[n], at_high[n], at) for n in at_low}
            lows, highs = (self.locks.get((sizes[r], kind, worker)) for r in (low, high))
            locks[kind] = None if lows is None or highs is None else tuple(
                a + (b - a) * at for a, b in zip(lows, highs))
        return self._costed(found, devices, [locks[d.kind] for d in devices])

    def as_is(self, config: search.Config, devices: Sequence[DeviceSpec],
              seconds: float | None) -> search.Costed | None:
        """The model as is (`config`: one stage, the whole batch, the caller's threads) costed
        without measuring its nodes on its threads: those measured at its rows for a pipeline's
        stage (other threads, a worker), scaled so that they add up to the model's own time
        `seconds` (`Baseline`: the model run whole as it is, measured so), as `calibrate`
        scales a measurement to the graph's time in the same conditions. Its time is its own
        measured time anyway; its nodes' sizes (what says whether it fits) do not depend on
        threads. The scaled costs serve every later `measure` of `config` (its plan), and are
        no measurement a later `costs=` reuses. None where no pipeline measured its rows, or
        its own costs were measured."""
        (kind,) = {d.kind for d in devices}
        key = (config.chunks, kind, config.num_stages > 1)
        if key not in self.scaled:
            rows = self.rows(config.chunks)
            source = next((k for k in self.measured if self.rows(k[0]) == rows), None)
            if seconds is None or source is None or self.is_measured(config, devices):
                return None
            found = self.measured[source]
            total = sum(c.fwd_s + c.bwd_s * self.training for n, c in found.items()
                        if n.op not in ("placeholder", "get_attr"))     # as `calibrate` sums
            scale = seconds / (total or seconds)
            self.scaled[key] = {n: replace(cost, fwd_s=cost.fwd_s * scale,
                                           bwd_s=cost.bwd_s * scale)
                                for n, cost in found.items()}
            forward, backward = self.calibration[source]
            self.calibration[key] = (forward * scale,
                                     backward * scale if self.training else backward)
        return self._costed({kind: self.scaled[key]}, devices)

    def rows(self, chunks: int) -> int:
        """The rows of the first of `chunks` micro-batches (the one costs are measured on)."""
        recipe = self.recipe
        first = microbatch.split((recipe.args, recipe.kwargs), chunks, recipe.input_dims)[0]
        return microbatch.rows_of(first, recipe.input_dims) or 1

    def _costed(self, by_kind: Mapping[str, Mapping[fx.Node, NodeCost]],
                devices: Sequence[DeviceSpec],
                locks: Sequence[tuple[float, float] | None] = ()) -> search.Costed:
        """The graph costed with each kind's node costs, left on the nodes, and what a call
        costs the process besides them on `devices` (`priced_host`), the interpreter lock as
        each device's kind measured it on the graph (`lock_held`: the most of them) where
        every one did; built once per costs and devices (a configuration weighed, then
        planned, is costed once)."""
        kinds = list(by_kind)
        for n in self.gm.graph.nodes:
            if n.op != "output":
                n.meta["costs"] = {k: by_kind[k][n] for k in kinds}
                n.meta["cost"] = n.meta["costs"][kinds[0]]
        key = (tuple((k, id(costs)) for k, costs in by_kind.items()), tuple(devices),
               tuple(locks))
        if key not in self.costed:      # the costs kept with it: their ids stay theirs
            in_process = self.recipe.options.link_name in ("default", "measure")
            host = priced_host(devices, self.training) if in_process else HostCosts()
            if host.holds_lock and locks and all(lock is not None for lock in locks):
                host = replace(host, lock_s=max(lock[0] for lock in locks), wake_s=0.0,
                               backward_lock_s=max(lock[1] for lock in locks))
            forward = cost_graph(self.gm, kinds=kinds)
            step = cost_graph(self.gm, training=True, kinds=kinds) if self.training else forward
            self.costed[key] = (by_kind, search.Costed(forward, step, host))
        return self.costed[key][1]

    def _measure(self, chunks: int, device: DeviceSpec, worker: bool) -> dict[fx.Node, NodeCost]:
        gm, recipe = self.gm, self.recipe
        reused = self.saved.get(self._key(chunks, device.kind, worker))
        if reused is not None:
            self.calibration[chunks, device.kind, worker] = reused.calibration
            self.locks[chunks, device.kind, worker] = reused.lock
            self.marks[chunks, device.kind, worker] = dict(reused.marks)
            for n in gm.graph.nodes:     # as measuring writes them: the state units read these
                n.meta.update(reused.marks.get(n.name, {}))
            return {n: reused.costs[n.name] for n in gm.graph.nodes if n.op != "output"}
        args, kwargs = microbatch.split((recipe.args, recipe.kwargs), chunks,
                                        recipe.input_dims)[0]

        def run():
            with intra_op_threads(device.threads):
                annotate_costs(gm, args, kwargs, device=device.name,
                               repeats=recipe.options.repeats, backward=self.training,
                               reuse_blocks=recipe.options.reuse_blocks,
                               progress=recipe.progress.nodes, materialize=recipe.plausible)
                self.calibration[chunks, device.kind, worker] = calibrate(
                    gm, args, kwargs, self.training, torch.device(device.name))
                self.locks[chunks, device.kind, worker] = lock_held(
                    gm, args, kwargs, self.training, torch.device(device.name),
                    device.threads) if worker else None
        _on_worker_thread(run) if worker else run()
        self.marks[chunks, device.kind, worker] = {
            n.name: {key: n.meta[key] for key in WRITTEN if key != "cost" and key in n.meta}
            for n in gm.graph.nodes}
        return {n: n.meta["cost"] for n in gm.graph.nodes if n.op != "output"}


def fit_cost(low: NodeCost, high: NodeCost, at: float) -> NodeCost:
    """A node's cost `at` (0 to 1) of the way from its cost measured on fewer rows (`low`) to
    that on more (`high`): times and bytes interpolated (bytes to the nearest byte: a value's
    size is affine in its rows), the spread the larger; the rest `low`'s."""
    between = lambda a, b: a + (b - a) * at       # noqa: E731
    return replace(low, fwd_s=between(low.fwd_s, high.fwd_s), bwd_s=between(low.bwd_s, high.bwd_s),
                   out_bytes=round(between(low.out_bytes, high.out_bytes)),
                   saved_bytes=round(between(low.saved_bytes, high.saved_bytes)),
                   new_bytes=None if low.new_bytes is None or high.new_bytes is None else
                   round(between(low.new_bytes, high.new_bytes)),
                   spread=max(low.spread, high.spread))


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
    node costs: the graph run whole (`WholeRuns`) measures what a stage will see. The median of
    `repeats` runs after a warm-up, on `device` (default: where `gm`'s parameters are).

    A graph holding meta tensors (planned from the meta device) is not calibrated: factors 1,
    the nodes' own times stand. Its whole run would time drawing every node's weights with the
    nodes (several times the graph's own time), and run the whole model's weights through memory
    once per repeat; its backward would keep them all alive at once.
    """
    nodes = computing(gm)
    node_fwd_s = sum(n.meta["cost"].fwd_s for n in nodes)
    node_bwd_s = sum(n.meta["cost"].bwd_s for n in nodes)
    device = device or next((t.device for t in gm.parameters()), torch.device("cpu"))
    runner = WholeRuns(gm, args, kwargs, training, device)
    if runner.meta:
        return 1.0, 1.0
    with runner.kept():
        forward, backward = runner.medians(runner.runs(repeats))
    scale = (forward / node_fwd_s if node_fwd_s > 0 else 1.0,
             backward / node_bwd_s if training and node_bwd_s > 0 else 1.0)
    for n in nodes:
        cost = n.meta["cost"]
        n.meta["cost"] = replace(cost, fwd_s=cost.fwd_s * scale[0], bwd_s=cost.bwd_s * scale[1])
    return scale


class Baseline:
    """The model's own time for one batch, as given: whole, on its device, with the caller's
    threads (in training, forward and backward to every parameter): what a pipeline must beat.

    Measured warm (one run first, not counted), `first` samples at once, then one more at each
    `sample()` (a sample: one run, or several of a quick model): planning samples it between the
    stages' measurements (`Costs(between=...)`), so a disturbance of the machine that moves the
    stages' costs moves the baseline alike, and no single run sets it. `seconds` is the median of the runs, `spread` how far they disagree
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
        enough runs. A model quicker than `REWARM_S` runs once untimed first: the stages'
        measurements between samples leave its threads asleep and its caches cold (ResNet-50 at
        13 ms ran 2-3 ms slower right after one, its runs' spread 45-71% against 6-8%), and for
        a slower model the same cost is a smaller share and a second run a larger one."""
        if self.times and min(self.times) < self.REWARM_S:
            self._run()
        spent = 0.0
        for _ in range(self.SAMPLE_RUNS):
            self.times.append(self._run())
            spent += self.times[-1]
            if spent >= self.SAMPLE_S:
                return

    SAMPLE_S = 2e-3
    SAMPLE_RUNS = 10
    REWARM_S = 0.1

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


class Race(NamedTuple):
    """What `race` measured: each pipeline's least time and the model's, the rounds run, and
    on CPUs the share of its threads' time the model's fastest run got (None where a GPU runs)."""

    pipelines_s: tuple[float, ...]
    model_s: float
    rounds: int
    cpu_share: float | None = None


# A race whose fastest (pipeline or model) leads every other by more than this share after its
# first 3 rounds is decided: several times what the least of 3 runs moves on a quiet machine.
DECIDED = 0.10


def _decided(times: Sequence[Sequence[tuple[float, float]]]) -> bool:
    """Whether the least times so far name a winner by over `DECIDED` (see `race`)."""
    first, second = sorted(min(t)[0] for t in times)[:2]
    return first < second * (1 - DECIDED)


def race(plans: Sequence[Plan], model: nn.Module, recipe: Recipe, rounds: int = 5,
         budget_s: float = 1.0) -> Race:
    """The plans' pipelines and the model run whole, on the example, timed in interleaved
    rounds (the order turning each round) after one warm-up each: the least time of each, and
    the rounds run (`rounds`, or fewer, at least 3, once `budget_s` is spent or the fastest
    leads every other by over `DECIDED`: more rounds would not change the winner). In inference a
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
            if r >= 2 and (time.perf_counter() - start > budget_s or _decided(times)):
                break
    model_s, model_cpu_s = min(times[-1])
    share = (model_cpu_s / (model_s * torch.get_num_threads())
             if all(is_cpu(d) for d in devices) and model_s > 0 else None)
    return Race(tuple(min(t)[0] for t in times[:-1]), model_s, len(times[-1]), share)
