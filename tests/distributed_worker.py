"""One rank of a test run of `fxpipe.distributed`, started by torchrun from test_distributed.py.

    python -m torch.distributed.run --nproc-per-node N distributed_worker.py PLAN DATA OUT [MODE]

Loads its stage of the plan at PLAN, runs a call and one `train_step` on the batch saved in DATA
(x, target; with replicas, each replica its own contiguous shard of the rows), and saves what it
got to OUT/rank<r>.pt: the output and loss (last stage), its stage's gradients by name. An
FxpipeError is written to OUT/rank<r>.err instead, and the rank exits 0 (so torchrun lets the
other ranks write theirs). MODE changes the step:

    inputgrad  stage 0's inputs are given with `requires_grad`; their gradient is saved too
    sum        the loss is a sum (`F.mse_loss(..., reduction="sum")`, `reduction="sum"`)
    twice      two train_steps, gradients not zeroed between them (the second loss saved)
    call       the call alone, no train_step (a plan made for inference)
    train      one SGD step (lr 0.1) after the train_step, then `stage.save_weights(OUT/saved)`
    memory     loads its stage and runs a call, measuring its peak resident memory growth
               (saved to OUT/rank<r>.memory.pt with its stage's bytes and the output)

or makes rank 1 fail on purpose:

    raise1   rank 1's stage raises in its first forward (its module's forward replaced)
    kill1    rank 1 (the last stage) exits with status 1 while computing its first loss, mid
             `train_step`; every other rank ignores SIGTERM so that torchrun, tearing the
             group down, cannot kill it before it writes what it met

With FXPIPE_WEIGHTS set, the stage's weights are read from that checkpoint (`load(weights=)`),
and with FXPIPE_MODEL (`module:Class`, imported from tests/) the model's structure, built on
meta, is given as `model=` (what `Init` draws non-persistent buffers from).
"""

import functools
import importlib
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
    model = None
    if "FXPIPE_MODEL" in os.environ:
        module, name = os.environ["FXPIPE_MODEL"].split(":")
        with torch.device("meta"):
            model = getattr(importlib.import_module(module), name)()
    options = {"timeout": float(os.environ.get("FXPIPE_TIMEOUT", 30)), "model": model,
               "weights": os.environ.get("FXPIPE_WEIGHTS")}
    try:
        if mode == "memory":
            loaded = _measured_load(plan, data, options, rank, out)
        stage = loaded if mode == "memory" else fxpipe.distributed.load(plan, **options)
    except fxpipe.FxpipeError as e:
        Path(out, f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}")
        return
    if mode == "memory":
        stage.close()
        return
    with stage:     # closed however the step ends: a failed rank's peers are told first
        x, target = (t.chunk(stage.replicas)[stage.replica] for t in (x, target))
        if mode == "inputgrad" and stage.index == 0:
            x = x.clone().requires_grad_()
        if mode == "raise1" and rank == 1:
            stage.module.forward = _fail
        loss_fn = _exit_now if mode == "kill1" and rank == 1 else F.mse_loss
        reduction = "sum" if mode == "sum" else "mean"
        if mode == "sum":
            loss_fn = functools.partial(F.mse_loss, reduction="sum")
        if mode == "positives":
            loss_fn = positive_targets_plain_mean
        if mode == "count":
            loss_fn = positive_targets_mean
            x = x.clone().requires_grad_() if stage.index == 0 else x
        try:
            with torch.no_grad():
                output = stage(x if stage.index == 0 else None)
            loss = None
            for _ in range(0 if mode == "call" else 2 if mode == "twice" else 1):
                loss = stage.train_step(x if stage.index == 0 else None,
                                        target if stage.index == stage.last else None, loss_fn,
                                        reduction=reduction)
            if mode == "train":
                grads = {name: p.grad.clone() for name, p in stage.named_parameters()}
                torch.optim.SGD(stage.parameters(), lr=0.1).step()
                stage.save_weights(Path(out, "saved"))
        except fxpipe.FxpipeError as e:
            Path(out, f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}")
            return
        if mode != "train":
            grads = {name: p.grad for name, p in stage.named_parameters()}
    run = stage.last_run
    torch.save({"output": output, "loss": loss, "grads": grads, "x_grad": x.grad,
                "run": ([(s.action.stage, s.action.microbatch, s.action.phase.name, s.start_s,
                          s.end_s) for s in run.slots], run.wall_s, run.error)},
               Path(out, f"rank{rank}.pt"))


def _measured_load(plan, data, options, rank, out):
    """This rank's stage, loaded and called on DATA's x while its peak resident memory growth
    is measured (freed memory returned to the system at once); saved to OUT/rank<r>.memory.pt
    with the bytes of the stage's tensors and the call's output."""
    from fxpipe.testing.memory import peak_bytes, return_freed_memory
    return_freed_memory()
    x, _ = torch.load(Path(data)).values()
    loaded, outputs = [], []

    def load_and_call():
        loaded.append(fxpipe.distributed.load(plan, **options))
        with torch.no_grad():      # reading a checkpoint may map it lazily: use the weights
            outputs.append(loaded[0](x if loaded[0].index == 0 else None))
    peak = peak_bytes(load_and_call)
    stage = loaded[0]
    held = {id(t): t.numel() * t.element_size()
            for t in [*stage.module.parameters(), *stage.module.buffers()]}
    torch.save({"peak": peak, "stage_bytes": sum(held.values()), "output": outputs[0]},
               Path(out, f"rank{rank}.memory.pt"))
    return stage


def positive_targets_mean(output, target):
    """A loss averaged over the positive targets only, as (loss_sum, count)."""
    kept = target > 0
    return F.mse_loss(output[kept], target[kept], reduction="sum"), kept.sum()


def positive_targets_plain_mean(output, target):
    """A loss averaged over the positive targets only, as a plain mean: not a mean over rows."""
    kept = target > 0
    return F.mse_loss(output[kept], target[kept])


def _fail(*values):
    raise RuntimeError("the test's stage fails here")


def _exit_now(output, target):
    os._exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:5])
