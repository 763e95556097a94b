"""One rank of a test run of `fxpipe.torch_pipelining`, started by torchrun from
test_torch_pipelining.py.

    python -m torch.distributed.run --nproc-per-node N pipelining_worker.py PLAN DATA OUT SCHEDULE

Builds this rank's PipelineStages of the chain plan at PLAN, runs torch's SCHEDULE (a class of
torch.distributed.pipelining) for one training step on the batch in DATA (x, target), and saves
the losses (last stage's rank) and every stage's gradients by the model's names to OUT/rank<r>.pt.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.nn.functional as F

import fxpipe.torch_pipelining


def main(plan: str, data: str, out: str, schedule_name: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        x, target = torch.load(data).values()
        stages = fxpipe.torch_pipelining.pipeline_stages(plan)
        schedule_class = getattr(pipelining, schedule_name)
        looped = len(stages) > 1 or schedule_name.startswith("ScheduleInterleaved")
        # torch's schedules scale the gradients by 1 / n_microbatches themselves.
        schedule = schedule_class(stages if looped else stages[0], n_microbatches=4,
                                  loss_fn=F.mse_loss)
        holds_first = any(s.is_first for s in stages)
        holds_last = any(s.is_last for s in stages)
        losses = [] if holds_last else None
        args = (x,) if holds_first else ()
        schedule.step(*args, target=target if holds_last else None, losses=losses)
        grads = {name: p.grad for s in stages for name, p in s.submod.stage.named_parameters()}
        torch.save({"losses": losses, "grads": grads}, Path(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
