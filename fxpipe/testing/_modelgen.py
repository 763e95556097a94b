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
import functools
import math
import operator
from typing import Any, Callable, Literal, NamedTuple

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
# Op kinds
# --------------------------------------------------------------------------- #
#: An op kind's code: (operand names, ``OpSpec.params``, ``OpSpec.attr``) -> expression.
Code = Callable[[list[str], tuple[Any, ...], "str | None"], str]
#: What a unary kind draws: its output feature sizes, output scale and ``OpSpec.params``.
Drawn = tuple[list[int], float, tuple[Any, ...]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Kind:
    """An op kind: its forward code, and the attribute it owns, if any.

    The code is the one definition of what the op computes: :meth:`GeneratedModel.source`
    prints it and the model runs it (compiled once per distinct op), so the two cannot differ.
    """

    name: str
    code: Code
    #: Prefix of the owned attribute's name (the op's index follows).
    attr: str | None = None
    #: The attribute's initial value, as an expression of ``OpSpec.params``.
    init: Callable[[tuple[Any, ...]], str] | None = None
    #: The attribute is a registered buffer (else a submodule or parameter).
    buffer: bool = False
    #: The op runs under ``torch.no_grad()`` (a frozen branch).
    no_grad: bool = False

    def expression(self, op: OpSpec, names: list[str]) -> str:
        return self.code(names, op.params, op.attr)

    @property
    def region(self) -> str:
        return "with torch.no_grad(): " if self.no_grad else ""

    def init_line(self, op: OpSpec) -> str | None:
        """The ``__init__`` statement creating ``op``'s attribute, if it owns one."""
        if self.init is None:
            return None
        value = self.init(op.params)
        if self.buffer:
            return f'self.register_buffer("{op.attr}", {value})'
        return f"self.{op.attr} = {value}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Unary(_Kind):
    """A kind taking one value."""

    #: (Hypothesis' draw, the operand's feature size, its scale) -> what the op is; by default
    #: elementwise: same width and scale, no params.
    draw: Callable[[Any, int, float], Drawn] = lambda draw, f, s: ([f], s, ())
    #: Whether it may be drawn on an operand of this feature size and scale.
    allowed: Callable[[int, float], bool] = lambda f, s: True
    #: The option of :func:`models` that must be on for it to be drawn.
    option: str | None = None
    #: Several outputs: never the op making a model's single output tensor.
    splits: bool = False

    def drawable(self, b: _Builder, a: int, second: list[int], forced: bool,
                 flags: dict[str, bool]) -> bool:
        return (not forced and (self.option is None or flags[self.option])
                and not (self.splits and flags["single_output"])
                and self.allowed(b.feats[a], b.scales[a]))

    def add_to(self, draw: Any, b: _Builder, a: int, second: list[int], forced: bool) -> None:
        out_feats, out_scale, params = self.draw(draw, b.feats[a], b.scales[a])
        b.add(self.name, (a,), out_feats, out_scale, params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Binary(_Kind):
    """A kind taking two values: elementwise between equal widths, or a concatenation."""

    #: The output's scale from the operands'.
    scale: Callable[[float, float], float]
    #: The widths add up (any two widths join) rather than match.
    concatenates: bool = False
    #: ``x op x`` is identically zero: never drawn on one value twice.
    zero_on_itself: bool = False

    def partners(self, b: _Builder, a: int, second: list[int], forced: bool) -> list[int]:
        """The values of ``second`` that may be ``a``'s second operand."""
        f, s = b.feats[a], b.scales[a]
        if self.concatenates:
            return [c for c in second if forced or f + b.feats[c] <= MAX_FEATURES]
        return [c for c in second if not (self.zero_on_itself and c == a)
                and b.feats[c] == f and self.scale(s, b.scales[c]) <= _SCALE_LIMIT]

    def drawable(self, b: _Builder, a: int, second: list[int], forced: bool,
                 flags: dict[str, bool]) -> bool:
        return bool(self.partners(b, a, second, forced))

    def add_to(self, draw: Any, b: _Builder, a: int, second: list[int], forced: bool) -> None:
        c = _pick(draw, self.partners(b, a, second, forced))
        f = b.feats[a] + b.feats[c] if self.concatenates else b.feats[a]
        b.add(self.name, (a, c), [f], self.scale(b.scales[a], b.scales[c]))


#: Every op kind by name, in drawing order: simplest first (``sampled_from`` shrinks towards
#: the front). A new kind is one ``_unary`` or ``_binary`` entry below.
_KINDS: dict[str, _Kind] = {}


def _unary(name: str, code: Code, **fields: Any) -> None:
    _KINDS[name] = _Unary(name=name, code=code, **fields)


def _binary(name: str, code: Code, **fields: Any) -> None:
    _KINDS[name] = _Binary(name=name, code=code, **fields)


def _divisors(f: int, lo: int, hi: int) -> list[int]:
    return [d for d in range(lo, min(hi, f) + 1) if f % d == 0]


def _conv_shapes(f: int) -> list[tuple[int, int]]:
    return [(h, w) for h in (1, 2, 3) for w in (1, 2, 3) if h * w > 1 and f % (h * w) == 0]


def _wide(f: int, s: float) -> bool:
    return f >= 2  # on a single feature the output would be constant


def _call(x: list[str], p: tuple[Any, ...], attr: str | None) -> str:
    return f"self.{attr}({x[0]})"


def _linear_init(p: tuple[Any, ...]) -> str:
    return f"nn.Linear({p[0]}, {p[1]})"


def _dense(draw: Any, f: int, s: float) -> Drawn:
    g = draw(st.integers(1, _MAX_DRAWN_FEATURES))
    return [g], math.sqrt(s * s / 3 + 1 / (3 * f)), (f, g)


_unary("relu", lambda x, p, attr: f"torch.relu({x[0]})")
_unary("linear", _call, attr="linear", init=_linear_init, draw=_dense)
_binary("add", lambda x, p, attr: f"{x[0]} + {x[1]}", scale=operator.add)
_binary("mul", lambda x, p, attr: f"{x[0]} * {x[1]}", scale=operator.mul)
_binary("cat", lambda x, p, attr: f"torch.cat([{', '.join(x)}], dim=1)", scale=max,
        concatenates=True)
_unary("tanh", lambda x, p, attr: f"{x[0]}.tanh()",
       draw=lambda draw, f, s: ([f], min(s, 1.0), ()))
_unary("sigmoid", lambda x, p, attr: f"torch.sigmoid({x[0]})",
       draw=lambda draw, f, s: ([f], 1.0, ()))
_unary("gelu", lambda x, p, attr: f"F.gelu({x[0]})")
_unary("softmax", lambda x, p, attr: f"{x[0]}.softmax(dim=-1)", allowed=_wide,
       draw=lambda draw, f, s: ([f], 1.0, ()))
_unary("layer_norm", _call, attr="norm", init=lambda p: f"nn.LayerNorm({p[0]})", allowed=_wide,
       draw=lambda draw, f, s: ([f], 1.0, (f,)))


def _matmul(draw: Any, f: int, s: float) -> Drawn:
    g = draw(st.integers(1, _MAX_DRAWN_FEATURES))
    use_operator = draw(st.booleans())
    return [g], s, (f, g, round(f ** -0.5, 3), use_operator)


_unary("matmul", lambda x, p, attr: f"{x[0]} @ self.{attr}" if p[3]
       else f"torch.matmul({x[0]}, self.{attr})", attr="w",
       init=lambda p: f"nn.Parameter(torch.randn({p[0]}, {p[1]}) * {p[2]!r})", draw=_matmul)


def _constant(combine: Callable[[float, float], float]) -> Callable[[Any, int, float], Drawn]:
    """Draws ``x <combine> c`` for a constant ``c`` that keeps the scale in bounds."""
    def draw_constant(draw: Any, f: int, s: float) -> Drawn:
        c = draw(st.sampled_from([c for c in _CONSTANTS if combine(s, c) <= _SCALE_LIMIT]))
        return [f], combine(s, c), (c,)
    return draw_constant


_unary("add_const", lambda x, p, attr: f"{x[0]} + {p[0]!r}", option="constants",
       allowed=lambda f, s: s + min(_CONSTANTS) <= _SCALE_LIMIT, draw=_constant(operator.add))
_unary("mul_const", lambda x, p, attr: f"{x[0]} * {p[0]!r}", option="constants",
       draw=_constant(operator.mul))
_unary("add_buffer", lambda x, p, attr: f"{x[0]} + self.{attr}", attr="buf",
       init=lambda p: f"torch.rand({p[0]})", buffer=True, option="buffers",
       allowed=lambda f, s: s + 1.0 <= _SCALE_LIMIT, draw=lambda draw, f, s: ([f], s + 1.0, (f,)))
_unary("mul_buffer", lambda x, p, attr: f"{x[0]} * self.{attr}", attr="buf",
       init=lambda p: f"torch.rand({p[0]})", buffer=True, option="buffers",
       draw=lambda draw, f, s: ([f], s, (f,)))
_unary("mean", lambda x, p, attr: f"{x[0]}.mean(dim=1, keepdim=True)",
       draw=lambda draw, f, s: ([1], s, ()))


def _reshape_mean(draw: Any, f: int, s: float) -> Drawn:
    g = draw(st.sampled_from(_divisors(f, 2, f - 1)))
    return [g], s, (g, f // g)


_unary("reshape_mean", lambda x, p, attr: f"{x[0]}.reshape(-1, {p[0]}, {p[1]}).mean(dim=2)",
       option="constants", allowed=lambda f, s: bool(_divisors(f, 2, f - 1)), draw=_reshape_mean)


def _split(draw: Any, f: int, s: float) -> Drawn:
    first = draw(st.integers(1, f - 1))
    return [first, f - first], s, (first, f - first)


_unary("split", lambda x, p, attr: f"torch.split({x[0]}, {list(p)!r}, dim=1)", splits=True,
       allowed=_wide, draw=_split)


def _chunk(draw: Any, f: int, s: float) -> Drawn:
    k = draw(st.sampled_from(_divisors(f, 2, 4)))
    return [f // k] * k, s, (k,)


_unary("chunk", lambda x, p, attr: f"{x[0]}.chunk({p[0]}, dim=1)", splits=True,
       allowed=lambda f, s: bool(_divisors(f, 2, 4)), draw=_chunk)


def _conv(draw: Any, f: int, s: float) -> Drawn:
    h, w = draw(st.sampled_from(_conv_shapes(f)))
    c_out = draw(st.integers(1, min(4, MAX_FEATURES // (h * w))))
    ks = draw(st.sampled_from((1, 3)))
    return [c_out * h * w], max(s, 1.0), (f // (h * w), h, w, c_out, ks)


_unary("conv", lambda x, p, attr:
       f"self.{attr}({x[0]}.reshape(-1, {p[0]}, {p[1]}, {p[2]})).flatten(1)", attr="conv",
       init=lambda p: f"nn.Conv2d({p[0]}, {p[3]}, kernel_size={p[4]}, padding={p[4] // 2})",
       option="constants", allowed=lambda f, s: bool(_conv_shapes(f)), draw=_conv)


def _dropout(draw: Any, f: int, s: float) -> Drawn:
    p = draw(st.sampled_from((0.1, 0.5)))
    return [f], s / (1 - p), (p,)


_unary("dropout", lambda x, p, attr: f"F.dropout({x[0]}, {p[0]!r}, self.training)",
       option="dropout", allowed=lambda f, s: 2 * s <= _SCALE_LIMIT, draw=_dropout)


def _train_branch(draw: Any, f: int, s: float) -> Drawn:
    c = draw(st.sampled_from(_CONSTANTS))
    return [f], max(s * c, s + c), (c,)


_unary("train_branch", lambda x, p, attr:
       f"{x[0]} * {p[0]!r} if self.training else {x[0]} + {p[0]!r}", option="training_branches",
       allowed=lambda f, s: max(s + max(_CONSTANTS), s * max(_CONSTANTS)) <= _SCALE_LIMIT,
       draw=_train_branch)
_unary("frozen_linear", _call, attr="frozen", init=_linear_init, no_grad=True,
       option="grad_regions", draw=_dense)
_unary("running_mean", lambda x, p, attr: f"{x[0]} - self.{attr}.mul_({1 - _MOMENTUM!r})"
       f".add_({_MOMENTUM!r} * {x[0]}.detach().mean(0))", attr="stat",
       init=lambda p: f"torch.zeros({p[0]})", buffer=True, option="buffer_updates",
       allowed=lambda f, s: 2 * s <= _SCALE_LIMIT, draw=lambda draw, f, s: ([f], 2 * s, (f,)))
_binary("sub", lambda x, p, attr: f"{x[0]} - {x[1]}", scale=operator.add, zero_on_itself=True)


# --------------------------------------------------------------------------- #
# The model
# --------------------------------------------------------------------------- #
#: The names the generated code may use.
_CODE_GLOBALS: dict[str, Any] = {"torch": torch, "nn": nn, "F": F}


@functools.lru_cache(maxsize=4096)
def _compiled(op: OpSpec) -> Callable[..., Any]:
    """``op``'s line of forward code as a function of ``self`` and its operands."""
    kind = _KINDS[op.kind]
    names = [f"a{i}" for i in range(len(op.args))]
    namespace: dict[str, Any] = {}
    exec(f"def op(self, {', '.join(names)}):\n"
         f"    {kind.region}return {kind.expression(op, names)}\n", _CODE_GLOBALS, namespace)
    return namespace["op"]


class GeneratedModel(nn.Module):
    """An ``nn.Module`` whose forward runs the ops of a :class:`GraphSpec`.

    ``GeneratedModel(spec)`` returns an instance of a subclass
    ``GeneratedModel<n>`` whose ``forward(self, x0, ..., x<n-1>)`` has one
    named argument per model input (so ``torch.fx`` creates one placeholder
    per input); its body loops over ``spec.ops`` in Python, running each op's
    line of code (the one :meth:`source` prints), a loop
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
            kind = _KINDS[op.kind]
            if kind.init is not None:
                value = eval(kind.init(op.params), _CODE_GLOBALS)
                if kind.buffer:
                    self.register_buffer(op.attr, value)
                else:
                    setattr(self, op.attr, value)

    def forward(self, *inputs: torch.Tensor) -> Any:  # overridden per arity
        return self._run(list(inputs))

    def _run(self, inputs: list[Any]) -> Any:
        spec = self.spec
        if len(inputs) != spec.n_inputs:
            raise TypeError(f"expected {spec.n_inputs} inputs, got {len(inputs)}")
        values = list(inputs)
        for op in spec.ops:
            result = _compiled(op)(self, *(values[i] for i in op.args))
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
        init_lines = [line for op in spec.ops if (line := _KINDS[op.kind].init_line(op))]
        fwd_lines = []
        for op in spec.ops:
            kind = _KINDS[op.kind]
            expr = kind.expression(op, [spec.value_name(i) for i in op.args])
            target = ", ".join(spec.value_name(i) for i in op.outs)
            shapes = ", ".join(f"(B, {feats[i]})" for i in op.outs)
            fwd_lines.append(f"{kind.region}{target} = {expr}  # {shapes}")
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
        prefix = _KINDS[kind].attr
        attr = f"{prefix}{index}" if prefix else None
        start = len(self.feats)
        outs = tuple(range(start, start + len(out_feats)))
        self.feats.extend(out_feats)
        self.scales.extend([out_scale] * len(out_feats))
        self.consumed.update(args)
        self.ops.append(OpSpec(kind, tuple(args), outs, tuple(params), attr))


def _draw_op(draw: Any, b: _Builder, a: int, second: list[int], forced: bool,
             flags: dict[str, bool]) -> None:
    """Draw and append one op whose first operand is ``a``.

    ``second`` are the allowed second operands of binary ops; if ``forced``
    the op must be binary (it consumes ``second[0]``, a pending input).
    """
    candidates = [kind for kind in _KINDS.values() if kind.drawable(b, a, second, forced, flags)]
    draw(st.sampled_from(candidates)).add_to(draw, b, a, second, forced)


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
