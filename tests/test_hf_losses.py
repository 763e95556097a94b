"""Hugging Face language models trained and called as their users do: token losses that ignore
padding (-100), the model's own loss, and attention masks, position ids and token type ids as
keyword inputs. GPT-2, Llama, Qwen2 (causal) and BERT (masked LM) from tiny configs, each
compiled once on 2 stages in 2 micro-batches, with rows that count different numbers of tokens.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding

from test_hf_capture import CAUSAL_LMS, VOCAB, built, t, token_ids

MODELS = {**CAUSAL_LMS,
          "bert": lambda: t.BertForMaskedLM(t.BertConfig(
              num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
              vocab_size=VOCAB, max_position_embeddings=64))}


def padded_inputs(name: str, batch: int) -> dict[str, torch.Tensor]:
    """Token ids with a mask padding rows by different amounts: on the left for the causal LMs
    (with position ids counting the real tokens), on the right for BERT (with two segments)."""
    ids = token_ids(batch, 8)
    real = torch.ones_like(ids)
    for row in range(0, batch, 2):
        real[row, :1 + row % 7] = 0
    if name == "bert":
        segments = torch.zeros_like(ids)
        segments[:, 5:] = 1
        return {"input_ids": ids, "attention_mask": real.flip(-1), "token_type_ids": segments}
    return {"input_ids": ids, "attention_mask": real,
            "position_ids": (real.cumsum(-1) - 1).clamp(min=0)}


def labels_of(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The ids as labels, -100 where masked and on the second token of every third row."""
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    labels[::3, 1] = -100
    return labels


def token_mean(out, labels):
    """The usual token loss: the mean over the tokens not ignored."""
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


@pytest.fixture(scope="module", params=sorted(MODELS))
def compiled(request):
    name = request.param
    model = built(MODELS[name])
    pipe = fxpipe.compile(model, ["cpu", "cpu"], example_kwargs=padded_inputs(name, 4), chunks=2)
    return name, model, pipe


def the_models_step(model, inputs, labels, loss_fn):
    """loss_fn on the model's whole batch, and the gradients it gives every parameter."""
    model.zero_grad()
    loss = loss_fn(model(**inputs), labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def assert_trains_as_the_model(pipe, model, inputs, labels, loss_fn, expected_fn=None):
    """pipe.train_step with loss_fn gives the loss and gradients of `expected_fn` (by default
    loss_fn) on the model's whole batch."""
    expected_loss, expected = the_models_step(model, inputs, labels, expected_fn or loss_fn)
    pipe.zero_grad()
    loss = pipe.train_step(inputs, labels, loss_fn)
    assert_same_up_to_rounding(loss, expected_loss, what="loss")
    grads = {n: p.grad for n, p in pipe.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    assert_same_up_to_rounding(grads, expected, what="gradient")
    pipe.zero_grad()


def code_in(message: str) -> dict:
    """The `def loss_fn` a message shows, defined."""
    code = re.search(r"^    def loss_fn.*?^        return .*?$", message, re.S | re.M).group(0)
    namespace = {"F": F}
    exec(code.replace("\n    ", "\n").strip(), namespace)
    return namespace["loss_fn"]


# ---- a token loss that ignores padding ------------------------------------------------------

def test_a_token_mean_is_refused_naming_the_fix_whose_code_trains_as_the_model(compiled):
    name, model, pipe = compiled
    inputs = padded_inputs(name, 4)
    labels = labels_of(inputs)
    for p in pipe.parameters():
        p.grad = torch.full_like(p, 0.5)
    with pytest.raises(fxpipe.LossReductionError, match=r"return \(loss_sum, count\)") as refused:
        pipe.train_step(inputs, labels, token_mean)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in pipe.parameters())
    assert_trains_as_the_model(pipe, model, inputs, labels, code_in(str(refused.value)),
                               expected_fn=token_mean)


def next_token_mean(out, labels):
    """A causal LM's token loss: each position's logits predict the next token."""
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                           ignore_index=-100)


def test_the_fix_for_a_next_token_mean_keeps_the_shift_and_trains_as_the_model(compiled):
    name, model, pipe = compiled
    inputs = padded_inputs(name, 4)
    labels = labels_of(inputs)
    with pytest.raises(fxpipe.LossReductionError, match=r"return \(loss_sum, count\)") as refused:
        pipe.train_step(inputs, labels, next_token_mean)
    assert "logits[:, :-1], labels[:, 1:]" in str(refused.value)
    assert_trains_as_the_model(pipe, model, inputs, labels, code_in(str(refused.value)),
                               expected_fn=next_token_mean)


def test_the_fix_for_a_token_mean_of_another_form_says_to_slice_as_it_does(compiled):
    name, model, pipe = compiled
    inputs = padded_inputs(name, 4)
    labels = labels_of(inputs)

    def smoothed(out, labels):
        return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                               label_smoothing=0.1)
    with pytest.raises(fxpipe.LossReductionError, match="slice logits and labels here as your"):
        pipe.train_step(inputs, labels, smoothed)


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_a_mean_over_rows_trains_as_the_model(compiled, loss):
    name, model, pipe = compiled
    inputs = padded_inputs(name, 4)
    if loss == "mse":
        def loss_fn(out, target):
            return F.mse_loss(out.logits, target)
        target = torch.randn(4, 8, VOCAB, generator=torch.Generator().manual_seed(2))
    else:
        loss_fn, target = token_mean, inputs["input_ids"]     # no target ignored
    assert_trains_as_the_model(pipe, model, inputs, target, loss_fn)


# ---- the model's own loss -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_models_own_loss_is_refused_naming_train_step_whose_code_gives_it(name):
    model = built(MODELS[name])
    inputs = padded_inputs(name, 4)
    labels = labels_of(inputs)
    with pytest.raises(fxpipe.BatchError, match=r"pipe\.train_step\(inputs, labels, loss_fn\)"
                       ) as refused:
        fxpipe.compile(model, ["cpu", "cpu"], example_kwargs={**inputs, "labels": labels},
                       chunks=2)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], example_kwargs=inputs, chunks=2)
    assert_trains_as_the_model(pipe, model, inputs, labels, code_in(str(refused.value)),
                               expected_fn=lambda out, _: model(**inputs, labels=labels).loss)


# ---- masks, position ids and token types ----------------------------------------------------

@pytest.mark.parametrize("batch", [4, 5, 6])
def test_masked_inputs_give_the_models_outputs_on_every_unmasked_position(compiled, batch):
    name, model, pipe = compiled
    inputs = padded_inputs(name, batch)
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        expected = model(**inputs).logits
        got = pipe(**inputs).logits
    assert got.shape == expected.shape
    assert_same_up_to_rounding(got[real], expected[real])
