"""`pipe.generate` equals `model.generate`: tiny Hugging Face causal LMs from configs.

Greedy tokens are compared id for id, each sequence up to the first step where the model's own
two best logits are a rounding tie (after it, either token is right), and the logits before it
within the rounding rule. The stages keep the key/value cache (`fxpipe.generate`), a stage's
state owned by the runtime (`fxpipe.runtime.state`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.generate import GenerationError, plan_generation
from fxpipe.runtime import Runtime
from fxpipe.runtime.state import Planned, StageState
from fxpipe.testing import assert_same_up_to_rounding

from transformers import LlamaConfig, LlamaForCausalLM

FAST = dict(capture="export", repeats=1, verify=False)     # plans for tests: no second checks
LLAMA = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=1000)


@pytest.fixture(scope="module")
def scripted():
    """Node costs scripted (`conftest.script_costs`) for the module: plans that do not depend
    on the load, and no time spent measuring."""
    from conftest import script_costs
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield script_costs(monkeypatch)


def prompts(rows: int, length: int, pads: list[int], seed: int = 1, vocab: int = 1000):
    """Token ids and a mask, row r left-padded by `pads[r]`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for r, pad in enumerate(pads):
        mask[r, :pad] = 0
        ids[r, :pad] = 0
    return ids, mask


def both(pipe, model, **kwargs):
    """`pipe.generate`'s sequences, on lanes that advance on their own (it returns no
    per-step logits: those come in lockstep), and `model.generate`'s with its logits, on the
    same arguments."""
    kwargs = dict(kwargs, pad_token_id=0)
    got = pipe.generate(**kwargs)
    assert pipe._generation.last_lanes == "independent"
    return got, model.generate(**kwargs, return_dict_in_generate=True, output_logits=True)


def assert_same_tokens(got, want, prompt: int) -> None:
    """Each sequence's new tokens equal, up to its first rounding tie of `want`'s two best
    logits; where `got` has logits (not bare sequences), those of every step before it within
    the rounding rule."""
    sequences = got if isinstance(got, torch.Tensor) else got.sequences
    assert sequences.shape == want.sequences.shape
    assert torch.equal(sequences[:, :prompt], want.sequences[:, :prompt])
    for r in range(want.sequences.shape[0]):
        for t, b in enumerate(want.logits):
            if not isinstance(got, torch.Tensor):
                assert_same_up_to_rounding(got.logits[t][r], b[r],
                                           what=f"sequence {r}'s logits at step {t}")
            top = b[r].topk(2).values
            if top[0] - top[1] <= 128 * torch.finfo(b.dtype).eps * b[r].abs().max():
                break           # a tie: either token is the model's
            assert sequences[r, prompt + t] == want.sequences[r, prompt + t], \
                f"sequence {r}, new token {t}: {sequences[r]} != {want.sequences[r]}"


@pytest.fixture(scope="module")
def llama(scripted):
    """Llama on 2 stages, 2 lanes, planned for 4 sequences of 16 tokens, 6-token prefill
    chunks."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    ids, mask = prompts(4, 6, [2, 0, 3, 0])
    pipe = fxpipe.compile(model, ["cpu"] * 2, example_kwargs=dict(input_ids=ids,
                                                                 attention_mask=mask),
                          chunks=2, **FAST)
    plan_generation(pipe, rows=4, prompt=6, length=16, lanes=2, **FAST)
    yield model, pipe, ids, mask
    pipe.close()


def test_stage_state_lives_from_allocate_to_free_and_close():
    owner = nn.Module()
    owner.register_buffer("kv", torch.empty(0), persistent=False)
    state = StageState(0, torch.device("cpu"))
    state.adopt("kv", Planned((2, 3), torch.float32), [(owner, "kv")])
    assert state.nbytes == 24 and not state.allocated
    state.allocate()
    assert owner.kv is state.tensors["kv"] and owner.kv.shape == (2, 3)
    owner.kv.fill_(1.0)
    state.allocate()                     # a second use starts from zeros
    assert owner.kv is state.tensors["kv"] and not owner.kv.any()
    state.free()
    assert owner.kv.numel() == 0 and not state.tensors
    with pytest.raises(fxpipe.FxpipeError, match="planned twice"):
        state.adopt("kv", Planned((2, 4), torch.float32), [])


def test_runtime_close_frees_every_stage_state(llama):
    model, pipe, ids, mask = llama
    runtime = pipe._generation.runtimes[id(pipe._generation.decode)]
    assert isinstance(runtime, Runtime) and len(runtime.state) == 2
    fresh = type(runtime)(runtime.stages, runtime.wiring)
    fresh.state[0].adopt("x", Planned((1,), torch.float32), [])
    fresh.state[0].allocate()
    fresh.close()
    assert not fresh.state[0].tensors


def test_each_stage_holds_its_own_layers_cache(llama):
    model, pipe, ids, mask = llama
    generation = pipe._generation
    held = [set(state.planned) for state in generation.states]
    assert all(held) and not set.intersection(*held)
    assert set.union(*held) == {f"kv_{k}_{l}" for l in range(4) for k in ("keys", "values")}
    for stage, names in zip(generation.decode.stages, held):   # in its own stage's graph
        assert names == {n for n, _ in stage.module.named_buffers() if n.startswith("kv_")}
    assert generation.kv_bytes() == [2 * 2 * 4 * 2 * 16 * 16 * 4] * 2
    assert generation.decode.chunks == 2          # two lanes of two sequences


def test_kv_bytes_are_predicted_within_5_percent_and_printed_with_lanes_and_tokens_per_s(llama):
    from test_reading_the_plan import PAGE, unexplained
    from fxpipe.passes.cost_model import format_bytes
    model, pipe, ids, mask = llama
    generation = pipe._generation
    with generation.session():
        allocated = [sum(t.nbytes for t in state.tensors.values())
                     for state in generation.states]
    assert all(allocated) and len(allocated) == 2
    for predicted, held in zip(generation.kv_predicted, allocated):
        assert abs(predicted - held) <= 0.05 * held, (generation.kv_predicted, allocated)
    text = str(generation)
    assert "4 sequences of up to 16 tokens" in text and "2 lanes" in text
    assert "tokens/s" in text and generation.tokens_per_s() > 0
    for s, held in enumerate(allocated):
        assert any(line.split()[:2] == [str(s), "cpu"] and format_bytes(held) in line
                   for line in text.splitlines()), text
    assert unexplained(text, PAGE.read_text()) == [], text


def test_greedy_tokens_equal_model_generate_on_a_left_padded_batch(llama):
    model, pipe, ids, mask = llama
    def held():      # parameters and buffers (non-persistent ones too), as tensors and values
        return {n: (t, t.clone()) for n, t in [*model.named_parameters(),
                                               *model.named_buffers()]}
    before, generator = held(), torch.get_rng_state()
    got, want = both(pipe, model, input_ids=ids, attention_mask=mask, max_new_tokens=10,
                     do_sample=False)
    assert_same_tokens(got, want, ids.shape[1])
    assert torch.equal(torch.get_rng_state(), generator)      # greedy draws nothing
    after = held()
    assert before.keys() == after.keys()
    for name, (tensor, value) in before.items():
        assert after[name][0] is tensor and torch.equal(after[name][1], value), name
    assert not any(state.tensors for state in pipe._generation.states)   # freed
    assert all(b.numel() == 0 for stage in pipe._generation.decode.stages
               for n, b in stage.module.named_buffers() if n.startswith("kv_"))


def test_shorter_prompts_pad_and_longer_ones_prefill_in_chunks(llama):
    model, pipe, ids, mask = llama
    generation = pipe._generation
    for q, new in ((3, 8), (9, 4)):      # 3 tokens padded into one chunk; 9 into two
        short_ids, short_mask = prompts(4, q, [1, 0, 2, 0], seed=q)
        got, want = both(pipe, model, input_ids=short_ids, attention_mask=short_mask,
                         max_new_tokens=new, do_sample=False)
        assert_same_tokens(got, want, q)
    assert pipe._generation is generation          # both fit the plan


def test_a_prompts_chunks_overlap_across_the_stages(llama, monkeypatch):
    """Stage 1's prefill of the first chunk waits until stage 0 starts the last: chunks run
    one after another (each waiting for the one before to leave the last stage) would hold
    it until the timeout. The tokens are still the model's."""
    import threading
    model, pipe, ids, mask = llama
    stages = [stage.module for stage in pipe._generation.prefill.stages]
    calls, last_started, overlapped = [0, 0], threading.Event(), []

    def counted(index, forward):
        def run(*args):
            calls[index] += 1
            if index == 0 and calls[0] == 4:     # 2 chunks x 2 lanes: the last fed
                last_started.set()
            if index == 1 and calls[1] == 1:
                overlapped.append(last_started.wait(20))
            return forward(*args)
        return run
    for index, stage in enumerate(stages):
        monkeypatch.setattr(stage, "forward", counted(index, stage.forward))
    long_ids, long_mask = prompts(4, 12, [1, 0, 5, 0], seed=12)     # two chunks of 6
    got, want = both(pipe, model, input_ids=long_ids, attention_mask=long_mask,
                     max_new_tokens=4, do_sample=False)
    assert_same_tokens(got, want, 12)
    assert calls == [4, 4] and overlapped == [True]


def test_each_sequence_stops_at_its_eos_padded_after_as_the_model_pads(llama):
    """Lane 0 (sequences 0 and 1, one prompt twice) meets its eos at its third token and
    stops; lane 1 goes on alone, and lane 0's rows come back padded as the model pads them."""
    model, pipe, ids, mask = llama
    ids, mask = ids.clone(), mask.clone()
    ids[0], mask[0] = ids[1], mask[1]
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                          do_sample=False, pad_token_id=0)
    q = ids.shape[1]
    eos = int(free[1, q + 2])            # sequence 1's third new token
    assert eos not in free[2:, q:]       # lane 1 never meets it
    got, want = both(pipe, model, input_ids=ids, attention_mask=mask, max_new_tokens=8,
                     do_sample=False, eos_token_id=eos)
    assert (want.sequences[:2, q + 3:] == 0).all()      # they ended early
    assert torch.equal(got, want.sequences)
    # Lane 0 ran 2 decode steps (its tokens after the first up to the eos), lane 1 all 7.
    steps = {slot.action.microbatch for slot in pipe._generation.last_run.slots}
    assert len(steps) == 2 + 7, sorted(steps)


def test_sampling_from_a_seed_draws_each_lanes_samples_from_its_own_generator(llama):
    from fxpipe.generate_lanes import lane_seeds
    model, pipe, ids, mask = llama
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True,
                  top_k=50, temperature=0.9, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(7)
    first = pipe.generate(**kwargs)
    after = torch.rand(3)            # where the caller's generator was left
    torch.manual_seed(7)
    again = pipe.generate(**kwargs)
    assert torch.equal(first, again)
    # Lane l (sequences 2l, 2l+1) samples as the model does on its rows alone, after
    # torch.manual_seed(lane_seeds(2)[l]) drawn after the caller's seed; the caller's generator
    # moves by that one draw only.
    torch.manual_seed(7)
    seeds = lane_seeds(2)
    assert torch.equal(torch.rand(3), after)
    for lane, seed in enumerate(seeds):
        rows = slice(2 * lane, 2 * lane + 2)
        torch.manual_seed(seed)
        expected = model.generate(**dict(kwargs, input_ids=ids[rows], attention_mask=mask[rows]))
        assert torch.equal(first[rows], expected), f"lane {lane}"
    # One lane (a batch of one sequence) is the model's loop: its samples after the same seed.
    one = dict(kwargs, input_ids=ids[1:2], attention_mask=mask[1:2])
    torch.manual_seed(7)
    got = pipe.generate(**one)
    assert pipe._generation.last_lanes == "lockstep"
    torch.manual_seed(7)
    assert torch.equal(got, model.generate(**one))


def test_a_lanes_tokens_read_only_its_own_cache_rows(llama):
    """Lane 0's tokens are the same whatever lane 1's sequences are, and lane 1's are the
    model's on its new prompts: no lane reads (or writes) another's cache rows."""
    model, pipe, ids, mask = llama
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                  eos_token_id=None)
    first = pipe.generate(input_ids=ids, **kwargs)
    other = ids.clone()
    other[2:] = prompts(2, 6, [3, 0], seed=9)[0]
    second = pipe.generate(input_ids=other, **kwargs)
    assert pipe._generation.last_lanes == "independent"
    assert torch.equal(first[:2], second[:2])
    want = model.generate(input_ids=other, **kwargs, return_dict_in_generate=True,
                          output_logits=True)
    assert_same_tokens(second, want, ids.shape[1])


def test_no_thread_is_left_after_generate_nor_after_a_stage_fails(llama, monkeypatch):
    import threading
    from fxpipe.runtime.workers import working
    model, pipe, ids, mask = llama
    generation = pipe._generation
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                  pad_token_id=0)
    before = set(threading.enumerate())
    pipe.generate(**kwargs)
    kept = set(threading.enumerate()) - before    # the stages' workers, kept for the pipeline
    assert all(t.name.startswith("fxpipe-stage") for t in kept), kept
    stage = generation.decode.stages[1].module

    def failing(*args):
        raise RuntimeError("a failing decode step")
    monkeypatch.setattr(stage, "forward", failing)
    with pytest.raises(fxpipe.StageError, match=r"stage 1 failed on item \d+") as failed:
        pipe.generate(**kwargs)
    assert "a failing decode step" in str(failed.value)
    assert set(threading.enumerate()) - before == kept and not working()
    monkeypatch.undo()
    # A lane whose own loop fails before its prefill: the lane waiting to prefill with it
    # stops too, and the failure is raised as it is.
    loop = type(generation).loop

    def lane_1_fails(self, lane, mine):
        if lane.index == 1:
            raise ValueError("lane 1's loop failed")
        return loop(self, lane, mine)
    monkeypatch.setattr(type(generation), "loop", lane_1_fails)
    with pytest.raises(ValueError, match="lane 1's loop failed"):
        pipe.generate(**kwargs)
    assert set(threading.enumerate()) - before == kept and not working()
    monkeypatch.undo()
    assert torch.equal(pipe.generate(**kwargs), model.generate(**kwargs))


def test_a_lane_writes_only_its_own_cache_rows(llama):
    model, pipe, ids, mask = llama
    generation = pipe._generation
    from fxpipe.generate import Counting
    with generation.session():        # two of the planned four rows
        generation.front().generate(input_ids=ids[:2], attention_mask=mask[:2],
                                    max_new_tokens=3, do_sample=False, pad_token_id=0,
                                    cache=Counting())
        for state in generation.states:
            for name, t in state.tensors.items():
                assert t[:2].any(), name
                assert not t[2:].any(), f"{name}: rows 2-3 written by sequences 0-1"
                assert not t[:, :, 6 + 3:].any(), f"{name}: slots past the last token written"


def test_a_saved_generation_loads_and_generates_the_same_tokens(llama, tmp_path):
    from fxpipe.generate import load_generation, save_generation
    model, pipe, ids, mask = llama
    save_generation(pipe._generation, tmp_path / "gen")
    loaded = load_generation(tmp_path / "gen")
    try:
        assert loaded.kv_predicted == pipe._generation.kv_predicted and loaded.lanes == 2
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                      pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        assert_same_tokens(loaded.generate(**kwargs), model.generate(**kwargs), ids.shape[1])
        with pytest.raises(GenerationError, match="over the 4 x 16 planned"):
            loaded.generate(**dict(kwargs, max_new_tokens=20))
    finally:
        loaded.close()


def test_the_cli_plans_and_saves_a_generation_that_generates_the_models_tokens(tmp_path,
                                                                               capsys):
    import transformers
    from fxpipe.__main__ import main
    from fxpipe.generate import load_generation
    transformers.LlamaConfig(**dict(LLAMA, num_hidden_layers=2, vocab_size=100)).to_json_file(
        tmp_path / "config.json")
    assert main(["plan", "transformers:AutoModelForCausalLM", "--config",
                 str(tmp_path / "config.json"), "--tokens", "2x4", "--generate", "12",
                 "--chunks", "2", "--capture", "export", "--no-verify", "--quiet",
                 "--save", str(tmp_path / "gen")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fxpipe generation plan: 2 sequences of up to 12 tokens") and \
        "2 lanes" in out and "tokens/s" in out and "saved to" in out
    loaded = load_generation(tmp_path / "gen")
    try:
        torch.manual_seed(0)     # the CLI's model: built from the config with its own seed
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(tmp_path / "gen" / "model")).eval()
        held = {n: t for stage in loaded.decode.stages for n, t in stage.module.state_dict().items()}
        missing, _ = model.load_state_dict({n.removeprefix("model."): t for n, t in held.items()
                                            if not n.startswith("kv_")}, strict=False)
        assert not missing        # the decode stages hold every weight of the model
        ids, mask = prompts(2, 4, [1, 0], vocab=100)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                      pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        assert_same_tokens(loaded.generate(**kwargs), model.generate(**kwargs), 4)
    finally:
        loaded.close()


class Streamer:
    """A streamer as Hugging Face's loop calls one: `put` the prompt, then each new token;
    `end` once."""

    def __init__(self) -> None:
        self.put_ids, self.ended = [], 0

    def put(self, value: torch.Tensor) -> None:
        self.put_ids.append(value.clone())

    def end(self) -> None:
        self.ended += 1


def test_return_dict_fields_and_a_streamer_are_the_models(llama):
    model, pipe, ids, mask = llama
    kwargs = dict(input_ids=ids[1:2], attention_mask=mask[1:2], max_new_tokens=4,
                  do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                  output_scores=True, output_logits=True)
    streamed, model_streamed = Streamer(), Streamer()
    got = pipe.generate(**kwargs, streamer=streamed)
    assert pipe._generation.last_lanes == "lockstep"       # one loop, as the model's
    want = model.generate(**kwargs, streamer=model_streamed)
    assert type(got) is type(want)
    assert_same_tokens(got, want, ids.shape[1])
    assert len(got.scores) == len(want.scores) == 4
    for a, b in zip(got.scores, want.scores):
        assert_same_up_to_rounding(a, b, what="scores")
    assert got.attentions is None and got.hidden_states is None
    # The streamer saw the prompt, then each new token, then the end: the sequence returned.
    assert streamed.ended == 1 and len(streamed.put_ids) == len(model_streamed.put_ids) == 5
    assert torch.equal(torch.cat([t.reshape(1, -1) for t in streamed.put_ids], 1),
                       got.sequences)
    for asked in ("output_attentions", "output_hidden_states"):
        with pytest.raises(GenerationError, match=f"{asked}=True is not supported"):
            pipe.generate(**kwargs, **{asked: True})


def test_what_would_rearrange_the_cache_is_refused_by_name(llama):
    model, pipe, ids, mask = llama
    with pytest.raises(GenerationError, match="num_beams=1"):
        pipe.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, num_beams=2,
                      do_sample=False, pad_token_id=0)
    with pytest.raises(fxpipe.InputError, match="cache= out"):
        pipe.generate(input_ids=ids, cache=None, max_new_tokens=2)


def tiny(arch: str, layers: int) -> nn.Module:
    """A tiny random causal LM of `arch` (vocabulary 100, width 32-64, `layers` layers); the
    sliding windows (Mistral, Gemma2's sliding layers) 5 tokens, shorter than what is generated."""
    import transformers as hf
    torch.manual_seed(0)
    dims = dict(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, vocab_size=100)
    gqa = dict(dims, num_key_value_heads=2, intermediate_size=64)
    made = {
        "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**gqa)),
        "qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**gqa)),
        "qwen3": lambda: hf.Qwen3ForCausalLM(hf.Qwen3Config(**gqa, head_dim=8)),
        "mistral": lambda: hf.MistralForCausalLM(hf.MistralConfig(**gqa, sliding_window=5)),
        "gemma2": lambda: hf.Gemma2ForCausalLM(hf.Gemma2Config(**gqa, head_dim=8,
                                                               sliding_window=5)),
        "gpt2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=layers, n_embd=32, n_head=4,
                                                         vocab_size=100, bos_token_id=1,
                                                         eos_token_id=2)),
        "opt": lambda: hf.OPTForCausalLM(hf.OPTConfig(**dims, ffn_dim=64, word_embed_proj_dim=32,
                                                      max_position_embeddings=64,
                                                      pad_token_id=0)),
        "phi3": lambda: hf.Phi3ForCausalLM(hf.Phi3Config(**gqa, pad_token_id=0, eos_token_id=2,
                                                         bos_token_id=1)),
        "falcon": lambda: hf.FalconForCausalLM(hf.FalconConfig(**dims, alibi=True)),
    }
    return made[arch]().eval()


# What each fast one covers: absolute positions (GPT-2), positions from the mask's cumulative
# sum (OPT), ALiBi (Falcon), a mix of sliding-window and global layers (Gemma2).
FAST_ARCHS = ["gpt2", "opt", "falcon", "gemma2"]
ARCHS = [pytest.param(arch, stages, marks=() if arch in FAST_ARCHS and stages == 2
                      else pytest.mark.slow)
         for stages in (2, 4)
         for arch in ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt2", "opt", "phi3",
                      "falcon"]]


@pytest.mark.parametrize("arch,stages", ARCHS)
def test_greedy_tokens_equal_model_generate_for_each_architecture(arch, stages, scripted):
    """A left-padded batch on `stages` stages, 2 lanes; sequence 1 meets its eos early; 15
    tokens in all, three windows of a sliding layer."""
    model = tiny(arch, layers=stages)
    ids, mask = prompts(4, 5, [2, 0, 3, 0], seed=stages, vocab=100)
    with fxpipe.compile(model, ["cpu"] * stages, example_kwargs=dict(input_ids=ids,
                                                                    attention_mask=mask),
                        chunks=2, **FAST) as pipe:
        plan_generation(pipe, rows=4, prompt=5, length=15, lanes=2, **FAST)
        free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10,
                              do_sample=False, pad_token_id=0)
        eos = int(free[1, ids.shape[1] + 2])            # sequence 1's third new token
        got, want = both(pipe, model, input_ids=ids, attention_mask=mask, max_new_tokens=10,
                         do_sample=False, eos_token_id=eos)
        assert (want.sequences[1, ids.shape[1] + 3:] == 0).all()      # it ended early
        assert_same_tokens(got, want, ids.shape[1])
