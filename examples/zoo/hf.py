"""Hugging Face transformers for the zoo, built from configs: random weights, no network.

    model, inputs = build_hf("llama", size="tiny", batch=4)   # model(**inputs)

GPT-2, BERT, T5 (encoder-decoder), Llama (RoPE, grouped-query attention), Mistral (sliding
window) and DistilBERT. `tiny` is 2 layers of width 32 on 8 tokens (tests); `small` is 4 layers of
width 256 on 64 tokens (benchmarks). Inputs are keyword inputs: token ids and an attention mask
whose first sequence ends in padding; T5 also gets decoder ids. Needs `transformers` (5.x).
"""

from __future__ import annotations

import torch
from torch import nn

HF_MODELS = ("gpt2", "bert", "t5", "llama", "mistral", "distilbert")
_SIZES = {"tiny": (2, 32, 8, 64), "small": (4, 256, 64, 1000)}   # layers, width, tokens, vocab


def build_hf(name: str, size: str = "tiny", batch: int = 4, seed: int = 0) -> tuple[nn.Module, dict]:
    """The model (in eval mode) and its keyword inputs."""
    import transformers as t

    if name not in HF_MODELS or size not in _SIZES:
        raise ValueError(f"unknown model {name!r} or size {size!r}: models are "
                         f"{', '.join(HF_MODELS)}; sizes {', '.join(_SIZES)}")
    layers, width, seq, vocab = _SIZES[size]
    heads = 4
    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    decoder = dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                   num_key_value_heads=heads // 2, intermediate_size=2 * width,
                   max_position_embeddings=4 * seq, use_cache=False, **common)
    configs = {
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, n_positions=4 * seq, use_cache=False,
            **common)),
        "bert": lambda: t.BertForSequenceClassification(t.BertConfig(
            num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
            intermediate_size=2 * width, max_position_embeddings=4 * seq, **common)),
        "t5": lambda: t.T5ForConditionalGeneration(t.T5Config(
            num_layers=layers, num_decoder_layers=layers, d_model=width, d_kv=width // heads,
            num_heads=heads, d_ff=2 * width, use_cache=False, decoder_start_token_id=0, **common)),
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**decoder)),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(sliding_window=seq // 2, **decoder)),
        "distilbert": lambda: t.DistilBertForSequenceClassification(t.DistilBertConfig(
            n_layers=layers, dim=width, n_heads=heads, hidden_dim=2 * width,
            max_position_embeddings=4 * seq, **common)),
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = configs[name]().eval()
        inputs = {"input_ids": torch.randint(2, vocab, (batch, seq)),
                  "attention_mask": torch.ones(batch, seq, dtype=torch.long)}
        inputs["attention_mask"][0, -min(3, seq - 1):] = 0
        if name == "t5":
            inputs["decoder_input_ids"] = torch.randint(2, vocab, (batch, seq))
    return model, inputs
