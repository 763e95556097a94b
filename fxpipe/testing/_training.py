"""`assert_same_training`: what a training step left in a pipeline against what the same step
left in the model."""

from __future__ import annotations

from typing import Any

from torch import nn

from ._check import _assert_trees_close
from ._rounding import EPSILONS, grads_of


def assert_same_training(actual: nn.Module, expected: nn.Module, *,
                         loss: tuple[Any, Any] | None = None, buffers: bool = False,
                         epsilons: float = EPSILONS, rtol: float | None = None,
                         atol: float | None = None, what: str = "") -> None:
    """Assert that a training step left `actual` as the same step left `expected`.

    `actual` is a pipeline (or the model whose own parameters its CPU stages hold) and
    `expected` the model (or a copy of it) after the step the pipeline promises; `loss`, where
    given, is the pair (the pipeline's loss, the model's). What is computed together is
    compared together: the loss alone, then every parameter's gradient, by name (`grads_of`:
    the names, and which parameters have no gradient, must be the same), then, with `buffers`,
    every buffer (BatchNorm's statistics and counts). Each set is compared as rounding allows
    (`assert_same_up_to_rounding`, within `epsilons` epsilons of the set's largest magnitude)
    or, given `rtol` and `atol`, element by element by `torch.testing.assert_close` with them
    (tensors on other devices compared on the CPU). `what` begins each message (a model's
    name, a rank).
    """
    tolerance = ({"epsilons": epsilons} if rtol is None and atol is None else
                 {"rtol": rtol, "atol": atol})

    def named(part: str) -> str:
        return f"{what} {part}" if what else part

    if loss is not None:
        _assert_trees_close(loss[0], loss[1], tolerance, named("loss"))
    _assert_trees_close(grads_of(actual), grads_of(expected), tolerance, named("gradient"))
    if buffers:
        _assert_trees_close(dict(actual.named_buffers()), dict(expected.named_buffers()),
                            tolerance, named("buffer"))
