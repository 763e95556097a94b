"""Defaults that overlap: `chunks` left out takes 2 micro-batches per stage (at most the
example's rows; one where micro-batches would compute something else), and a plan whose stages
cannot all work at once says so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.plans import report
from fxpipe.planning.search import default_chunks
from fxpipe.testing import assert_same_up_to_rounding


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])


def test_the_default_rule_takes_two_per_stage_at_most_the_rows_and_one_on_one_stage():
    assert [default_chunks(16, k) for k in (1, 2, 3, 4)] == [1, 4, 6, 8]
    assert [default_chunks(rows, 4) for rows in (1, 3, 8, 9)] == [1, 3, 8, 8]


@pytest.mark.parametrize("devices, rows, chunks", [(2, 16, 4), (3, 16, 6), (2, 3, 3), (1, 16, 1)])
def test_a_plan_without_chunks_takes_the_default_and_equals_the_model(devices, rows, chunks):
    model, x = mlp().eval(), torch.randn(rows, 16)
    pipe = fxpipe.compile(model, ["cpu"] * devices, (x,))
    assert pipe.plan.chunks == chunks
    assert_same_up_to_rounding(pipe(x), model(x))


def test_auto_stages_take_the_default_for_each_stage_count_weighed():
    plan = fxpipe.plan(mlp().eval(), ["cpu"] * 3, (torch.randn(16, 16),), num_stages="auto",
                       repeats=1)
    for candidate in plan.record.considered:
        config = candidate.config
        assert config.chunks == default_chunks(16, config.num_stages), config


def test_batch_norm_in_training_keeps_the_batch_whole_and_the_plan_says_its_stages_take_turns():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)).train()
    plan = fxpipe.plan(model, ["cpu"] * 2, (torch.randn(8, 16),))
    assert plan.chunks == 1
    assert "warning: one micro-batch per call: the 2 stages run one after another" in str(plan)


class MixesTheBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        return self.b(h - h.mean(0))


def test_a_model_mixing_the_batch_gets_one_micro_batch_by_default_but_is_refused_when_asked():
    model, x = MixesTheBatch().eval(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,))
    assert pipe.plan.chunks == 1
    assert_same_up_to_rounding(pipe(x), model(x))
    with pytest.raises(fxpipe.FxpipeError, match="mixes"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)


def test_the_first_steps_loss_check_runs_by_default():
    """It needs two micro-batches or more: with the default, a token mean that is no mean over
    rows is refused instead of training on the wrong weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 20))
    ids = torch.randint(0, 20, (4, 6))
    labels = ids.clone()
    labels[0, :5] = -100

    def token_mean(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (ids,), training=True)
    assert pipe.plan.chunks == 4
    with pytest.raises(fxpipe.LossReductionError):
        pipe.train_step(ids, labels, token_mean)


def test_more_cpu_stages_than_cores_are_named(monkeypatch):
    plan = fxpipe.plan(mlp().eval(), ["cpu"] * 3, (torch.randn(12, 16),))
    monkeypatch.setattr(report.os, "cpu_count", lambda: 2)
    assert "warning: 3 CPU stages on 2 cores: they take turns on the cores" in str(plan)
    monkeypatch.setattr(report.os, "cpu_count", lambda: 3)
    assert "CPU stages on" not in str(plan)
    assert "one micro-batch per call" not in str(plan)
