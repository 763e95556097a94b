"""One rank of a test of generation under torchrun, started by test_generate_torchrun.py.

    python -m torch.distributed.run --nproc-per-node N generate_worker.py DATA OUT SAVED...

For each generation saved (`save_generation`) at SAVED, in turn: loads this rank's stages
(`fxpipe.generate_ranks.load_generation`) and generates on the prompts in DATA (`input_ids`,
`attention_mask`, and `kwargs` for every generate): greedy; one asking for more tokens than
planned (refused on rank 0, the others told); greedy again (nothing of the first two is left);
sampled after `torch.manual_seed(7)`; one of a single token (its prompt's micro-batches
counted); one where rank 1's decode stage raises; one more after
it (refused: the stages are closed). Rank 0 saves its results to OUT/<i>.pt (i: the SAVED's
place); every rank writes what each generate raised (its type and first line, "" for none)
and whether its caches were freed after each to OUT/<i>.rank<r>.txt.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fxpipe.generate_ranks import load_generation


def main(data: str, out: str, *saved: str) -> None:
    torch.set_num_threads(1)
    batch = torch.load(data)
    dist.init_process_group("gloo")      # one group for every load (see fxpipe.generate_ranks)
    prompts = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    for i, path in enumerate(saved):
        results, notes = {}, []
        with load_generation(path, timeout=30) as generation:
            notes.append(f"prefill_by_tokens {generation.prefill_by_tokens}")
            notes.append(str(generation).rsplit("; ", 1)[1])
            for name, extra in [("greedy", {}), ("over", {"max_new_tokens": 40}),
                                ("again", {}), ("sampled", {"do_sample": True}),
                                ("first", {"max_new_tokens": 1}),
                                ("broken", {}), ("after", {})]:
                if name == "sampled":
                    torch.manual_seed(7)
                if name == "broken" and generation.rank == 1:
                    generation.stages[1].module.forward = _fail
                try:
                    results[name] = generation.generate(**prompts,
                                                        **dict(batch["kwargs"], **extra))
                    raised = ""
                except Exception as e:       # noqa: BLE001 - written for the test to read
                    raised = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                freed = not generation.state.tensors and all(
                    b.numel() == 0 for n, b in generation.stages[1].module.named_buffers()
                    if n.startswith("kv_"))
                notes.append(f"{name} raised {raised!r} freed {freed}")
                if name == "first":      # the prompt's micro-batches, fed in one call
                    prefilled = generation.stages[1 if generation.prefill_by_tokens else 2]
                    notes.append(f"prompt in {prefilled.last_run.microbatches} micro-batches")
            rank = generation.rank
        if rank == 0:
            torch.save(results, Path(out, f"{i}.pt"))
        Path(out, f"{i}.rank{rank}.txt").write_text("\n".join(notes) + "\n")
    dist.destroy_process_group()


def _fail(*values):
    raise RuntimeError("the test's stage fails here")


if __name__ == "__main__":
    main(*sys.argv[1:])
