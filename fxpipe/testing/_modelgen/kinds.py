"""The op kinds a generated model is drawn from: each kind's code (the one definition of what the
op computes), the attribute it owns, when it may be drawn, and how it joins the model being
drawn (`_Builder`). A new kind is one `_unary` or `_binary` entry here."""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable

from hypothesis import strategies as st

from .specs import _CONSTANTS, _MAX_DRAWN_FEATURES, _MOMENTUM, _SCALE_LIMIT, MAX_FEATURES, OpSpec


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
# The model being drawn, which a kind adds its op to
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
