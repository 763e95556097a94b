"""Generation: `pipe.generate` on 2 CPU stages beside `model.generate`, side by side in one run.

    python -m benchmarks.generate [--rows 256] [--prompt 16] [--new 16] [--width 1024]
                                  [--layers 4] [--lanes 2] [--long 2048] [--chunk 256]
                                  [--only decode|first]

A Llama built from a config (no download), greedy, a batch of `--rows` prompts (every other one
left-padded by a quarter), `--new` new tokens each. Side by side, from the same weights:

- `model.generate` on the whole batch with all cores' threads (the baseline) and with one;
- `pipe.generate` on 2 one-thread stages with one lane (the stages take each step one after
  another: what a split by `device_map` does) and with `--lanes` lanes that advance on their
  own (one Hugging Face loop per lane: stage 1 decodes lane 0 while stage 0 decodes lane 1);
- `pipe.generate` planned with `num_stages="auto"` (stages and lanes chosen, or the model as is
  where no pipeline is predicted to decode faster), against `model.generate` on all cores.

Each is timed twice, at `--new` tokens and at 1 (the prompt's prefill and the first token: time
to first token); decode tokens/s is the new tokens after the first over the time between the
two. Every pipeline's tokens are checked against the model's (id for id). Also printed: the
decode bubble (the share of the stages' time idle over the decode, from the generation's
`last_run`; with one lane, that of its last step), the decode tokens/s the generation plan
predicts, and each stage's key/value bytes, as predicted and as allocated; and the bound on
what lanes can gain over the one-lane split, T(N)/T(N/L): the model's decode step on N
sequences over one on N/L (one thread), measured in the same run.

Then the time to first token of one `--long`-token prompt: the model's, the 2-stage split's with
the whole prompt in one prefill step (the stages one after another), and fxpipe's with the
prompt prefilled in chunks of `--chunk` tokens fed at once (stage 1 runs chunk c while stage 0
runs chunk c + 1), against the bound of C chunks on 2 stages: (C + 1) / (2C) of the split's
time. Run it alone: two cores are easily shared into noise.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
from tabulate import tabulate
from transformers import LlamaConfig, LlamaForCausalLM

import fxpipe
from fxpipe.generate import plan_generation
from fxpipe.runtime.lanes import bubble


def timed(generate, ids, mask, new: int, threads: int | None = None) -> tuple[float, torch.Tensor]:
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        out = generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                       pad_token_id=0, eos_token_id=None)
        return time.perf_counter() - start, out
    finally:
        torch.set_num_threads(before)


def step_time(model, rows: int, context: int, repeats: int = 20) -> float:
    """Seconds of one decode step (one token against `context` cached ones) of `rows`
    sequences, on one thread: the least of `repeats`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ids = torch.randint(1, model.config.vocab_size, (rows, context + 1))
        out = model(input_ids=ids[:, :-1], use_cache=True)
        best = float("inf")
        for _ in range(repeats):
            cache = copy.deepcopy(out.cache)
            start = time.perf_counter()
            model(input_ids=ids[:, -1:], cache=cache, use_cache=True)
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--long", type=int, default=2048, help="the long prompt's tokens")
    parser.add_argument("--chunk", type=int, default=256, help="its prefill chunk")
    parser.add_argument("--only", choices=["decode", "first"], help="one of the two tables")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs each")
    a = parser.parse_args()
    cores = os.cpu_count() or 1
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=a.layers, hidden_size=a.width, num_attention_heads=a.width // 64,
        num_key_value_heads=a.width // 128, intermediate_size=a.width * 4 // 1,
        vocab_size=4000)).eval()
    if a.only != "first":
        decode_table(model, a, cores)
    if a.only != "decode":
        first_token_table(model, a, cores)


def decode_table(model, a, cores: int) -> None:
    ids = torch.randint(1, 4000, (a.rows, a.prompt))
    mask = torch.ones_like(ids)
    mask[::2, :a.prompt // 4] = 0
    length = a.prompt + a.new

    def best(generate, threads=None, bubble=lambda: None):
        """(full run's s, first token's s, tokens, the full run's bubble), best of repeats."""
        runs = []
        for _ in range(a.repeats):
            full = timed(generate, ids, mask, a.new, threads)
            idle = bubble()
            runs.append((full, idle, timed(generate, ids, mask, 1, threads)))
        (full_s, out), idle, _ = min(runs, key=lambda r: r[0][0])
        first_s = min(r[2][0] for r in runs)
        return full_s, first_s, out, idle

    rows = []
    reference = split = None

    def report(name, full_s, first_s, out, idle, kv="", predicted=""):
        nonlocal reference, split
        if reference is None:
            reference = (full_s, first_s, out)
        same = "yes" if torch.equal(out, reference[2]) else "NO"
        decode_tps = a.rows * (a.new - 1) / max(full_s - first_s, 1e-9)
        if name.endswith("1 lane"):
            split = decode_tps
        rows.append([name, f"{a.rows * a.new / full_s:.0f}", f"{decode_tps:.1f}",
                     f"{decode_tps / split:.2f}x" if split else "", f"{first_s * 1e3:.0f}",
                     same, "" if idle is None else f"{idle:.1%}", predicted, kv])
        return decode_tps

    with torch.no_grad():
        timed(model.generate, ids, mask, 2, cores)         # warm up
        report(f"model.generate, {cores} threads", *best(model.generate, cores), None)
        report("model.generate, 1 thread", *best(model.generate, 1), None)
        gains = {}
        for lanes in (1, a.lanes):
            pipe = fxpipe.compile(model, ["cpu", "cpu"], example_kwargs=dict(
                input_ids=ids, attention_mask=mask), chunks=lanes, threads_per_stage=1)
            with pipe:
                generation = plan_generation(pipe, rows=a.rows, prompt=a.prompt,
                                             length=length, lanes=lanes)
                with generation.session():
                    allocated = [sum(t.numel() * t.element_size() for t in s.tensors.values())
                                 for s in generation.states]
                kv = ", ".join(f"{p / 2**20:.1f}/{q / 2**20:.1f}"
                               for p, q in zip(generation.kv_predicted, allocated))
                predicted = f"{generation.tokens_per_s():.0f}"
                runtime = generation.runtimes[id(generation.decode)]
                full_s, first_s, out, idle = best(
                    pipe.generate, bubble=lambda: bubble(runtime.last_run))
                gains[lanes] = report(
                    f"pipe.generate, 2 stages, {lanes} lane{'s' * (lanes > 1)}", full_s,
                    first_s, out, idle, kv=kv, predicted=predicted)
        pipe = fxpipe.compile(model, ["cpu", "cpu"], example_kwargs=dict(
            input_ids=ids, attention_mask=mask), chunks=a.lanes, threads_per_stage=1)
        with pipe:
            generation = plan_generation(pipe, rows=a.rows, prompt=a.prompt, length=length,
                                         num_stages="auto")
            chose = ("the model as is" if generation.as_is else
                     f"{len(generation.decode.stages)} stages x {generation.lanes} lanes")
            predicted = "" if generation.as_is else f"{generation.tokens_per_s():.0f}"
            full_s, first_s, out, idle = best(pipe.generate)
            report(f"pipe.generate, num_stages='auto' ({chose})", full_s, first_s, out, idle,
                   predicted=predicted)
            auto = reference[0] / full_s
        bound = (step_time(model, a.rows, length) /
                 step_time(model, a.rows // a.lanes, length))
    print(f"Llama d={a.width}, {a.layers} layers, {a.rows} prompts of {a.prompt} tokens "
          f"(half left-padded by {a.prompt // 4}), {a.new} new tokens, greedy; best of "
          f"{a.repeats}; {cores} cores")
    print(tabulate(rows, headers=["", "tokens/s", "decode tokens/s", "decode vs 1-lane split",
                                  "first token ms", "tokens equal", "decode bubble",
                                  "plan's decode tokens/s",
                                  "KV MiB per stage predicted/allocated"]))
    gain = gains[a.lanes] / gains[1]
    print(f"bound: a decode step of the model on {a.rows} sequences over one on "
          f"{a.rows // a.lanes} (one thread, {length} cached tokens): T(N)/T(N/{a.lanes}) = "
          f"{bound:.2f}; {a.lanes} lanes gained {gain:.2f}x over 1 lane, {gain / bound:.2f} of "
          f"the bound (goal >= 0.85)")
    print(f"num_stages='auto' ({chose}): {auto:.2f}x model.generate on {cores} threads "
          f"(goal >= 0.95)")


def first_token_table(model, a, cores: int) -> None:
    """The time to first token of one `--long`-token prompt (see the module)."""
    ids = torch.randint(1, 4000, (1, a.long))
    mask = torch.ones_like(ids)
    chunks = a.long // a.chunk
    rows, reference, split = [], None, None

    def best(generate, threads=None) -> tuple[float, torch.Tensor]:
        runs = [timed(generate, ids, mask, 1, threads) for _ in range(a.repeats)]
        return min(runs, key=lambda r: r[0])

    def report(name, seconds, out):
        nonlocal reference
        reference = out if reference is None else reference
        rows.append([name, f"{seconds * 1e3:.0f}", f"{split / seconds:.2f}x" if split else "",
                     "yes" if torch.equal(out, reference) else "NO"])

    with torch.no_grad():
        timed(model.generate, ids, mask, 1, cores)         # warm up
        report(f"model.generate, {cores} threads", *best(model.generate, cores))
        report("model.generate, 1 thread", *best(model.generate, 1))
        pipe = fxpipe.compile(model, ["cpu", "cpu"], example_kwargs=dict(
            input_ids=ids[:, :a.chunk], attention_mask=mask[:, :a.chunk]), chunks=1,
            threads_per_stage=1)
        with pipe:
            for prompt, name in ((a.long, "the whole prompt in one step"),
                                 (a.chunk, f"{chunks} chunks of {a.chunk}, overlapped")):
                plan_generation(pipe, rows=1, prompt=prompt, length=a.long + 1, lanes=1)
                seconds, out = best(pipe.generate)
                split = split or seconds
                report(f"pipe.generate, 2 stages, {name}", seconds, out)
    print(f"\nfirst token of one prompt of {a.long} tokens; best of {a.repeats}")
    print(tabulate(rows, headers=["", "first token ms", "vs the split's whole prompt",
                                  "tokens equal"]))
    gain = float(rows[-1][2].rstrip("x"))
    bound = 2 * chunks / (chunks + 1)
    print(f"bound on 2 stages with {chunks} chunks: {bound:.2f}x; the chunks gained "
          f"{gain:.2f}x (goal >= 1.5x)")


if __name__ == "__main__":
    main()
