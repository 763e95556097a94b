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

The parts:

- ``specs.py``: :class:`OpSpec` and :class:`GraphSpec`, a generated model as data, and the
  bounds that keep its values tame.
- ``kinds.py``: the op kinds (each one's code, attribute and drawing rule) and the model being
  drawn that they add their ops to.
- ``model.py``: :class:`GeneratedModel`, which runs a spec and prints it as source, and
  :class:`ModelCase`, a model with example inputs.
- ``strategy.py``: :func:`models`, the Hypothesis strategy.
"""

from __future__ import annotations

from typing import Any

from . import model as _model
from .model import GeneratedModel, ModelCase, build_case  # noqa: F401 (build_case: tests)
from .specs import GraphSpec, OpSpec
from .strategy import models

__all__ = ["GeneratedModel", "GraphSpec", "ModelCase", "OpSpec", "models"]


def __getattr__(name: str) -> Any:
    # ``GeneratedModel<n>`` lives in ``model.py`` (where pickle finds it); named here too.
    if name.startswith("GeneratedModel"):
        return getattr(_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
