"""Hugging Face transformers through fxpipe: captured by torch.export, pipelined, same numbers.

Every model is built from a config with small random weights (2 layers, width 32, no network),
compiled on 2, 4 and 8 stages, and compared with the original: outputs (in the model's own
`ModelOutput` type) and the gradients of every parameter.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import fxpipe
from fxpipe.testing import assert_pipeline_matches

transformers = pytest.importorskip("transformers", minversion="5")

VOCAB, BATCH, SEQ = 64, 4, 8


def _configs() -> dict:
    t = transformers
    small = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return {
        "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, n_positions=32, use_cache=False, **small)),
        "bert": (t.BertForSequenceClassification, t.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, **small)),
        "t5": (t.T5ForConditionalGeneration, t.T5Config(
            num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64,
            use_cache=False, decoder_start_token_id=0, **small)),
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=32, use_cache=False, **small)),
        "mistral": (t.MistralForCausalLM, t.MistralConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=32, sliding_window=4, use_cache=False,
            **small)),
        "distilbert": (t.DistilBertForSequenceClassification, t.DistilBertConfig(
            n_layers=2, dim=32, n_heads=4, hidden_dim=64, max_position_embeddings=32, **small)),
    }


CONFIGS = _configs()


def build(name: str):
    """The model in eval mode and its keyword inputs: token ids and a mask with some padding."""
    model_class, config = CONFIGS[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(config).eval()
        inputs = {"input_ids": torch.randint(2, VOCAB, (BATCH, SEQ)),
                  "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}
        inputs["attention_mask"][0, -3:] = 0
        if name == "t5":
            inputs["decoder_input_ids"] = torch.randint(2, VOCAB, (BATCH, SEQ))
    return model, inputs


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
    return request.param, *build(request.param)


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_pipeline_matches_outputs_and_gradients(case, stages):
    name, model, inputs = case
    pipe = assert_pipeline_matches(model, (), inputs, devices=["cpu"] * stages, chunks=2,
                                   backward=True, rtol=1e-4, atol=1e-5)
    assert pipe.plan.capture.method == "export", f"{name}: {pipe.plan.capture}"
    assert len(pipe.stages) == stages


@pytest.fixture(scope="module")
def pipe(case):
    """The model on 3 stages, 2 micro-batches, shared by the tests that only call it."""
    name, model, inputs = case
    return fxpipe.compile(model, ["cpu"] * 3, example_kwargs=inputs, chunks=2)


def test_output_keeps_the_models_type_and_a_smaller_last_micro_batch_runs(case, pipe):
    name, model, inputs = case
    odd = {k: v[:3] for k, v in inputs.items()}         # micro-batches of 2 and 1 rows
    out, expected = pipe(**odd), model(**odd)
    assert type(out) is type(expected) and out.keys() == expected.keys()
    for key in expected.keys():
        torch.testing.assert_close(out[key], expected[key], rtol=1e-4, atol=1e-5)


def test_plan_says_how_and_why_the_model_was_captured_and_lists_modules(case, pipe):
    name, model, inputs = case
    assert "captured by export in eval mode because torch.fx failed" in str(pipe.plan)
    listed = [m for stage in pipe.plan.stage_modules for m in stage]
    assert listed and all(m.split(" ")[0].rsplit("-")[0] in dict(model.named_modules())
                          for m in listed)
    named = [n.name for n in pipe.module.graph.nodes if n.op == "call_function"]
    assert sum(n.startswith(tuple(p.replace(".", "_") for p, _ in model.named_children()))
               for n in named) > len(named) // 2, "most nodes are named after their module"


def loss_fn(output, target):
    return F.cross_entropy(output.logits.flatten(0, -2), target.flatten())


@pytest.mark.skipif(not hasattr(fxpipe.Pipeline, "train_step"), reason="no Pipeline.train_step")
def test_train_step_gives_the_models_gradients(case):
    name, model, inputs = case
    logits = model(**inputs).logits
    target = torch.randint(0, logits.shape[-1], logits.shape[:-1])
    model.zero_grad()
    expected_loss = loss_fn(model(**inputs), target)
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    pipe = fxpipe.compile(model, ["cpu"] * 4, example_kwargs=inputs, chunks=2)
    loss = pipe.train_step(inputs, target, loss_fn)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-6)
    grads = {n: p.grad for n, p in pipe.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n], rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{name} {n}: {m}")
    model.zero_grad()
