"""Random numbers in a pipeline: one seed per micro-batch, drawn from the caller's generator.

Stages run on their own threads, and torch's default generators are shared by every thread, so
dropout drawn "from the global generator" would depend on which stage ran first. fxpipe fixes the
order instead: each call draws one base seed from the caller's default CPU generator (so
`torch.manual_seed(s)` before the call fixes its result, and consecutive calls differ), and
micro-batch `m` runs as if `torch.manual_seed(seeds[m])` had been called just before the model ran
on that micro-batch alone. That is the contract the runtime keeps and the reference runs check.

Each device draws from its own generator, as in torch: the CPU's state, and each GPU's, start
from the seed and follow the micro-batch's draws on that device (`RngState`). So a pipeline of
CPU stages, or of stages on one GPU, draws what the model draws there, while a plan over two
GPUs draws on the second GPU from the seed again, as the model placed by hand over those GPUs
after `torch.manual_seed` would: other numbers than on one GPU.

How: `seed_random_ops` rewrites every node that draws random numbers into a call of `seeded`,
which takes the generator state left by the previous draw and returns the op's result and the
state after it:

    dropout_draw = seeded(rng, torch.nn.functional.dropout, relu, p = 0.1, training = True)
    dropout = dropout_draw[0]
    rng_1 = dropout_draw[1]

The state is an ordinary graph value, so the draws keep the model's order across stages (the
partitioner sees the edges, the runtime's queues carry the state), and a micro-batch's first draw
starts from its seed, which the runtime sets per (stage, micro-batch) with `microbatch_seed`.
`seeded` installs the state in torch's default generators under one process-wide lock, runs the
draw and puts the caller's state back. A submodule that may draw (dropout inside, or code fxpipe
cannot see) runs whole through `seeded`, its draws routed one by one, so the lock is only held
while numbers are drawn. Outside a pipeline run `seeded` simply calls the op.

Example (dropout routed through `seeded`; outside a pipeline run it draws what the model draws):

>>> import torch
>>> from torch import fx, nn
>>> from fxpipe.passes.randomness import seed_random_ops, seeded
>>> model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()
>>> gm = seed_random_ops(fx.symbolic_trace(model))
>>> [n.name for n in gm.graph.nodes if n.target is seeded]
['_1']
>>> x = torch.randn(2, 4)
>>> _ = torch.manual_seed(0); ours = gm(x)
>>> _ = torch.manual_seed(0); torch.equal(ours, model(x))
True
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode

from .device import generators_of, rng_state, seeded_state, set_rng_state
from .graph_values import attr_value, tensors

_SEED_RANGE = 2 ** 62
_LOCK = threading.Lock()
_local = threading.local()


def microbatch_seeds(chunks: int) -> list[int]:
    """The seeds of one call's `chunks` micro-batches; advances the caller's CPU generator once.
    Under the lock `seeded` draws under: a stream draws each item's seed while stages draw,
    each with its own state installed in the same generator for the while."""
    with _LOCK:
        base = int(torch.randint(0, _SEED_RANGE, (), dtype=torch.int64))
    return [(base + m) % _SEED_RANGE for m in range(chunks)]


@contextlib.contextmanager
def microbatch_seed(seed: int | None) -> Iterator[None]:
    """On this thread, a micro-batch's first draw starts from `torch.manual_seed(seed)`'s state."""
    previous, _local.seed = getattr(_local, "seed", None), seed
    try:
        yield
    finally:
        _local.seed = previous


def current_seed() -> int | None:
    """This thread's micro-batch seed (None outside a pipeline run)."""
    return getattr(_local, "seed", None)


@dataclass(frozen=True)
class RngState:
    """A micro-batch's generator states after its latest draw: CPU, and each device used that
    has generators of its own (a GPU; `fxpipe.passes.device.generators_of`)."""

    seed: int
    cpu: torch.Tensor
    devices: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def from_seed(seed: int) -> "RngState":
        return RngState(seed, torch.Generator().manual_seed(seed).get_state())

    def state_on(self, device: torch.device) -> torch.Tensor:
        if device in self.devices:
            return self.devices[device]
        return seeded_state(device, self.seed)

    def __repr__(self) -> str:
        return f"RngState(seed={self.seed})"


def seeded(state: RngState | None, op: Callable, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """`op(*args, **kwargs)` drawing from `state` (None: the micro-batch's seed); returns the
    result and the state after it. Outside a pipeline run, `op` draws as usual."""
    if state is None:
        seed = current_seed()
        if seed is None:
            return op(*args, **kwargs), None
        state = RngState.from_seed(seed)
    if _draws(op, args, kwargs):
        return _draw(state, op, args, kwargs)
    if _op_name(op) in _random_names() or (isinstance(op, nn.Module) and
                                           not _module_may_draw(op, in_any_mode=False)):
        return op(*args, **kwargs), state      # e.g. dropout in eval mode: nothing to route
    with _RoutedDraws(state) as routed:      # a module or function that may draw inside
        out = op(*args, **kwargs)
    return out, routed.state


@functools.cache
def _seeded_op(op: Callable) -> Callable:
    """`seeded` with `op` fixed and named after it: stage code reads `seeded_dropout(rng, x)`."""
    def draw(state: RngState | None, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return seeded(state, op, *args, **kwargs)
    draw.__name__ = draw.__qualname__ = "seeded_" + getattr(op, "__name__", "op").replace(".", "_")
    return draw


def _draw(state: RngState, op: Callable, args: tuple, kwargs: dict) -> tuple[Any, RngState]:
    """Run one random op with `state` installed in torch's default generators."""
    devices = {t.device for t in tensors((args, kwargs))} or {torch.get_default_device()}
    if kwargs.get("device") is not None:                    # a factory: `randn(3, device=...)`
        devices.add(torch.device(kwargs["device"]))
    devices = generators_of(devices)
    with _LOCK:
        caller_cpu = torch.get_rng_state()
        caller_devices = {d: rng_state(d) for d in devices}
        try:
            torch.set_rng_state(state.cpu)
            for d in devices:
                set_rng_state(d, state.state_on(d))
            out = op(*args, **kwargs)
            after = RngState(state.seed, torch.get_rng_state(),
                             {**state.devices, **{d: rng_state(d) for d in devices}})
        finally:
            torch.set_rng_state(caller_cpu)
            for d, s in caller_devices.items():
                set_rng_state(d, s)
    return out, after


class _RoutedDraws(TorchFunctionMode):
    """While active on this thread, every random torch call draws from (and advances) `state`."""

    def __init__(self, state: RngState):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _draws(func, args, kwargs):
            return func(*args, **kwargs)
        out, self.state = _draw(self.state, func, args, kwargs)
        return out


# --- which ops draw ------------------------------------------------------------------------------

# Python-level functions that draw without an ATen op of the same name.
_PYTHON_DRAWS = {"dropout1d", "dropout2d", "dropout3d", "gumbel_softmax"}


@functools.cache
def _random_names() -> frozenset[str]:
    """Names of the ATen ops torch tags as drawing random numbers (`dropout`, `randn_like`, ...)."""
    names = set(_PYTHON_DRAWS)
    for full in torch._C._dispatch_get_all_op_names():
        if full.startswith("aten::"):
            name, _, overload = full[len("aten::"):].partition(".")
            op = getattr(getattr(torch.ops.aten, name), overload or "default", None)
            if op is not None and torch.Tag.nondeterministic_seeded in op.tags:
                names.add(name)
    return frozenset(names)


def _op_name(op: Any) -> str:
    """`dropout` for `F.dropout`, `torch.ops.aten.dropout.default` and `Tensor.dropout` alike."""
    if isinstance(op, torch._ops.OpOverload):
        return op.__name__.split(".")[0]
    return getattr(op, "__name__", "")


def _draws(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether calling `op` this way draws random numbers (dropout in eval mode does not)."""
    name = _op_name(op)
    if name not in _random_names():
        return False
    if name in _DROPOUTS:            # (input, p, training), training True by default in F.*
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
        return bool(training) and p > 0
    if name in ("rrelu", "rrelu_"):  # (input, lower, upper, training=False)
        return bool(kwargs.get("training", args[3] if len(args) > 3 else False))
    if name == "scaled_dot_product_attention":
        return bool(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0))
    if name in ("lstm", "gru", "rnn_tanh", "rnn_relu"):   # (..., dropout: float, train: bool, ...)
        at = next((i for i, a in enumerate(args) if isinstance(a, float)), None)
        return at is not None and args[at] > 0 and at + 1 < len(args) and bool(args[at + 1])
    return True


_DROPOUTS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
             "feature_dropout", "feature_alpha_dropout", "native_dropout"}


def _module_may_draw(module: nn.Module, *, in_any_mode: bool = True) -> bool:
    """Whether a submodule called whole may draw: it holds dropout-like layers (in training mode,
    unless `in_any_mode`), or runs code outside torch.nn that fxpipe cannot see (a leaf module of
    the user's)."""
    for m in module.modules():
        if not type(m).__module__.startswith("torch.nn."):
            return True
        if not (m.training or in_any_mode):
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 or isinstance(m, nn.RReLU):
            return True
        if isinstance(m, (nn.RNNBase, nn.MultiheadAttention)) and m.dropout > 0:
            return True
    return False


def _node_draws(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node` may draw random numbers, in either mode."""
    if node.op == "call_module":
        return _module_may_draw(gm.get_submodule(node.target))
    if node.op not in ("call_function", "call_method"):
        return False
    target = getattr(torch.Tensor, node.target, None) if node.op == "call_method" else node.target
    if isinstance(target, torch._ops.HigherOrderOperator):     # export's `wrap_with_...(body)`
        bodies = [attr_value(gm, a.target) for a in node.all_input_nodes if a.op == "get_attr"]
        return any(_node_draws(body, n) for body in bodies if isinstance(body, fx.GraphModule)
                   for n in body.graph.nodes)
    if getattr(target, "__name__", "") == "on_copy":            # functionalize's `x.uniform_()`
        return len(node.args) > 1 and node.args[1] in _random_names()
    if _op_name(target) not in _random_names():
        return False
    try:
        return _draws(target, node.args, node.kwargs)
    except TypeError:             # a graph value decides (`p`, `training`): it may draw
        return True


# --- the pass ------------------------------------------------------------------------------------

_KEPT_META = ("nn_module_stack", "stack_trace",   # what the nodes a draw adds copy from it
              "grad_enabled")                      # (a no_grad region: see fxpipe.passes.capture)
_VALUE_META = ("val", "tensor_meta", "example_value")


def seed_random_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """Route every node of `gm` that may draw random numbers through `seeded`, chained in graph
    order by the generator state they pass on; modifies and returns `gm`. See the module docstring.

    A routed node keeps its name (and stack trace) and now returns `(value, state)`; its readers
    read `value` from the `<name>_out` node after it, the next draw reads `state`.
    """
    graph = gm.graph
    state: fx.Node | None = None
    for node in list(graph.nodes):
        if not _node_draws(gm, node):
            continue
        if node.op == "call_module":
            with graph.inserting_before(node):
                op = graph.create_node("get_attr", node.target, name=f"{node.name}_module")
            module_type = type(gm.get_submodule(node.target))   # it still names its module
            node.meta.setdefault("nn_module_stack", {node.target: (node.target, module_type)})
        else:
            op = getattr(torch.Tensor, node.target) if node.op == "call_method" else node.target
        with graph.inserting_after(node):
            value = graph.create_node("call_function", operator.getitem, (node, 0),
                                      name=f"{node.name}_out")
        with graph.inserting_after(value):
            next_state = graph.create_node("call_function", operator.getitem, (node, 1), name="rng")
        for new in (value, next_state):
            new.meta = {k: v for k, v in node.meta.items() if k in _KEPT_META}
        for key in _VALUE_META:                          # the value is `<name>_out`'s now
            if key in node.meta:
                value.meta[key] = node.meta.pop(key)
        node.replace_all_uses_with(value, delete_user_cb=lambda u: u not in (value, next_state))
        if isinstance(op, fx.Node):
            node.op, node.target, node.args = "call_function", seeded, (state, op, *node.args)
        else:
            node.op, node.target, node.args = "call_function", _seeded_op(op), (state, *node.args)
        state = next_state
    if state is not None:
        graph.lint()
        gm.recompile()
    return gm
