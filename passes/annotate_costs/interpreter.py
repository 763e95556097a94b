"""`CostInterpreter`: runs a graph once, timing each node's call (and its backward alone) and
recording what its output takes; `Estimates`: the nodes that cannot run here, costed from their
FLOPs and bytes on meta."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..blocks import block_of, counterparts
from ..device import start_timer
from ..errors import CostError
from ..graph_values import attr_value, plain, tensors
from ..materialize import Materialize, MaterializingInterpreter
from ..state import StateWatch, storage_of
from .reuse import Reuse


class CostInterpreter(MaterializingInterpreter):
    """An Interpreter that records the wall time and output size of every node it runs (with
    `materialize`, a node's weights are drawn before its timer starts: see
    `fxpipe.passes.materialize`).

    With `reuse_blocks`, a node of a repeated block runs in the first run only (see `Reuse`); a
    node that cannot run here is not run, its output stood in for (see `Estimates`)."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, *, backward: bool = False,
                 progress: Callable[[int, int], None] | None = None,
                 materialize: Materialize | None = None, reuse_blocks: bool = False,
                 max_node_bytes: int | None = None):
        super().__init__(gm, materialize=materialize, device=device)
        self.device = device
        self.backward = backward
        self.progress = progress
        self.total = sum(1 for n in gm.graph.nodes if n.op != "output")
        self.times_s: dict[fx.Node, list[float]] = {}
        self.backward_s: dict[fx.Node, list[float]] = {}
        self.out_bytes: dict[fx.Node, int] = {}
        # The memory each output takes that its inputs did not have, and the nodes whose
        # memory it shares (a view's base): what a stage's forward holds at once.
        self.new_bytes: dict[fx.Node, int] = {}
        self.views: dict[fx.Node, tuple[str, ...]] = {}
        self.shapes: dict[fx.Node, tuple[tuple[int, ...], ...]] = {}   # of the output's tensors
        # Kept for the backward (with `backward`): bytes of tensors the node made inside, and
        # which nodes' values it keeps (its inputs', its own).
        self.saved_bytes: dict[fx.Node, int] = {}
        self.saved_values: dict[fx.Node, set[fx.Node]] = {}
        # The values autograd does not track in the model's own training run (none of what made
        # them needs a gradient: a rotary table, a mask): given to a node's backward as they
        # are, not as leaves, so that it keeps and computes what the model's backward does.
        self.untracked: set[fx.Node] = set()
        self.watch: StateWatch | None = None     # set for a run that finds the state written
        self.runs = 0
        # A graph on meta knows its repeats from the capture's types, before anything runs.
        self.reuse = Reuse(gm, reuse_blocks, early=materialize is not None)
        self.estimates = Estimates(self, max_node_bytes)

    def run_node(self, n: fx.Node) -> Any:
        if self.reuse.skips(n) or self.estimates.stands_in(n):
            return self._not_measured(n)
        return self.with_weights(n, self._timed)

    def _timed(self, n: fx.Node) -> Any:
        elapsed_s = start_timer(self.device)
        try:
            if self.watch is not None:
                with self.watch.watching(n, tensors([self.env[p] for p in n.all_input_nodes])):
                    result = self.run_plain(n)
            else:
                result = self.run_plain(n)
            self.times_s.setdefault(n, []).append(elapsed_s())
            if n.op in ("placeholder", "get_attr") and \
                    not any(t.requires_grad for t in tensors(result)):
                self.untracked.add(n)
            if self.backward and n.op.startswith("call"):
                self.backward_s.setdefault(n, []).append(self._time_backward(n))
        except Exception as e:
            if self.estimates.take(n, e):
                return self._not_measured(n)
            raise CostError(f"node {n.name!r} failed while its cost was measured\n"
                            f"{type(e).__name__}: {e}\n  node: {n.format_node()}") from e
        return self._record(n, result)

    def _not_measured(self, n: fx.Node) -> Any:
        """The value of a node not run: an estimate's stand-in, or a repeat's from the first
        run."""
        if n in self.estimates.nodes:
            return self._record(n, self.estimates.value(n))
        self._count()
        return self.reuse.value(n)

    def _record(self, n: fx.Node, result: Any) -> Any:
        self.out_bytes[n] = tensor_bytes(result)
        self.new_bytes[n], self.views[n] = self._new_memory(n, result)
        self.shapes[n] = tuple(tuple(t.shape) for t in tensors(result))
        if self.first and n not in self.estimates.nodes:    # an estimated block repeats nothing
            self.reuse.ran(n, result)
        if n.op != "output":                                # not among the nodes counted
            self._count()
        return result

    def _new_memory(self, n: fx.Node, result: Any) -> tuple[int, tuple[str, ...]]:
        """The bytes of the storages `n`'s output holds that none of its inputs, nor the
        module it calls, holds (each storage once), and the input nodes whose storage it
        shares (not parameter reads: those live anyway). A tensor without storage here (on
        meta: a node estimated) counts as new."""
        given: dict[int, fx.Node] = {}
        for p in n.all_input_nodes:
            for t in tensors(self.env.get(p)):
                where = storage_of(t)
                if where is not None:
                    given.setdefault(where, p)
        state: set[int | None] = set()
        if n.op == "call_module":
            module = self.fetch_attr(n.target)
            state = {storage_of(t) for t in [*module.parameters(), *module.buffers()]}
        new, views, seen = 0, {}, set()
        for t in tensors(result):
            where = storage_of(t)
            if where is None:
                new += t.numel() * t.element_size()
            elif where not in seen:
                seen.add(where)
                if where in given:
                    if given[where].op != "get_attr":
                        views[given[where].name] = None
                elif where not in state:
                    new += t.untyped_storage().nbytes()
        return new, tuple(views)

    def copy_repeats(self) -> None:
        """After a first run that skipped the repeats (`Reuse.early`): each repeat's output
        bytes, new memory, shapes and what it keeps for backward are those of the node it
        repeats, its views and kept values that node's mapped onto its own block
        (`blocks.counterparts`), and the buffers it touches and writes (`StateWatch`) that
        node's renamed into its block."""
        of, by_name = self.reuse.of, {n.name: n for n in self.module.graph.nodes}
        repeats: dict[str, list[fx.Node]] = {}
        for n in of:
            repeats.setdefault(block_of(n), []).append(n)
        for name, nodes in repeats.items():
            first = [of[n] for n in nodes]
            mapped = counterparts(first, nodes)
            renamed = _renaming(block_of(first[0]), name)
            for n, f in zip(nodes, first):
                self.out_bytes[n], self.shapes[n] = self.out_bytes[f], self.shapes[f]
                self.new_bytes[n] = self.new_bytes[f]
                self.views[n] = tuple(mapped[by_name[v]].name if by_name[v] in mapped else v
                                      for v in self.views[f])
                if f in self.saved_bytes:
                    self.saved_bytes[n] = self.saved_bytes[f]
                if f in self.saved_values:
                    self.saved_values[n] = {mapped.get(v, v) for v in self.saved_values[f]}
                if self.watch is not None and f in self.watch.touched:
                    self.watch.touched[n] = set(map(renamed, self.watch.touched[f]))
            if self.watch is not None:
                self.watch.written |= set(map(renamed, self.watch.written))

    def _count(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.done = 0       # nodes measured in this run
        self.first = self.runs == 0
        self.runs += 1
        return super().run(*args, **kwargs)

    def _time_backward(self, n: fx.Node) -> float:
        """The time of the node's backward alone: its inputs as fresh leaves, ones as gradient.

        `torch.autograd.grad` leaves every `.grad` as it was."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        state = {id(self.env[p]) for p in n.all_input_nodes if p.op == "get_attr"}
        real = list(self.real.values())        # the node's weights, given for this run
        buffers = {storage_of(b) for b in [*self.module.buffers(), *real]
                   if not isinstance(b, nn.Parameter)} - {None}
        origin = {id(t): p for p in n.all_input_nodes for t in tensors(self.env[p])}
        given: dict[Any, fx.Node] = {}     # storage of what the node is given -> whose value

        def give(v: Any) -> Any:          # activations become leaves; parameters stay;
            new = (v.detach().clone() if storage_of(v) in buffers else   # buffers are copied,
                   v if id(v) in state else                               # so a write stays off
                   v.detach() if origin.get(id(v)) in self.untracked else _leaf_if_float(v))
            if isinstance(v, torch.Tensor) and id(v) in origin:
                given.setdefault(storage_of(new), origin[id(v)])
            return new
        args, kwargs = plain(fx.node.map_aggregate((args, kwargs), give))
        params = {storage_of(p) for p in [*self.module.parameters(), *real]
                  if isinstance(p, nn.Parameter)}
        saved: dict[Any, int] = {}     # storage -> bytes, of what autograd keeps for backward

        def pack(t: torch.Tensor) -> torch.Tensor:
            where = storage_of(t)
            if where not in params:
                saved[where if where is not None else id(t)] = t.untyped_storage().nbytes()
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = getattr(self, n.op)(n.target, args, kwargs)
        # A kept input or output is a value of the graph, counted once however many nodes keep
        # it (see `_write_costs`); the rest the node made inside, and is its own.
        for t in tensors(out):
            given.setdefault(storage_of(t), n)
        self.saved_values[n] = {given[where] for where in saved if where in given}
        self.saved_bytes[n] = sum(b for where, b in saved.items() if where not in given)
        outputs = [t for t in tensors(out) if t.requires_grad]
        if not outputs:
            self.untracked.add(n)
        wanted = [t for t in tensors((args, kwargs)) if t.requires_grad]
        modules = [self.env[p] for p in n.all_input_nodes if isinstance(self.env[p], nn.Module)]
        if n.op == "call_module":
            modules.append(self.fetch_attr(n.target))
        wanted += [p for m in modules for p in m.parameters() if p.requires_grad]
        if not outputs or not wanted:
            return 0.0
        grads = [torch.ones_like(t) for t in outputs]
        elapsed_s = start_timer(self.device)
        torch.autograd.grad(outputs, wanted, grads, allow_unused=True)
        return elapsed_s()


class Estimates:
    """Nodes that cannot run where costs are measured, and their costs from FLOPs and bytes.

    A node's profile is a run on the meta device under `FlopCounterMode`: its FLOPs, the bytes
    it reads and writes (inputs, parameters, output) and its output's types, at no cost in
    memory. In the first run, a node without a kernel for the device, or whose parameters and
    output take more than `max_node_bytes` (with a limit, every node is profiled first), or that
    reads a value on meta (its input stood in for and too big, or a weight over the limit, which
    a `get_attr` then leaves on meta: never materialised) is not run: its output is stood
    in for by zeros (left on meta where it is over the limit). The run after profiles the nodes
    that ran. Its time is a roofline fitted to the nodes that ran: the device's FLOPs per second
    on nodes that count FLOPs, its bytes per second on those that do not, the slower of the two;
    its backward the measured backward-to-forward ratio; what it keeps for backward, its inputs.
    """

    def __init__(self, interpreter: CostInterpreter, max_node_bytes: int | None):
        self.interpreter = interpreter
        self.max_node_bytes = max_node_bytes
        self.nodes: set[fx.Node] = set()
        self.profiles: dict[fx.Node, Profile] = {}

    def stands_in(self, n: fx.Node) -> bool:
        """Whether `n` is estimated instead of run (decided in the first run); profiles it where
        needed: in the first run with a limit or when it reads a value on meta, and a measured
        node in the run after one that estimated some (the fit's samples)."""
        if n.op == "get_attr":
            return self._weight_stands_in(n)
        if n in self.nodes or not n.op.startswith("call"):
            return n in self.nodes
        first = self.interpreter.first
        args, kwargs = self.interpreter.fetch_args_kwargs_from_env(n) if first else ((), {})
        # A value left on meta (over the limit) where the graph runs on real ones.
        reads_meta = (self.interpreter.device.type != "meta" and
                      any(t.is_meta for t in tensors((args, kwargs))))
        if (self.max_node_bytes is not None or reads_meta) if first else \
                (self.nodes and n not in self.profiles):
            self.profiles[n] = self._profile(n)
        profile = self.profiles.get(n)
        if first and profile is not None and (reads_meta or self._over_limit(profile)):
            self._estimate(n)
        return n in self.nodes

    def _weight_stands_in(self, n: fx.Node) -> bool:
        """Whether a `get_attr` of a tensor over the limit is left on meta (never materialised);
        its readers are then estimated."""
        if self.interpreter.first and self.max_node_bytes is not None:
            value = attr_value(self.interpreter.module, n.target)
            if isinstance(value, torch.Tensor) and tensor_bytes(value) > self.max_node_bytes:
                self.profiles[n] = Profile(0, 0, tensor_bytes(value), _on_meta(value))
                self.nodes.add(n)
        return n in self.nodes

    @property
    def ready(self) -> bool:
        """Whether the nodes that ran have the profiles the estimates are fitted to."""
        return not self.nodes or self.max_node_bytes is not None or self.interpreter.runs >= 2

    def take(self, n: fx.Node, error: Exception) -> bool:
        """Whether `n`, failed with `error` in the first run for want of a kernel, is estimated."""
        no_kernel = isinstance(error, NotImplementedError) or (
            isinstance(error, RuntimeError) and "not implemented for" in str(error))
        if self.interpreter.first and no_kernel:
            self.profiles[n] = self._profile(n)
            if self.profiles[n] is not None:
                self._estimate(n)
        return n in self.nodes

    def value(self, n: fx.Node) -> Any:
        """The stand-in for an estimated node's output: zeros, on meta where over the limit."""
        profile = self.profiles[n]
        if self._over_limit(profile, weights=False):
            return profile.out
        device = self.interpreter.device
        return fx.node.map_aggregate(profile.out, lambda v: torch.zeros_like(v, device=device)
                                     if isinstance(v, torch.Tensor) else v)

    def fit(self, timed: Mapping[fx.Node, tuple[float, float, float]]
            ) -> Callable[[fx.Node], tuple[float, float, float]]:
        """The estimate of a node's (forward, backward, spread) from the measured nodes' times."""
        ran = [(self.profiles[n], fwd_s, bwd_s) for n, (fwd_s, bwd_s, _) in timed.items()
               if self.profiles.get(n) is not None and fwd_s > 0]
        if not ran:
            first = next(n for n in self.interpreter.module.graph.nodes if n in self.nodes)
            raise CostError(
                f"node {first.name!r} cannot run on {self.interpreter.device}\nand no node ran "
                f"there to measure its speed for an estimate; measure on a device with kernels "
                f"for the model's ops, or raise max_node_bytes")
        overhead_s = min(fwd_s for _, fwd_s, _ in ran)     # what the smallest node costs
        counting = [(p.flops, fwd_s) for p, fwd_s, _ in ran if p.flops > 0]
        moving = [(p.moved_bytes, fwd_s) for p, fwd_s, _ in ran if p.flops == 0] or \
                 [(p.moved_bytes, fwd_s) for p, fwd_s, _ in ran]

        def rate(samples: list[tuple[int, float]]) -> float:    # per second, past the overhead
            work_s = sum(t - overhead_s for _, t in samples)
            return sum(amount for amount, _ in samples) / work_s if work_s > 0 else math.inf
        flops_per_s = rate(counting) if counting else math.inf
        bytes_per_s = rate(moving)
        forward_s = sum(fwd_s for _, fwd_s, bwd_s in ran if bwd_s > 0)
        backward = sum(bwd_s for *_, bwd_s in ran) / forward_s if forward_s > 0 else 0.0

        def estimate(n: fx.Node) -> tuple[float, float, float]:
            p = self.profiles[n]
            fwd_s = overhead_s + max(p.flops / flops_per_s, p.moved_bytes / bytes_per_s)
            return fwd_s, 0.0 if n.op == "get_attr" else fwd_s * backward, 0.0
        return estimate

    def _estimate(self, n: fx.Node) -> None:
        self.nodes.add(n)
        if self.interpreter.backward:   # it keeps its inputs, counted where they are made
            self.interpreter.saved_values[n] = {p for p in n.all_input_nodes
                                                if p.op != "get_attr"}

    def _over_limit(self, profile: Profile, weights: bool = True) -> bool:
        size = tensor_bytes(profile.out) + (profile.weight_bytes if weights else 0)
        return self.max_node_bytes is not None and size > self.max_node_bytes

    def _profile(self, n: fx.Node) -> Profile | None:
        """`n` run on the meta device under `FlopCounterMode`; None where it cannot run there."""
        interpreter = self.interpreter
        args, kwargs = fx.node.map_aggregate(interpreter.fetch_args_kwargs_from_env(n), _on_meta)
        args, kwargs = plain((args, kwargs))
        if n.op == "call_module":
            module = interpreter.module.get_submodule(n.target)
            weights = {k: _on_meta(t) for k, t in [*module.named_parameters(),
                                                    *module.named_buffers()]}
            call = lambda: torch.func.functional_call(module, weights, tuple(args), kwargs)
        else:
            weights = {p: interpreter.env[p] for p in n.all_input_nodes if p.op == "get_attr"}
            call = lambda: getattr(interpreter, n.op)(n.target, args, kwargs)
        try:
            with FlopCounterMode(display=False) as counter:
                out = call()
        except Exception:      # no meta kernel, or a value read on the host: no estimate
            return None
        weight_bytes = tensor_bytes(list(weights.values()))
        moved_bytes = tensor_bytes((args, kwargs, out)) + (   # a module's weights are not args
            weight_bytes if n.op == "call_module" else 0)
        return Profile(counter.get_total_flops(), moved_bytes, weight_bytes, out)


@dataclass(frozen=True)
class Profile:
    """What a node does, from a run on the meta device: FLOPs, bytes read and written, the bytes
    of the parameters it reads, and its output (on meta)."""

    flops: int
    moved_bytes: int
    weight_bytes: int
    out: Any


def _on_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _renaming(first: str, block: str) -> Callable[[str], str]:
    """A name under block `first` (`layers.0.bn.running_mean`) -> the same under `block`;
    any other name as it is."""
    prefix = first + "."
    return lambda name: block + "." + name[len(prefix):] if name.startswith(prefix) else name


def tensor_bytes(value: Any) -> int:
    """Bytes of all tensors in a (nested) value."""
    total = 0
    def visit(v):
        nonlocal total
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        return v
    fx.node.map_aggregate(value, visit)
    return total


def _leaf_if_float(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value
