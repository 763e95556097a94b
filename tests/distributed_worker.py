"""One rank of a test run of `fxpipe.distributed`, started by torchrun from test_distributed.py.

    python -m torch.distributed.run --nproc-per-node N distributed_worker.py PLAN DATA OUT [MODE]

Loads its stage of the plan at PLAN, runs a call and one `train_step` on the batch saved in DATA
(x, target; with replicas, each replica its own contiguous shard of the rows), and saves what it
got to OUT/rank<r>.pt: the output and loss (last stage), its stage's gradients by name. An
FxpipeError is written to OUT/rank<r>.err instead, and the rank exits 0 (so torchrun lets the
other ranks write theirs). MODE makes rank 1 fail on purpose:

    raise1   rank 1's stage raises in its first forward (its module's forward replaced)
    kill1    rank 1 (the last stage) exits with status 1 while computing its first loss, mid
             `train_step`; every other rank ignores SIGTERM so that torchrun, tearing the
             group down, cannot kill it before it writes what it met
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fxpipe
import fxpipe.distributed


def main(plan: str, data: str, out: str, mode: str = "run") -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if mode == "kill1" and rank != 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    x, target = torch.load(data).values()
    try:
        stage = fxpipe.distributed.load(plan, timeout=float(os.environ.get("FXPIPE_TIMEOUT", 30)))
    except fxpipe.FxpipeError as e:
        Path(out, f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}")
        return
    with stage:     # closed however the step ends: a failed rank's peers are told first
        x, target = (t.chunk(stage.replicas)[stage.replica] for t in (x, target))
        if mode == "raise1" and rank == 1:
            stage.module.forward = _fail
        loss_fn = _exit_now if mode == "kill1" and rank == 1 else F.mse_loss
        try:
            with torch.no_grad():
                output = stage(x if stage.index == 0 else None)
            loss = stage.train_step(x if stage.index == 0 else None,
                                    target if stage.index == stage.last else None, loss_fn)
        except fxpipe.FxpipeError as e:
            Path(out, f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}")
            if isinstance(e, fxpipe.distributed.DistributedError):
                # Told of another rank's failure: a send to it may still be blocked in gloo;
                # ending the process now spares the interpreter's exit from tearing the process
                # group down under it. (The failed rank itself closes, so its news is taken.)
                os._exit(0)
            return
        grads = {name: p.grad for name, p in stage.named_parameters()}
    torch.save({"output": output, "loss": loss, "grads": grads}, Path(out, f"rank{rank}.pt"))

def _fail(*values):
    raise RuntimeError("the test's stage fails here")


def _exit_now(output, target):
    os._exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:5])
