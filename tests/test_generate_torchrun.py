"""Generation under torchrun (`fxpipe.generate_ranks`): a saved generation's stages on gloo
ranks, rank 0 running Hugging Face's loop, equal to `model.generate`."""

from __future__ import annotations

import torch

from fxpipe.generate import plan_generation, save_generation
from transformers import LlamaConfig, LlamaForCausalLM

from test_distributed import torchrun
from test_generate import FAST, LLAMA, assert_same_tokens, prompts, scripted  # noqa: F401

WORKER = "tests/generate_worker.py"


def test_a_saved_generation_generates_the_models_tokens_under_torchrun(scripted, tmp_path):
    """Two ranks, 2 lanes, a left-padded batch whose sequence 1 meets its eos early: with the
    prefill plan (prompts 3 tokens a chunk) and without one (prompts through the decode plan,
    a token a chunk); every chunk of every lane fed in one call (2 x 2, 6 x 2). Greedy tokens
    equal `model.generate`'s, twice, around a generate over the planned length (refused on rank
    0, the other rank told, both ready after it); samples after a seed equal `model.generate`'s
    after the same seed; a stage failing ends the generate on both ranks (named), and the next
    is refused; every rank's caches freed after each."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    ids, mask = prompts(4, 6, [2, 0, 3, 0])
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    kwargs = dict(max_new_tokens=8, pad_token_id=0, eos_token_id=int(free[1, 6 + 2]),
                  do_sample=False)
    torch.save(dict(input_ids=ids, attention_mask=mask, kwargs=kwargs), tmp_path / "data.pt")
    saved = []
    for prompt in (3, 1):
        generation = plan_generation(model, ["cpu", "cpu"], rows=4, prompt=prompt, length=16,
                                     lanes=2, **FAST)
        saved.append(str(save_generation(generation, tmp_path / f"gen{prompt}")))
        generation.close()
    out = tmp_path / "out"
    out.mkdir()
    code, text = torchrun([WORKER, str(tmp_path / "data.pt"), str(out), *saved], 2,
                          timeout_s=120)
    assert code == 0, text[-3000:]

    want = model.generate(input_ids=ids, attention_mask=mask, **kwargs,
                          return_dict_in_generate=True, output_logits=True)
    torch.manual_seed(7)
    sampled = model.generate(input_ids=ids, attention_mask=mask, **dict(kwargs, do_sample=True))
    broken = ["PeerFailedError: rank 1 failed: rank 1: stage 1 failed on micro-batch 0 (forward)",
              "StageError: rank 1: stage 1 failed on micro-batch 0 (forward)"]
    after = [f"DistributedError: rank {r}'s stages failed in an earlier generate" for r in (0, 1)]
    for i, by_tokens in enumerate((False, True)):
        got = torch.load(out / f"{i}.pt")
        assert_same_tokens(got["greedy"], want, 6)
        assert_same_tokens(got["again"], want, 6)
        assert torch.equal(got["sampled"], sampled)
        for rank, told in [(0, "GenerationError: 4 x 46 slots, over the 4 x 16 planned"),
                           (1, "DistributedError: rank 0's generate failed, so rank 1 stops "
                               "too")]:
            notes = (out / f"{i}.rank{rank}.txt").read_text().splitlines()
            assert notes == [f"prefill_by_tokens {by_tokens}",
                             "prompts through the decode plan, a token a chunk" if by_tokens
                             else "prompts prefilled 3 tokens at a time",
                             "greedy raised '' freed True",
                             f"over raised {told!r} freed True",
                             "again raised '' freed True",
                             "sampled raised '' freed True",
                             "first raised '' freed True",
                             f"prompt in {12 if by_tokens else 4} micro-batches",
                             f"broken raised {broken[rank]!r} freed True",
                             f"after raised {after[rank]!r} freed True"], (rank, notes)


def test_prompts_run_through_the_decode_plan_where_the_two_plans_split_the_layers_apart():
    """A rank holds one stage of each plan, so the prefill plan serves only where each of its
    stages holds the same layers' caches as the decode stage of its index."""
    from types import SimpleNamespace
    from torch import nn
    from fxpipe.generate_ranks import same_caches

    def plan(*layers):
        stages = []
        for held in layers:
            module = nn.Module()
            for layer in held:
                module.register_buffer(f"kv_keys_{layer}", torch.empty(0))
                module.register_buffer(f"kv_values_{layer}", torch.empty(0))
            module.register_buffer("inv_freq", torch.empty(0))
            stages.append(SimpleNamespace(module=module))
        return SimpleNamespace(stages=stages)
    assert same_caches(plan([0, 1], [2, 3]), plan([0, 1], [2, 3]))
    assert not same_caches(plan([0, 1], [2, 3]), plan([0], [1, 2, 3]))
