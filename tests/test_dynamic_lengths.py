"""One compile serves every batch size and sequence length the model takes.

torch.export is asked to leave every input size free; it keeps fixed only the sizes the model's
code fixes, and those are refused naming the dimension and the line. torch.fx graphs are
shape-free. GPT-2 and Llama (captured by export) and BERT (by fx) from tiny configs, compiled
once on 32 tokens, run on other lengths and batch sizes as the model does.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding

from test_hf_capture import VOCAB, built, token_ids
from test_hf_losses import MODELS, the_models_step, token_mean

NAMES = ("bert", "gpt2", "llama")
CAPTURED_BY = {"bert": "fx+leaves", "gpt2": "export", "llama": "export"}


@pytest.fixture(scope="module", params=NAMES)
def compiled(request):
    name = request.param
    model = built(MODELS[name])
    pipe = fxpipe.compile(model, ["cpu", "cpu"], example_kwargs={"input_ids": token_ids(4, 32)},
                          chunks=2)
    assert pipe.plan.capture.method == CAPTURED_BY[name]
    return name, model, pipe


def assert_same_logits(pipe, model, ids):
    with torch.no_grad():
        assert_same_up_to_rounding(pipe(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("batch", [3, 8])
@pytest.mark.parametrize("tokens", [17, 48, 32])
def test_one_compile_serves_other_lengths_and_batch_sizes(compiled, batch, tokens):
    _, model, pipe = compiled
    assert_same_logits(pipe, model, token_ids(batch, tokens))


def test_the_plan_says_which_sizes_are_free_and_that_it_is_balanced_at_the_examples(compiled):
    name, _, pipe = compiled
    shown = str(pipe.plan)
    assert "balanced for the example's sizes" in shown
    if CAPTURED_BY[name] == "export":
        assert "input_ids (*, *)" in shown


def test_train_step_on_another_length_gives_the_models_loss_and_gradients(compiled):
    _, model, pipe = compiled
    ids = token_ids(4, 48)
    expected_loss, expected = the_models_step(model, {"input_ids": ids}, ids, token_mean)
    pipe.zero_grad()
    loss = pipe.train_step({"input_ids": ids}, ids, token_mean)
    assert_same_up_to_rounding(loss, expected_loss)
    # CPU stages hold the model's own parameters: their gradients are the pipeline's
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    assert_same_up_to_rounding(grads, expected, what="gradient")
    pipe.zero_grad()


@pytest.mark.parametrize("name", NAMES)
def test_a_batch_of_one_runs_at_other_lengths_in_one_micro_batch(name):
    model = built(MODELS[name])
    pipe = fxpipe.compile(model, ["cpu", "cpu"], example_kwargs={"input_ids": token_ids(4, 32)},
                          chunks=1)
    for tokens in (17, 48):
        assert_same_logits(pipe, model, token_ids(1, tokens))


def test_a_saved_plan_serves_another_length(compiled, tmp_path):
    name, model, pipe = compiled
    pipe.plan.save(tmp_path / "plan")
    # bert's capture (fx+leaves) keeps modules of its own classes whole: they come from model=.
    loaded = fxpipe.Pipeline(fxpipe.load_plan(tmp_path / "plan",
                                              model if name == "bert" else None))
    assert_same_logits(loaded, model, token_ids(3, 20))


# ---- models whose code fixes or constrains a length ----------------------------------------

class FixedLength(nn.Module):
    """Folds a sequence of exactly 32 tokens: the view's literal fixes the length."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.proj(x).view(x.shape[0], 32, -1))


class EvenLength(nn.Module):
    """Scales sequences of even length: a branch on the length."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        if x.shape[1] % 2 == 0:
            y = y * 2
        return self.head(y)


class Positions(nn.Module):
    """Adds a learned position table of 32 rows, sliced to the input's length."""

    def __init__(self):
        super().__init__()
        self.positions = nn.Parameter(torch.randn(32, 8))
        self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x) + self.positions[:x.shape[1]]))


def exported(model, tokens=32, chunks=2):
    x = torch.randn(4, tokens, 8, generator=torch.Generator().manual_seed(0))
    return fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=chunks, capture="export")


def test_a_length_the_models_code_fixes_is_refused_naming_the_dimension_and_the_line():
    model = FixedLength()
    pipe = exported(model)
    with pytest.raises(fxpipe.InputError,
                       match=r"(?s)dimension 1 is fixed to 32 by the model's code\n.*"
                             r"view\(x\.shape\[0\], 32, -1\).*Fix: compute that size from the "
                             r"input in the model \(x\.shape\[1\], or -1 in a view"):
        pipe(torch.randn(4, 17, 8))
    x = torch.randn(6, 32, 8)
    assert_same_up_to_rounding(pipe(x), model(x))


def test_a_length_breaking_a_condition_of_the_graph_is_refused_naming_it():
    model = EvenLength()
    pipe = exported(model)
    with pytest.raises(fxpipe.InputError, match=r"break a condition .*\ncondition: \(x\.shape\[1\] % 2\) "
                                                r"== 0"):
        pipe(torch.randn(4, 17, 8))
    x = torch.randn(3, 48, 8)
    assert_same_up_to_rounding(pipe(x), model(x))


@functools.cache
def positions_pipeline():
    model = Positions().eval()
    return model, exported(model, tokens=24)


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(2, 9), tokens=st.integers(1, 32))
def test_a_position_table_sliced_to_the_length_serves_every_length_up_to_its_rows(batch, tokens):
    model, pipe = positions_pipeline()
    x = torch.randn(batch, tokens, 8)
    with torch.no_grad():
        assert_same_up_to_rounding(pipe(x), model(x))


def test_a_length_beyond_the_position_table_is_refused_naming_the_bound():
    _, pipe = positions_pipeline()
    with pytest.raises(fxpipe.InputError, match=r"break a condition .*\ncondition: x\.shape\[1\] <= 32"):
        pipe(torch.randn(3, 40, 8))


class MaskedWithBias(nn.Module):
    """Three keyword inputs of related lengths: the mask's is x's, the bias's at least x's."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, x, mask=None, bias=None):
        return self.proj(x) * mask[:, :, None] + bias[:, :x.shape[1]]


def test_keyword_inputs_in_any_order_are_held_to_the_relations_of_their_lengths():
    model = MaskedWithBias()
    example = {"bias": torch.randn(4, 10, 3), "x": torch.randn(4, 8, 3), "mask": torch.ones(4, 8)}
    pipe = fxpipe.compile(model, ["cpu", "cpu"], example_kwargs=example, chunks=2,
                          capture="export")
    inputs = {"x": torch.randn(6, 12, 3), "mask": torch.rand(6, 12), "bias": torch.randn(6, 15, 3)}
    assert_same_up_to_rounding(pipe(**inputs), model(**inputs))
    with pytest.raises(fxpipe.InputError, match=r"mask.shape\[1\] == x.shape\[1\]"):
        pipe(**{**inputs, "mask": torch.ones(6, 11)})
    with pytest.raises(fxpipe.InputError, match=r"x.shape\[1\] <= bias.shape\[1\]"):
        pipe(**{**inputs, "bias": torch.randn(6, 9, 3)})
