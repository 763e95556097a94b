"""Hypothesis strategy generating random, valid, ``torch.fx``-traceable models.

The entry point is :func:`models`, a Hypothesis strategy of :class:`ModelCase`
values.  A case unpacks as ``model, example_inputs = case``::

    from hypothesis import given, settings
    import torch
    from fxpipe.testing import models

    @settings(max_examples=25, deadline=None)
    @given(models(max_nodes=10))
    def test_traced_model_matches_eager(case):
        model, example_inputs = case
        traced = torch.fx.symbolic_trace(model)
        torch.testing.assert_close(traced(*example_inputs), model(*example_inputs))

Every generated model is a random DAG of operations over tensors of shape
``(batch, features)`` (convolutions reshape to ``(batch, c, h, w)`` and flatten
back).  Shapes are consistent by construction, no operation mixes samples
across the batch dimension (so running on micro-batches and concatenating the
results equals running on the whole batch), every value is used (each one is
either consumed by a later operation or returned), and values are kept
numerically tame.

When a test fails, Hypothesis shrinks the model to few operations and prints
``repr(case)``, which is Python source that can be pasted to rebuild the exact
same model (same weights, via the printed seed) and example inputs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

__all__ = ["GeneratedModel", "GraphSpec", "ModelCase", "OpSpec", "models"]

#: Upper bound on the feature size of generated values (concatenation is
#: only drawn while it keeps the result at most this wide, except when it is
#: the only way to consume a model input or merge outputs).
MAX_FEATURES = 32
#: Feature sizes drawn for model inputs and layer outputs.
_MAX_DRAWN_FEATURES = 8
#: Rough bound on the RMS of any value; ops that would exceed it are not drawn.
_SCALE_LIMIT = 8.0
#: Python scalars used by ``x + c`` / ``x * c``.
_CONSTANTS = (0.5, 2.0, 1.0, 0.1)

_OUTPUT_KINDS = ("tensor", "tuple", "dict")

# Op kinds, simplest first: ``sampled_from`` shrinks towards the front.
_UNARY = ("relu", "linear", "tanh", "sigmoid", "gelu", "softmax", "layer_norm",
          "matmul", "add_const", "mul_const", "add_buffer", "mul_buffer", "mean",
          "reshape_mean", "split", "chunk", "conv", "dropout", "train_branch",
          "frozen_linear", "running_mean")
_BINARY = ("add", "mul", "sub", "cat")
_KIND_ORDER = ("relu", "linear", "add", "mul", "cat") + tuple(
    k for k in _UNARY + _BINARY if k not in ("relu", "linear", "add", "mul", "cat"))
_NEEDS_CONSTANTS = frozenset({"add_const", "mul_const", "reshape_mean", "conv"})
_NEEDS_BUFFERS = frozenset({"add_buffer", "mul_buffer"})
_ATTR_PREFIX = {"linear": "linear", "layer_norm": "norm", "conv": "conv",
                "matmul": "w", "add_buffer": "buf", "mul_buffer": "buf",
                "frozen_linear": "frozen", "running_mean": "stat"}
# The idioms behind the options of `models`, each the kinds it allows.
_IDIOMS = {"dropout": {"dropout"}, "training_branches": {"train_branch"},
           "grad_regions": {"frozen_linear"}, "buffer_updates": {"running_mean"}}
_MOMENTUM = 0.1


# --------------------------------------------------------------------------- #
# Specs
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One operation of a generated model.

    ``args`` and ``outs`` are value indices: values ``0 .. n_inputs-1`` are the
    model inputs, then each op appends its ``outs`` in order.  ``params`` holds
    the kind-specific static configuration (feature sizes, constants, split
    sizes, ...) and ``attr`` names the submodule / parameter / buffer the op
    owns, if any.
    """

    kind: str
    args: tuple[int, ...]
    outs: tuple[int, ...]
    params: tuple[Any, ...] = ()
    attr: str | None = None


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    """Full description of a generated model (structure plus init seed)."""

    input_features: tuple[int, ...]
    ops: tuple[OpSpec, ...]
    #: Feature size of every value (inputs first, then op outputs).
    value_features: tuple[int, ...]
    outputs: tuple[int, ...]
    output_kind: Literal["tensor", "tuple", "dict"]
    #: ``torch.manual_seed`` used before constructing the model's layers.
    seed: int = 0

    @property
    def n_inputs(self) -> int:
        return len(self.input_features)

    def value_name(self, index: int) -> str:
        n = self.n_inputs
        return f"x{index}" if index < n else f"v{index - n}"

    def output_names(self) -> tuple[str, ...]:
        return tuple(f"out{j}" for j in range(len(self.outputs)))


# --------------------------------------------------------------------------- #
# The model
# --------------------------------------------------------------------------- #
def _build_attr(module: nn.Module, op: OpSpec) -> None:
    """Create the layer / parameter / buffer owned by ``op`` (global RNG)."""
    k, p = op.kind, op.params
    if k in ("linear", "frozen_linear"):
        module.add_module(op.attr, nn.Linear(p[0], p[1]))
    elif k == "running_mean":
        module.register_buffer(op.attr, torch.zeros(p[0]))
    elif k == "layer_norm":
        module.add_module(op.attr, nn.LayerNorm(p[0]))
    elif k == "conv":
        c, _h, _w, c_out, ks = p
        module.add_module(op.attr, nn.Conv2d(c, c_out, kernel_size=ks, padding=ks // 2))
    elif k == "matmul":
        f_in, f_out, scale, _use_operator = p
        module.register_parameter(op.attr, nn.Parameter(torch.randn(f_in, f_out) * scale))
    elif k in _NEEDS_BUFFERS:
        module.register_buffer(op.attr, torch.rand(p[0]))


def _apply(module: nn.Module, op: OpSpec, args: list[Any]) -> Any:
    """Run ``op`` on ``args``; must stay in sync with :func:`_render_expr`."""
    k, p = op.kind, op.params
    a = args[0]
    if k in ("linear", "layer_norm"):
        return getattr(module, op.attr)(a)
    if k == "frozen_linear":
        with torch.no_grad():
            return getattr(module, op.attr)(a)
    if k == "dropout":
        return F.dropout(a, p[0], module.training)
    if k == "train_branch":
        return a * p[0] if module.training else a + p[0]
    if k == "running_mean":
        stat = getattr(module, op.attr)
        return a - stat.mul_(1 - _MOMENTUM).add_(_MOMENTUM * a.detach().mean(0))
    if k == "conv":
        c, h, w = p[0], p[1], p[2]
        return getattr(module, op.attr)(a.reshape(-1, c, h, w)).flatten(1)
    if k == "relu":
        return torch.relu(a)
    if k == "tanh":
        return a.tanh()
    if k == "sigmoid":
        return torch.sigmoid(a)
    if k == "gelu":
        return F.gelu(a)
    if k == "softmax":
        return a.softmax(dim=-1)
    if k == "add":
        return a + args[1]
    if k == "mul":
        return a * args[1]
    if k == "sub":
        return a - args[1]
    if k == "matmul":
        if p[3]:
            return a @ getattr(module, op.attr)
        return torch.matmul(a, getattr(module, op.attr))
    if k == "add_const":
        return a + p[0]
    if k == "mul_const":
        return a * p[0]
    if k == "add_buffer":
        return a + getattr(module, op.attr)
    if k == "mul_buffer":
        return a * getattr(module, op.attr)
    if k == "cat":
        return torch.cat(list(args), dim=1)
    if k == "split":
        return torch.split(a, list(p), dim=1)
    if k == "chunk":
        return a.chunk(p[0], dim=1)
    if k == "mean":
        return a.mean(dim=1, keepdim=True)
    if k == "reshape_mean":
        return a.reshape(-1, p[0], p[1]).mean(dim=2)
    raise ValueError(f"unknown op kind {k!r}")


def _render_init(op: OpSpec) -> str | None:
    k, p = op.kind, op.params
    if k in ("linear", "frozen_linear"):
        return f"self.{op.attr} = nn.Linear({p[0]}, {p[1]})"
    if k == "running_mean":
        return f'self.register_buffer("{op.attr}", torch.zeros({p[0]}))'
    if k == "layer_norm":
        return f"self.{op.attr} = nn.LayerNorm({p[0]})"
    if k == "conv":
        c, _h, _w, c_out, ks = p
        return f"self.{op.attr} = nn.Conv2d({c}, {c_out}, kernel_size={ks}, padding={ks // 2})"
    if k == "matmul":
        return f"self.{op.attr} = nn.Parameter(torch.randn({p[0]}, {p[1]}) * {p[2]!r})"
    if k in _NEEDS_BUFFERS:
        return f'self.register_buffer("{op.attr}", torch.rand({p[0]}))'
    return None


def _render_expr(op: OpSpec, names: list[str]) -> str:
    """Python expression for ``op``; must stay in sync with :func:`_apply`."""
    k, p = op.kind, op.params
    a = names[0]
    if k in ("linear", "layer_norm", "frozen_linear"):
        return f"self.{op.attr}({a})"
    if k == "dropout":
        return f"F.dropout({a}, {p[0]!r}, self.training)"
    if k == "train_branch":
        return f"{a} * {p[0]!r} if self.training else {a} + {p[0]!r}"
    if k == "running_mean":
        return (f"{a} - self.{op.attr}.mul_({1 - _MOMENTUM!r})"
                f".add_({_MOMENTUM!r} * {a}.detach().mean(0))")
    if k == "conv":
        return f"self.{op.attr}({a}.reshape(-1, {p[0]}, {p[1]}, {p[2]})).flatten(1)"
    simple = {
        "relu": f"torch.relu({a})",
        "tanh": f"{a}.tanh()",
        "sigmoid": f"torch.sigmoid({a})",
        "gelu": f"F.gelu({a})",
        "softmax": f"{a}.softmax(dim=-1)",
        "mean": f"{a}.mean(dim=1, keepdim=True)",
        "add_buffer": f"{a} + self.{op.attr}",
        "mul_buffer": f"{a} * self.{op.attr}",
        "cat": f"torch.cat([{', '.join(names)}], dim=1)",
    }
    if k in simple:
        return simple[k]
    if k in ("add", "mul", "sub"):
        sym = {"add": "+", "mul": "*", "sub": "-"}[k]
        return f"{a} {sym} {names[1]}"
    if k == "matmul":
        return f"{a} @ self.{op.attr}" if p[3] else f"torch.matmul({a}, self.{op.attr})"
    if k == "add_const":
        return f"{a} + {p[0]!r}"
    if k == "mul_const":
        return f"{a} * {p[0]!r}"
    if k == "split":
        return f"torch.split({a}, {list(p)!r}, dim=1)"
    if k == "chunk":
        return f"{a}.chunk({p[0]}, dim=1)"
    if k == "reshape_mean":
        return f"{a}.reshape(-1, {p[0]}, {p[1]}).mean(dim=2)"
    raise ValueError(f"unknown op kind {k!r}")


class GeneratedModel(nn.Module):
    """An ``nn.Module`` whose forward interprets a :class:`GraphSpec`.

    ``GeneratedModel(spec)`` returns an instance of a subclass
    ``GeneratedModel<n>`` whose ``forward(self, x0, ..., x<n-1>)`` has one
    named argument per model input (so ``torch.fx`` creates one placeholder
    per input); its body loops over ``spec.ops`` in Python, which
    ``torch.fx.symbolic_trace`` unrolls.  Submodules, parameters and buffers
    are plain attributes (``linear0``, ``w3``, ``buf5``, ...) so the
    ``state_dict`` keys match the code printed by :meth:`source`.
    """

    spec: GraphSpec

    def __new__(cls, *args: Any, **kwargs: Any) -> GeneratedModel:
        if cls is GeneratedModel:
            spec = args[0] if args else kwargs["spec"]
            cls = _arity_class(len(spec.input_features))
        return super().__new__(cls)

    def __init__(self, spec: GraphSpec) -> None:
        super().__init__()
        self.spec = spec
        for op in spec.ops:
            if op.attr is not None:
                _build_attr(self, op)

    def forward(self, *inputs: torch.Tensor) -> Any:  # overridden per arity
        return self._run(list(inputs))

    def _run(self, inputs: list[Any]) -> Any:
        spec = self.spec
        if len(inputs) != spec.n_inputs:
            raise TypeError(f"expected {spec.n_inputs} inputs, got {len(inputs)}")
        values = list(inputs)
        for op in spec.ops:
            result = _apply(self, op, [values[i] for i in op.args])
            if len(op.outs) == 1:
                values.append(result)
            else:
                # Index explicitly: fx proxies cannot be iterated.
                values.extend(result[j] for j in range(len(op.outs)))
        outs = [values[i] for i in spec.outputs]
        if spec.output_kind == "tensor":
            return outs[0]
        if spec.output_kind == "tuple":
            return tuple(outs)
        return dict(zip(spec.output_names(), outs))

    def source(self, class_name: str = "Model") -> str:
        """Python source of an equivalent ``nn.Module`` class (same state_dict keys)."""
        spec = self.spec
        feats = spec.value_features
        init_lines = [line for op in spec.ops if (line := _render_init(op)) is not None]
        fwd_lines = []
        for op in spec.ops:
            expr = _render_expr(op, [spec.value_name(i) for i in op.args])
            target = ", ".join(spec.value_name(i) for i in op.outs)
            shapes = ", ".join(f"(B, {feats[i]})" for i in op.outs)
            region = "with torch.no_grad(): " if op.kind == "frozen_linear" else ""
            fwd_lines.append(f"{region}{target} = {expr}  # {shapes}")
        outs = [spec.value_name(i) for i in spec.outputs]
        if spec.output_kind == "tensor":
            ret = outs[0]
        elif spec.output_kind == "tuple":
            ret = "(" + ", ".join(outs) + ("," if len(outs) == 1 else "") + ")"
        else:
            ret = "{" + ", ".join(f'"{k}": {v}' for k, v in zip(spec.output_names(), outs)) + "}"
        fwd_lines.append(f"return {ret}")
        args = ", ".join(["self"] + [spec.value_name(i) for i in range(spec.n_inputs)])
        in_shapes = ", ".join(f"{spec.value_name(i)}: (B, {f})"
                              for i, f in enumerate(spec.input_features))
        lines = [
            f"class {class_name}(nn.Module):",
            "    def __init__(self):",
            "        super().__init__()",
            *("        " + line for line in init_lines),
            "",
            f"    def forward({args}):  # {in_shapes}",
            *("        " + line for line in fwd_lines),
        ]
        return "\n".join(lines) + "\n"


_ARITY_CLASSES: dict[int, type[GeneratedModel]] = {}


def _arity_class(n: int) -> type[GeneratedModel]:
    """``GeneratedModel<n>``: a subclass whose forward takes ``n`` named inputs."""
    cls = _ARITY_CLASSES.get(n)
    if cls is None:
        if n < 1:
            raise ValueError("a generated model needs at least one input")
        name = f"GeneratedModel{n}"
        params = ", ".join(f"x{i}" for i in range(n))
        namespace: dict[str, Any] = {"__name__": __name__}
        exec(f"def forward(self, {params}):\n    return self._run([{params}])\n", namespace)
        forward = namespace["forward"]
        forward.__qualname__ = f"{name}.forward"
        cls = type(name, (GeneratedModel,), {
            "forward": forward, "__module__": __name__, "__qualname__": name,
            "__doc__": f"A :class:`GeneratedModel` with {n} input(s).",
        })
        _ARITY_CLASSES[n] = cls
        globals()[name] = cls
    return cls


def __getattr__(name: str) -> Any:
    # Lets pickle find GeneratedModel<n> classes in a fresh process.
    suffix = name[len("GeneratedModel"):]
    if name.startswith("GeneratedModel") and suffix.isdigit():
        return _arity_class(int(suffix))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- #
# The case
# --------------------------------------------------------------------------- #
class ModelCase(NamedTuple):
    """A generated model and example inputs; unpacks as ``model, example_inputs``.

    ``repr(case)`` is :meth:`source`: pasteable Python that rebuilds the model
    (with the same weights) and example inputs.
    """

    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...]

    @property
    def spec(self) -> GraphSpec:
        return self.model.spec

    def source(self) -> str:
        spec = self.spec
        batch = self.example_inputs[0].shape[0] if self.example_inputs else 1
        shapes = [f"torch.randn({batch}, {f})" for f in spec.input_features]
        inputs = "(" + ", ".join(shapes) + ("," if len(shapes) == 1 else "") + ")"
        return "\n".join([
            "import torch",
            "import torch.nn as nn",
            "import torch.nn.functional as F",
            "",
            "",
            self.model.source("Model"),
            "",
            f"torch.manual_seed({spec.seed})",
            "model = Model().eval()",
            f"example_inputs = {inputs}",
        ]) + "\n"

    def __repr__(self) -> str:
        return self.source()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # Hypothesis / IPython
        # Hypothesis prints "case=<this>," indented: bracket the source with
        # comment lines so the "case=" prefix and the trailing comma land in
        # comments and the lines in between paste as-is (after dedenting).
        p.text("# ModelCase source:")
        for line in self.source().rstrip("\n").splitlines():
            p.break_()
            p.text(line)
        p.break_()
        p.text("# end of ModelCase source")


def build_case(spec: GraphSpec, batch: int) -> ModelCase:
    """Instantiate ``spec`` exactly as the printed source does (same RNG stream)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = GeneratedModel(spec).eval()
        example_inputs = tuple(torch.randn(batch, f) for f in spec.input_features)
    return ModelCase(model, example_inputs)


# --------------------------------------------------------------------------- #
# Generation
# --------------------------------------------------------------------------- #
def _pick(draw: Any, candidates: list[int]) -> int:
    """Draw one of ``candidates`` (value indices), shrinking towards the last."""
    if len(candidates) == 1:
        return candidates[0]
    return candidates[len(candidates) - 1 - draw(st.integers(0, len(candidates) - 1))]


class _Builder:
    def __init__(self, input_features: list[int]) -> None:
        self.n_inputs = len(input_features)
        self.feats = list(input_features)
        self.scales = [1.0] * len(input_features)
        self.consumed: set[int] = set()
        self.ops: list[OpSpec] = []

    def sinks(self) -> list[int]:
        return [v for v in range(len(self.feats)) if v not in self.consumed]

    def pending_inputs(self) -> list[int]:
        return [v for v in range(self.n_inputs) if v not in self.consumed]

    def add(self, kind: str, args: tuple[int, ...], out_feats: list[int],
            out_scale: float, params: tuple[Any, ...] = ()) -> None:
        index = len(self.ops)
        attr = f"{_ATTR_PREFIX[kind]}{index}" if kind in _ATTR_PREFIX else None
        start = len(self.feats)
        outs = tuple(range(start, start + len(out_feats)))
        self.feats.extend(out_feats)
        self.scales.extend([out_scale] * len(out_feats))
        self.consumed.update(args)
        self.ops.append(OpSpec(kind, tuple(args), outs, tuple(params), attr))


def _divisors(f: int, lo: int, hi: int) -> list[int]:
    return [d for d in range(lo, min(hi, f) + 1) if f % d == 0]


def _conv_shapes(f: int) -> list[tuple[int, int]]:
    return [(h, w) for h in (1, 2, 3) for w in (1, 2, 3) if h * w > 1 and f % (h * w) == 0]


def _binary_scale(kind: str, sa: float, sb: float) -> float:
    if kind == "mul":
        return sa * sb
    if kind == "cat":
        return max(sa, sb)
    return sa + sb


def _unary_ok(kind: str, f: int, s: float, flags: dict[str, bool]) -> bool:
    if kind in _NEEDS_CONSTANTS and not flags["constants"]:
        return False
    if kind in _NEEDS_BUFFERS and not flags["buffers"]:
        return False
    if any(kind in kinds and not flags[idiom] for idiom, kinds in _IDIOMS.items()):
        return False
    if kind in ("split", "chunk") and flags["single_output"]:
        return False
    if kind in ("softmax", "layer_norm"):
        return f >= 2  # constant output on a single feature
    if kind == "add_const":
        return s + min(_CONSTANTS) <= _SCALE_LIMIT
    if kind == "add_buffer":
        return s + 1.0 <= _SCALE_LIMIT
    if kind == "dropout":
        return 2 * s <= _SCALE_LIMIT
    if kind == "train_branch":
        return s + max(_CONSTANTS) <= _SCALE_LIMIT and s * max(_CONSTANTS) <= _SCALE_LIMIT
    if kind == "running_mean":
        return 2 * s <= _SCALE_LIMIT
    if kind == "split":
        return f >= 2
    if kind == "chunk":
        return bool(_divisors(f, 2, 4))
    if kind == "reshape_mean":
        return bool(_divisors(f, 2, f - 1))
    if kind == "conv":
        return bool(_conv_shapes(f))
    return True


def _draw_op(draw: Any, b: _Builder, a: int, second: list[int], forced: bool,
             flags: dict[str, bool]) -> None:
    """Draw and append one op whose first operand is ``a``.

    ``second`` are the allowed second operands of binary ops; if ``forced``
    the op must be binary (it consumes ``second[0]``, a pending input).
    """
    f, s = b.feats[a], b.scales[a]

    def partners(kind: str) -> list[int]:
        out = []
        for c in second:
            fc, sc = b.feats[c], b.scales[c]
            if kind == "cat":
                ok = forced or f + fc <= MAX_FEATURES
            elif kind == "sub" and c == a:
                ok = False  # x - x is identically zero
            else:
                ok = fc == f and _binary_scale(kind, s, sc) <= _SCALE_LIMIT
            if ok:
                out.append(c)
        return out

    candidates = []
    for kind in _KIND_ORDER:
        if kind in _BINARY:
            if partners(kind):
                candidates.append(kind)
        elif not forced and _unary_ok(kind, f, s, flags):
            candidates.append(kind)
    kind = draw(st.sampled_from(candidates))

    if kind in _BINARY:
        c = _pick(draw, partners(kind))
        out_f = f + b.feats[c] if kind == "cat" else f
        b.add(kind, (a, c), [out_f], _binary_scale(kind, s, b.scales[c]))
    elif kind in ("linear", "frozen_linear"):
        g = draw(st.integers(1, _MAX_DRAWN_FEATURES))
        b.add(kind, (a,), [g], math.sqrt(s * s / 3 + 1 / (3 * f)), (f, g))
    elif kind == "dropout":
        p = draw(st.sampled_from((0.1, 0.5)))
        b.add(kind, (a,), [f], s / (1 - p), (p,))
    elif kind == "train_branch":
        c = draw(st.sampled_from(_CONSTANTS))
        b.add(kind, (a,), [f], max(s * c, s + c), (c,))
    elif kind == "running_mean":
        b.add(kind, (a,), [f], 2 * s, (f,))
    elif kind == "matmul":
        g = draw(st.integers(1, _MAX_DRAWN_FEATURES))
        use_operator = draw(st.booleans())
        b.add(kind, (a,), [g], s, (f, g, round(f ** -0.5, 3), use_operator))
    elif kind == "conv":
        h, w = draw(st.sampled_from(_conv_shapes(f)))
        c_out = draw(st.integers(1, min(4, MAX_FEATURES // (h * w))))
        ks = draw(st.sampled_from((1, 3)))
        b.add(kind, (a,), [c_out * h * w], max(s, 1.0), (f // (h * w), h, w, c_out, ks))
    elif kind in ("add_const", "mul_const"):
        consts = [c for c in _CONSTANTS
                  if (s + c if kind == "add_const" else s * c) <= _SCALE_LIMIT]
        c = draw(st.sampled_from(consts))
        b.add(kind, (a,), [f], s + c if kind == "add_const" else s * c, (c,))
    elif kind == "split":
        first = draw(st.integers(1, f - 1))
        b.add(kind, (a,), [first, f - first], s, (first, f - first))
    elif kind == "chunk":
        k = draw(st.sampled_from(_divisors(f, 2, 4)))
        b.add(kind, (a,), [f // k] * k, s, (k,))
    elif kind == "reshape_mean":
        g = draw(st.sampled_from(_divisors(f, 2, f - 1)))
        b.add(kind, (a,), [g], s, (g, f // g))
    elif kind == "mean":
        b.add(kind, (a,), [1], s)
    elif kind in ("layer_norm", "add_buffer", "mul_buffer"):
        out_s = {"layer_norm": 1.0, "add_buffer": s + 1.0, "mul_buffer": s}[kind]
        b.add(kind, (a,), [f], out_s, (f,))
    else:  # elementwise activations
        out_s = {"tanh": min(s, 1.0), "sigmoid": 1.0, "softmax": 1.0}.get(kind, s)
        b.add(kind, (a,), [f], out_s)


@st.composite
def _model_cases(draw: Any, max_nodes: int, branching: bool, inputs: tuple[int, int],
                 outputs: str, buffers: bool, constants: bool,
                 batch: tuple[int, int], idioms: dict[str, bool]) -> ModelCase:
    n_in = draw(st.integers(inputs[0], min(inputs[1], max_nodes)))
    n_ops = n_in + draw(st.integers(0, max_nodes - n_in))
    out_kind = outputs if outputs != "any" else draw(st.sampled_from(_OUTPUT_KINDS))
    in_feats = [draw(st.integers(1, _MAX_DRAWN_FEATURES)) for _ in range(n_in)]

    b = _Builder(in_feats)
    for i in range(n_ops):
        last = i == n_ops - 1
        single_output = last and out_kind == "tensor"
        flags = {"buffers": buffers, "constants": constants, "single_output": single_output,
                 **idioms}
        sinks = b.sinks()
        if single_output and len(sinks) >= 2:
            # Merge everything still unused into the single output tensor.
            b.add("cat", tuple(sinks), [sum(b.feats[v] for v in sinks)],
                  max(b.scales[v] for v in sinks))
            continue
        pending = b.pending_inputs()
        prev_outs = list(b.ops[-1].outs) if b.ops else []
        if single_output:
            a = sinks[0]  # the only unused value must feed the output
        elif not branching and prev_outs:
            a = _pick(draw, prev_outs)
        elif pending:
            a = pending[0]
        elif draw(st.integers(0, 3)) == 3:
            a = _pick(draw, list(range(len(b.feats))))  # fan out from any value
        else:
            a = _pick(draw, sinks)  # extend the frontier (shrinks towards a chain)
        if not branching and prev_outs and pending and a not in pending:
            # Chain: consume the next pending input as the second operand.
            _draw_op(draw, b, a, [pending[0]], True, flags)
        elif not branching:
            _draw_op(draw, b, a, prev_outs or [a], False, flags)
        else:
            _draw_op(draw, b, a, list(range(len(b.feats))), False, flags)

    sinks = b.sinks()
    assert not b.pending_inputs(), "every input must feed an op"
    if out_kind == "tensor":
        assert len(sinks) == 1, sinks
        outs = sinks
    else:
        extra: list[int] = []
        reused = [v for v in range(n_in, len(b.feats)) if v in b.consumed]
        if branching and reused:
            extra = draw(st.lists(st.sampled_from(reused), max_size=2, unique=True))
        outs = sorted(set(sinks) | set(extra))

    spec = GraphSpec(
        input_features=tuple(in_feats),
        ops=tuple(b.ops),
        value_features=tuple(b.feats),
        outputs=tuple(outs),
        output_kind=out_kind,  # type: ignore[arg-type]
        seed=draw(st.integers(0, 2**32 - 1)),
    )
    return build_case(spec, draw(st.integers(batch[0], batch[1])))


def models(*, max_nodes: int = 20, branching: bool = True, inputs: tuple[int, int] = (1, 3),
           outputs: Literal["tensor", "tuple", "dict", "any"] = "any", buffers: bool = True,
           constants: bool = True, batch: tuple[int, int] = (1, 8), dropout: bool = False,
           training_branches: bool = False, grad_regions: bool = False,
           buffer_updates: bool = False) -> SearchStrategy[ModelCase]:
    """Strategy for random, valid, fx-traceable models with example inputs.

    Each example is a :class:`ModelCase` ``(model, example_inputs)``: ``model``
    is an ``nn.Module`` in eval mode (a :class:`GeneratedModel`),
    ``example_inputs`` a tuple of float32 tensors of shape ``(batch, features)``
    sharing the same batch size.  The model is a DAG of between ``inputs[0]``
    and ``max_nodes`` operations drawn from: ``nn.Linear``, ``nn.LayerNorm``,
    ``nn.Conv2d`` (on a reshaped value), relu / tanh / sigmoid / gelu /
    softmax, ``+ - *`` between values, ``torch.matmul(x, W)`` / ``x @ W`` with
    a parameter, ``x + c`` / ``x * c`` with Python scalars, ``+`` / ``*`` with a
    registered buffer, ``torch.cat``, ``torch.split`` / ``chunk``, per-sample
    means.  No op mixes samples across the batch dimension, unless ``buffer_updates``.

    Four options add the idioms whose pipelines must equal the model *run once
    per micro-batch* (see ``assert_pipeline_matches``), off by default:
    ``dropout`` (``F.dropout(x, p, self.training)``), ``training_branches``
    (``x * c if self.training else x + c``), ``grad_regions`` (an
    ``nn.Linear`` called under ``torch.no_grad()``: a frozen branch) and
    ``buffer_updates`` (a running mean of the batch, updated in place in
    forward and read after the update: it mixes the samples of a micro-batch).
    Call ``model.train()`` for dropout and the training branches to act.

    Args:
        max_nodes: maximum number of ops (at least ``inputs[0]``).
        branching: if False the model is a chain: every op takes (one of) the
            previous op's outputs as an operand; extra model inputs are merged
            in one by one by binary ops.
        inputs: inclusive bounds on the number of model inputs.
        outputs: ``"tensor"`` (one tensor), ``"tuple"`` / ``"dict"`` (of all
            unused values plus, when branching, maybe some reused ones; dict
            keys are ``"out0"``, ``"out1"``, ...) or ``"any"`` of these.
        buffers: allow ops using registered buffers.
        constants: allow Python scalar constants (``x * 0.5``, ``x + 1.0``) and
            reshapes with Python ints (which conv ops need).
        batch: inclusive bounds on the batch size of the example inputs.
        dropout, training_branches, grad_regions, buffer_updates: allow the
            idioms above.

    Example::

        from hypothesis import given, settings
        import torch
        from fxpipe.testing import models

        @settings(max_examples=25, deadline=None)
        @given(models(max_nodes=10))
        def test_traced_model_matches_eager(case):
            model, example_inputs = case
            traced = torch.fx.symbolic_trace(model)
            torch.testing.assert_close(traced(*example_inputs),
                                       model(*example_inputs))

    On failure Hypothesis shrinks to few ops and prints the case as pasteable
    Python (``repr(case)``, see :meth:`ModelCase.source`).
    """
    if not isinstance(max_nodes, int) or max_nodes < 1:
        raise InvalidArgument(f"max_nodes={max_nodes!r} must be an int >= 1")
    lo, hi = inputs
    if not 1 <= lo <= hi:
        raise InvalidArgument(f"inputs={inputs!r} must satisfy 1 <= lo <= hi")
    if lo > max_nodes:
        raise InvalidArgument(f"inputs[0]={lo} exceeds max_nodes={max_nodes}: "
                              "every input needs an op consuming it")
    if outputs not in (*_OUTPUT_KINDS, "any"):
        raise InvalidArgument(f"outputs={outputs!r} must be one of "
                              "'tensor', 'tuple', 'dict', 'any'")
    if not 1 <= batch[0] <= batch[1]:
        raise InvalidArgument(f"batch={batch!r} must satisfy 1 <= lo <= hi")
    idioms = {"dropout": bool(dropout), "training_branches": bool(training_branches),
              "grad_regions": bool(grad_regions), "buffer_updates": bool(buffer_updates)}
    return _model_cases(max_nodes, bool(branching), (lo, hi), outputs, bool(buffers),
                        bool(constants), (batch[0], batch[1]), idioms)
