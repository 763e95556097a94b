"""The train-step contract (`fxpipe.runtime.step`), held by both backends alike: a `Pipeline` in
one process, and a saved plan run on two gloo ranks as test_distributed.py launches them.

A batch of 7 rows in 2 micro-batches (4 and 3 rows), so a mean must weight each micro-batch by
its rows; the loss, every parameter's gradient and (where the input takes one) the input's
gradient equal the model's on the whole batch.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding, grads_of
from test_distributed import Branchy, errors, planned, ran, results

from distributed_worker import positive_targets_mean, positive_targets_plain_mean

LOSSES = {   # the worker's mode -> (loss_fn, reduction)
    "run": (F.mse_loss, "mean"),
    "sum": (functools.partial(F.mse_loss, reduction="sum"), "sum"),
    "count": (positive_targets_mean, "mean"),
}


def in_process(tmp_path, mode):
    """(model, x, target, loss, gradients by name, x's gradient) of a `Pipeline`'s step."""
    model, x, target, pipe = planned(tmp_path, 2, model=Branchy(), x=torch.randn(7, 8),
                                     target=torch.randn(7, 4))
    loss_fn, reduction = LOSSES[mode]
    x_in = x.clone().requires_grad_() if mode == "count" else x
    pipe.zero_grad()
    loss = pipe.train_step(x_in, target, loss_fn, reduction=reduction)
    grads = {name: p.grad for name, p in pipe.named_parameters()}
    return model, x, target, loss, grads, x_in.grad


def on_two_ranks(tmp_path, mode):
    """The same of a step on two gloo ranks, one stage each: the loss on the last rank, each
    rank's gradients, the input's on the first."""
    model, x, target, _, out = ran(tmp_path, 2, 2, mode=mode, model=Branchy(),
                                   x=torch.randn(7, 8), target=torch.randn(7, 4))
    first, last = results(out, 2)
    return model, x, target, last["loss"], {**first["grads"], **last["grads"]}, first["x_grad"]


@pytest.mark.parametrize("mode", list(LOSSES), ids=["rows-weighted-mean", "sum", "sum-and-count"])
@pytest.mark.parametrize("backend", [in_process, on_two_ranks], ids=["pipeline", "gloo-ranks"])
def test_a_train_step_gives_the_whole_batchs_loss_and_gradients(tmp_path, backend, mode):
    torch.manual_seed(0)
    model, x, target, loss, grads, x_grad = backend(tmp_path, mode)
    loss_fn, _ = LOSSES[mode]
    x = x.clone().requires_grad_()
    model.zero_grad()
    expected = loss_fn(model(x), target)
    if isinstance(expected, tuple):
        expected = expected[0] / expected[1]
    expected.backward()
    assert_same_up_to_rounding(loss, expected.detach())
    assert set(grads) == {name for name, _ in model.named_parameters()}
    assert_same_up_to_rounding(grads, grads_of(model), what="gradient")
    if mode == "count":      # the input took a gradient: the whole batch's mean's
        assert_same_up_to_rounding(x_grad, x.grad)


def test_a_mean_loss_not_over_rows_is_refused_by_both_backends_naming_the_fix(tmp_path):
    """A mean over the positive targets (rows count different numbers of them) is refused at the
    first step, on every rank, with `.grad` as it was; the `(loss_sum, count)` form is named."""
    torch.manual_seed(0)
    model, x, target, pipe, out = ran(tmp_path, 2, 2, mode="positives", model=Branchy(),
                                      x=torch.randn(7, 8), target=torch.randn(7, 4))
    refusals = errors(out, 2)
    assert all(e is not None and e.startswith("LossReductionError") and "(loss_sum, count)" in e
               for e in refusals), refusals

    for p in pipe.parameters():
        p.grad = torch.full_like(p, 0.5)
    with pytest.raises(fxpipe.LossReductionError, match=r"return \(loss_sum, count\)"):
        pipe.train_step(x, target, positive_targets_plain_mean)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in pipe.parameters())
