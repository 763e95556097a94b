"""The Hypothesis strategy `models`: draws a `GraphSpec` op by op and builds its case."""

from __future__ import annotations

from typing import Any, Literal

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from .kinds import _KINDS, _Builder, _pick
from .model import ModelCase, build_case
from .specs import _MAX_DRAWN_FEATURES, _OUTPUT_KINDS, GraphSpec


# --------------------------------------------------------------------------- #
# Generation
# --------------------------------------------------------------------------- #
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
