"""One rank of a test run of `fxpipe.distributed`, started by torchrun from test_distributed.py.

    python -m torch.distributed.run --nproc-per-node N distributed_worker.py PLAN DATA OUT

Loads its stage of the plan at PLAN, runs a call and one `train_step` on the batch saved in DATA
(x, target), and saves what it got to OUT/rank<r>.pt: the output and loss (last rank), its
stage's gradients by name. An FxpipeError is written to OUT/rank<r>.err instead.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fxpipe
import fxpipe.distributed


def main(plan: str, data: str, out: str) -> None:
    torch.set_num_threads(1)
    rank = int(__import__("os").environ["RANK"])
    x, target = torch.load(data).values()
    try:
        stage = fxpipe.distributed.load(plan, timeout=30)
    except fxpipe.FxpipeError as e:
        Path(out, f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}")
        return
    with torch.no_grad():
        output = stage(x if rank == 0 else None)
    loss = stage.train_step(x if rank == 0 else None, target if rank == stage.last else None,
                            F.mse_loss)
    grads = {name: p.grad for name, p in stage.named_parameters()}
    stage.close()
    torch.save({"output": output, "loss": loss, "grads": grads}, Path(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
