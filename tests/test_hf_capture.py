"""Capturing Hugging Face models as their users build them, and the idioms of timm's models.

Causal LMs with their default config (`use_cache=True`) compile, without the key/value cache;
forwards wrapped by transformers' `*args, **kwargs` decorators are traced by fx where their
body allows it; a cache or setting that forward fills on first use, and transformers'
output-recording hooks, do not block capture, while per-call side effects stay refused.
Every model is built from a tiny config (random weights, no network).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.passes.capture import trace
from fxpipe.testing import assert_pipeline_matches
from fxpipe.testing import assert_same_up_to_rounding

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers as t  # noqa: E402  (a test dependency: its absence must fail, not skip)

VOCAB = 100
DECODER = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64)
CAUSAL_LMS = {
    "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=64, n_head=2,
                                                   vocab_size=VOCAB, n_positions=64,
                                                   bos_token_id=0, eos_token_id=1)),
    "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**DECODER)),
    "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**DECODER)),
}


def built(make) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return make().eval()


def token_ids(batch: int = 4, tokens: int = 8) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(1))


# ---- causal LMs with their default config --------------------------------------------------

@pytest.mark.parametrize("name", sorted(CAUSAL_LMS))
def test_causal_lm_with_its_default_config_compiles_without_the_cache(name):
    model = built(CAUSAL_LMS[name])
    assert model.config.use_cache
    ids = token_ids()
    pipe = assert_pipeline_matches(model, (), {"input_ids": ids}, devices=["cpu", "cpu"])
    out = pipe(input_ids=ids)
    assert_same_up_to_rounding(out.logits, model(input_ids=ids).logits)
    assert out.past_key_values is None
    assert pipe.plan.capture.uncached
    assert "without the key/value cache (use_cache=False)" in str(pipe.plan)
    with pytest.raises(fxpipe.InputError, match="use_cache"):
        pipe(input_ids=ids, use_cache=True)


def test_an_example_asking_for_the_cache_is_refused_by_name():
    model = built(CAUSAL_LMS["llama"])
    with pytest.raises(fxpipe.TraceError, match=r"use_cache=True: .*key/value cache[\s\S]*Fix: leave "
                                                r"use_cache out of the example"):
        fxpipe.compile(model, ["cpu", "cpu"],
                       example_kwargs={"input_ids": token_ids(), "use_cache": True})


# ---- readable stages: fx through transformers' decorators ----------------------------------

def test_bert_stages_read_as_module_calls():
    model = built(lambda: t.BertForSequenceClassification(t.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=32)))
    pipe = assert_pipeline_matches(model, (), {"input_ids": token_ids()},
                                   devices=["cpu", "cpu"])
    assert pipe.plan.capture.method == "fx+leaves", pipe.plan.capture
    assert "captured by fx+leaves" in str(pipe.plan)
    assert "self.bert.embeddings.word_embeddings(input_ids)" in pipe.stages[0].code


def returns_tuple_on_request(forward):
    """A decorator as transformers writes them: `*args, **kwargs` around forward."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        as_tuple = kwargs.pop("return_tuple", False)
        out = forward(self, *args, **kwargs)
        return tuple(out.values()) if as_tuple else out
    return wrapper


class DecoratedTower(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    @returns_tuple_on_request
    def forward(self, x, scale=None, **kwargs):
        for layer in self.layers:
            x = layer(x).relu()
        return {"hidden": x if scale is None else x * scale}


def test_a_forward_behind_a_star_args_decorator_is_traced_by_fx():
    torch.manual_seed(0)
    model = DecoratedTower().eval()
    x = torch.randn(8, 16)
    pipe = assert_pipeline_matches(model, (x,), devices=["cpu", "cpu"])
    assert pipe.plan.capture.method == "fx", pipe.plan.capture
    code = "".join(stage.code for stage in pipe.stages)
    assert all(f'getattr(self.layers, "{i}")(' in code for i in range(4)), code
    with pytest.raises(fxpipe.InputError, match="return_tuple"):
        pipe(x, return_tuple=True)


# ---- first-use caches, settings and output-recording hooks ---------------------------------

class BiasCachedAttention(nn.Module):
    """timm's LeViT idiom: in eval mode, the attention bias is gathered once per device into
    a dict (`attention_bias_cache`) and read from it afterwards."""

    def __init__(self, width: int = 16, tokens: int = 6):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attention_biases = nn.Parameter(torch.randn(tokens))
        self.register_buffer("attention_bias_idxs",
                             torch.randint(0, tokens, (tokens, tokens)), persistent=False)
        self.attention_bias_cache = {}

    def get_attention_biases(self, device: torch.device) -> torch.Tensor:
        if self.training:
            return self.attention_biases[self.attention_bias_idxs]
        key = str(device)
        if key not in self.attention_bias_cache:
            self.attention_bias_cache[key] = self.attention_biases[self.attention_bias_idxs]
        return self.attention_bias_cache[key]

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / 4 + self.get_attention_biases(x.device)
        return x + self.proj(scores.softmax(-1) @ v)


class BiasCachedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(BiasCachedAttention() for _ in range(3)))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.blocks(x).mean(1))


class ScaledInput(nn.Module):
    """timm's CrossViT idiom: forward sets the size it scales the image to from the input's."""

    def __init__(self):
        super().__init__()
        self.scale = 0.5
        self.embed = nn.Conv2d(3, 8, 2, stride=2)
        self.head = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        self.img_size_scaled = [int(s * self.scale) for s in x.shape[-2:]]
        x = F.interpolate(x, size=self.img_size_scaled, mode="bilinear", align_corners=False)
        return self.head(self.embed(x).relu().flatten(1))


@pytest.mark.filterwarnings("ignore:A model attribute")   # export's, about the cached bias
@pytest.mark.filterwarnings("ignore:The tensor attributes")
@pytest.mark.parametrize("capture", ["auto", "export"])
@pytest.mark.parametrize("ran_before", [False, True])
def test_a_per_device_cache_filled_in_eval_mode_does_not_block_capture(capture, ran_before):
    torch.manual_seed(0)
    model = BiasCachedNet().eval()
    x = torch.randn(4, 6, 16)
    if ran_before:
        model(x)
    caches = [dict(block.attention_bias_cache) for block in model.blocks]
    fxpipe.compile(model, ["cpu", "cpu"], example_inputs=(x,), capture=capture)
    assert [block.attention_bias_cache for block in model.blocks] == caches
    assert_pipeline_matches(model, (x,), devices=["cpu", "cpu"], capture=capture)


def test_a_size_set_in_forward_does_not_block_capture():
    torch.manual_seed(0)
    model = ScaledInput().eval()
    x = torch.randn(4, 3, 16, 16)
    fxpipe.compile(model, ["cpu", "cpu"], example_inputs=(x,))
    assert "img_size_scaled" not in vars(model)
    assert_pipeline_matches(model, (x,), devices=["cpu", "cpu"])


class GrowingDict(nn.Module):
    """Stores each call's output under a new key: a per-call side effect."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.outputs = {}

    def forward(self, x):
        h = self.lin(x)
        self.outputs[len(self.outputs)] = h.detach()
        return h


class LastOutput(nn.Module):
    """Keeps the latest output: a tensor stored per call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        self.last = h.detach()
        return h


@pytest.mark.filterwarnings("ignore:The tensor attribute")   # export's, about the stored tensor
@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("module, attribute", [(GrowingDict, "outputs"), (LastOutput, "last")])
def test_per_call_side_effects_stay_refused(capture, module, attribute):
    model = nn.Sequential(nn.Linear(8, 8), module()).eval()
    before = dict(vars(model[1]))
    with pytest.raises(fxpipe.TraceError, match=rf"(?s)attribute '{attribute}'.*Fix: move it out"):
        fxpipe.compile(model, ["cpu"] * 2, example_inputs=(torch.randn(8, 8),), capture=capture)
    assert vars(model[1]) == before and getattr(model[1], attribute, {}) == {}


def test_deberta_v2_matches_the_model():
    model = built(lambda: t.DebertaV2ForSequenceClassification(t.DebertaV2Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=32)))
    assert_pipeline_matches(model, (), {"input_ids": token_ids()}, devices=["cpu", "cpu"])


def segformer() -> nn.Module:
    return built(lambda: t.SegformerForSemanticSegmentation(t.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
        num_attention_heads=[1, 2], decoder_hidden_size=16, num_labels=3, patch_sizes=[3, 3],
        strides=[2, 2], mlp_ratios=[2, 2])))


def hooks(model: nn.Module) -> list[int]:
    return [len(m._forward_hooks) for m in model.modules()]


@pytest.mark.parametrize("ran_before", [False, True])
def test_segformer_with_output_recording_hooks_matches_the_model(ran_before):
    model = segformer()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    if ran_before:       # transformers installs its output-recording hooks on the first call
        model(pixel_values=x)
        assert sum(hooks(model)) > 0
    installed = hooks(model)
    fxpipe.compile(model, ["cpu", "cpu"], example_kwargs={"pixel_values": x}, capture="export")
    assert hooks(model) == installed
    assert_pipeline_matches(model, (), {"pixel_values": x}, devices=["cpu", "cpu"])


def test_a_cache_filled_by_tracing_is_not_left_in_the_model():
    torch.manual_seed(0)
    model = BiasCachedNet().eval()
    x = torch.randn(4, 6, 16)
    gm = trace(model, (x,))
    assert all(block.attention_bias_cache == {} for block in model.blocks)
    torch.testing.assert_close(gm(x), model(x))


class ScaledByConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_a_tensor_made_in_forward_stays_in_the_fx_graph_and_out_of_the_model():
    """fx stores such a tensor on the model while tracing; the graph keeps it, the model not."""
    model = ScaledByConstant()
    x = torch.randn(2, 4)
    gm = trace(model, (x,))
    assert gm.meta["capture"].method == "fx"
    assert set(vars(model)) == set(vars(ScaledByConstant()))
    torch.testing.assert_close(gm(x), model(x))
