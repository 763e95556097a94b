"""Generation: `pipe.generate` on 2 CPU stages beside `model.generate`, side by side in one run.

    python -m benchmarks.generate [--rows 8] [--prompt 32] [--new 32] [--width 512] [--layers 8]

A Llama built from a config (no download), greedy, a batch of `--rows` prompts (every other one
left-padded by a quarter), `--new` new tokens each. Side by side, from the same weights:

- `model.generate` on the whole batch with all cores' threads (the baseline) and with one;
- `pipe.generate` on 2 one-thread stages with one lane (the stages take each step one after
  another: what a split by `device_map` does) and with two lanes (stage 1 decodes lane 0
  while stage 0 decodes lane 1).

Each is timed twice, at `--new` tokens and at 1 (the prompt's prefill and the first token: time
to first token); decode tokens/s is the new tokens after the first over the time between the
two. Every pipeline's tokens are checked against the model's (id for id). Also printed: the
share of the last decode step's stage-time that no stage computed (`last_run`: the bubble of a
step, with Hugging Face's loop waiting for every lane at each token), the decode tokens/s the
generation plan predicts, and each stage's key/value bytes, as predicted and as allocated. Run it alone: two cores are easily shared
into noise.
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
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs each")
    a = parser.parse_args()
    cores = os.cpu_count() or 1
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=a.layers, hidden_size=a.width, num_attention_heads=a.width // 64,
        num_key_value_heads=a.width // 128, intermediate_size=a.width * 4 // 1,
        vocab_size=4000)).eval()
    ids = torch.randint(1, 4000, (a.rows, a.prompt))
    mask = torch.ones_like(ids)
    mask[::2, :a.prompt // 4] = 0
    length = a.prompt + a.new

    def best(generate, threads=None):
        runs = [(timed(generate, ids, mask, a.new, threads), timed(generate, ids, mask, 1, threads))
                for _ in range(a.repeats)]
        (full_s, out), _ = min(runs, key=lambda r: r[0][0])
        first_s = min(r[1][0] for r in runs)
        return full_s, first_s, out

    rows = []
    reference = None

    def bubble(run) -> str:
        """The share of the latest decode step's stage-time no stage computed."""
        if run is None or not run.slots or run.wall_s <= 0:
            return ""
        busy = sum(slot.end_s - slot.start_s for slot in run.slots)
        return f"{1 - busy / (run.num_stages * run.wall_s):.0%}"

    def report(name, full_s, first_s, out, kv="", idle="", predicted=""):
        nonlocal reference
        if reference is None:
            reference = (full_s, first_s, out)
        same = "yes" if torch.equal(out, reference[2]) else "NO"
        decode_tps = a.rows * (a.new - 1) / max(full_s - first_s, 1e-9)
        base_tps = a.rows * (a.new - 1) / max(reference[0] - reference[1], 1e-9)
        rows.append([name, f"{a.rows * a.new / full_s:.0f}", f"{decode_tps:.0f}",
                     f"{decode_tps / base_tps:.2f}x", f"{first_s * 1e3:.0f}",
                     f"{reference[1] / first_s:.2f}x", same, idle, predicted, kv])

    with torch.no_grad():
        report(f"model.generate, {cores} threads", *best(model.generate, cores))
        report("model.generate, 1 thread", *best(model.generate, 1))
        for lanes in (1, 2):
            pipe = fxpipe.compile(model, ["cpu", "cpu"], example_kwargs=dict(
                input_ids=ids, attention_mask=mask), chunks=lanes, threads_per_stage=1)
            with pipe:
                generation = plan_generation(pipe, rows=a.rows, prompt=a.prompt,
                                             length=length, lanes=lanes)
                with generation.session():
                    allocated = [sum(t.numel() * t.element_size() for t in s.tensors.values())
                                 for s in generation.states]
                kv = ", ".join(f"{p / 2**20:.2f}/{q / 2**20:.2f}"
                               for p, q in zip(generation.kv_predicted, allocated))
                predicted = f"{generation.tokens_per_s():.0f}"
                timings = best(pipe.generate)
                decode = generation.runtimes[id(generation.decode)].last_run
                report(f"pipe.generate, 2 stages, {lanes} lane{'s' * (lanes > 1)}", *timings,
                       kv=kv, idle=bubble(decode), predicted=predicted)
        bound = step_time(model, a.rows, length) / step_time(model, a.rows // 2, length)
    print(f"Llama d={a.width}, {a.layers} layers, {a.rows} prompts of {a.prompt} tokens "
          f"(half left-padded by {a.prompt // 4}), {a.new} new tokens, greedy; best of "
          f"{a.repeats}; {cores} cores")
    print(tabulate(rows, headers=["", "tokens/s", "decode tokens/s", "decode vs baseline",
                                  "first token ms", "first token vs baseline",
                                  "tokens equal", "decode step idle",
                                  "plan's decode tokens/s",
                                  "KV MiB per stage predicted/allocated"]))
    print(f"a decode step of the model on {a.rows} sequences over one on {a.rows // 2} (one "
          f"thread, {length} cached tokens): T(N)/T(N/2) = {bound:.2f}, the most 2 lanes can "
          f"gain over 1")


if __name__ == "__main__":
    main()
