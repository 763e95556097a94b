"""Generation under torchrun: a saved generation on 2 gloo ranks (`fxpipe.generate_ranks`)
beside the same generation in one process and `model.generate`, in one run.

    python -m benchmarks.generate_torchrun [--rows 64] [--prompt 16] [--new 16] [--width 1024]
                                           [--layers 4] [--lanes 2]

A Llama built from a config (no download), greedy, a batch of `--rows` prompts (every other one
left-padded by a quarter), `--new` new tokens each. The generation is planned for 2 one-thread
CPU stages and `--lanes` lanes, and saved. Timed, each at `--new` tokens and at 1 (the prompt
and the first token), after one untimed generate:

- `model.generate` on the whole batch with all cores' threads (the baseline) and with one;
- the saved generation loaded in this process (`load_generation`: lanes that advance on their
  own, one thread per stage);
- the same saved generation on 2 torchrun ranks, one thread each (lanes in step: one loop on
  rank 0, each step broadcast, the logits sent back), timed on rank 0.

Decode tokens/s is the new tokens after the first over the time between the two runs. The
tokens of both generations are checked against the model's (id for id). The processes run one
after another (torchrun's ranks cannot interleave with this process's runs), so run it alone:
two cores are easily shared into noise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate
from transformers import LlamaConfig, LlamaForCausalLM

from fxpipe.generate import load_generation, plan_generation, save_generation


def timed(generate, ids, mask, new: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                   pad_token_id=0, eos_token_id=None)
    return time.perf_counter() - start, out


def both(generate, ids, mask, new: int) -> tuple[float, float, torch.Tensor | None]:
    """One untimed generate, then the times of `new` tokens and of 1, and the tokens."""
    timed(generate, ids, mask, new)
    whole, out = timed(generate, ids, mask, new)
    first, _ = timed(generate, ids, mask, 1)
    return whole, first, out


def rank_main(saved: str, data: str, out: str) -> None:
    """One torchrun rank: rank 0 saves its times and tokens to `out`."""
    torch.set_num_threads(1)
    import fxpipe.generate_ranks
    batch = torch.load(data)
    with fxpipe.generate_ranks.load_generation(saved, timeout=120) as generation:
        whole, first, tokens = both(generation.generate, batch["ids"], batch["mask"],
                                    batch["new"])
        if generation.rank == 0:
            torch.save(dict(whole=whole, first=first, tokens=tokens), out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lanes", type=int, default=2)
    options = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=options.layers, hidden_size=options.width,
                         num_attention_heads=options.width // 64,
                         num_key_value_heads=options.width // 128,
                         intermediate_size=2 * options.width, vocab_size=4000)
    model = LlamaForCausalLM(config).eval()
    rows, q, new = options.rows, options.prompt, options.new
    ids = torch.randint(1, 4000, (rows, q))
    mask = torch.ones_like(ids)
    mask[::2, :q // 4] = 0
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        generation = plan_generation(model, ["cpu", "cpu"], rows=rows, prompt=q,
                                     length=q + new, lanes=options.lanes, threads_per_stage=1,
                                     link="gloo")
        save_generation(generation, Path(tmp, "gen"))
        generation.close()
        cores = torch.get_num_threads()
        results[f"model.generate, {cores} threads"] = both(model.generate, ids, mask, new)
        torch.set_num_threads(1)
        results["model.generate, 1 thread"] = both(model.generate, ids, mask, new)
        torch.set_num_threads(cores)
        loaded = load_generation(Path(tmp, "gen"))
        try:
            results[f"one process, {options.lanes} lanes on their own"] = both(
                loaded.generate, ids, mask, new)
        finally:
            loaded.close()
        torch.save(dict(ids=ids, mask=mask, new=new), Path(tmp, "data.pt"))
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", "29517", __file__,
                   "--rank", str(Path(tmp, "gen")), str(Path(tmp, "data.pt")),
                   str(Path(tmp, "ranks.pt"))]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       cwd=Path(__file__).resolve().parents[1])
        ran = torch.load(Path(tmp, "ranks.pt"))
        results[f"torchrun, 2 ranks, {options.lanes} lanes in step"] = (
            ran["whole"], ran["first"], ran["tokens"])
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    want = results[f"model.generate, {cores} threads"][2]
    base = rows * (new - 1) / (results[f"model.generate, {cores} threads"][0] -
                        results[f"model.generate, {cores} threads"][1])
    table = []
    for name, (whole, first, tokens) in results.items():
        decode = rows * (new - 1) / (whole - first)
        table.append((name, decode, decode / base, first * 1e3, torch.equal(tokens, want)))
    print(f"{rows} sequences, prompt {q}, {new} new tokens, Llama d={options.width} "
          f"x {options.layers} layers")
    print(tabulate(table, headers=["run", "decode tokens/s", "x model", "first token ms",
                                   "tokens equal"], floatfmt=".2f"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(*sys.argv[2:5])
    else:
        main()
