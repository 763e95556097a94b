"""Random numbers in a pipeline: one seed per micro-batch, drawn from the caller's generator.

Stages run on their own threads, and torch's default generators are shared by every thread, so
dropout drawn "from the global generator" would depend on which stage ran first. fxpipe fixes the
order instead: each call draws one base seed from the caller's default CPU generator (so
`torch.manual_seed(s)` before the call fixes its result, and consecutive calls differ), and
micro-batch `m` runs as if `torch.manual_seed(seeds[m])` had been called just before the model ran
on that micro-batch alone. That is the contract the runtime keeps and the reference runs check.
"""

from __future__ import annotations

import torch

_SEED_RANGE = 2 ** 62


def microbatch_seeds(chunks: int) -> list[int]:
    """The seeds of one call's `chunks` micro-batches; advances the caller's CPU generator once."""
    base = int(torch.randint(0, _SEED_RANGE, (), dtype=torch.int64))
    return [(base + m) % _SEED_RANGE for m in range(chunks)]
