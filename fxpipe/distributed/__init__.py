"""Run a saved plan on `torch.distributed`: one process per stage and replica, started by torchrun.

    # run.py, launched with: torchrun --nproc-per-node 2 run.py   (or 4: two replicas)
    stage = fxpipe.distributed.load("plans/model-2")    # rank r runs stage r % 2, its weights only
    y = stage(x if stage.index == 0 else None)          # the model's output on the last stage
    loss = stage.train_step(x, target, loss_fn)         # x on stage 0, target on the last stage

Replicas: a world of `replicas x stages` ranks runs `replicas` copies of the pipeline; rank r
runs stage `r % stages` of replica `r // stages` (replica k is ranks k*stages .. k*stages +
stages - 1), each replica on the inputs given to its own stage 0 (its shard of the batch; shards
may differ in size). A `train_step` is the whole batch's: each replica weights its loss by its
share of the rows (with a mean loss; a sum is a sum), so that after the step each stage's
replicas add up their gradients (one all-reduce over a gloo group of that stage's ranks) and
every rank holds the whole batch's gradients, and every last stage returns the whole batch's
loss.

Placement: a plan's devices are those of the host it was planned on. Each rank loads its stage
on `load(path, device=...)`, by default (`rank_device`) a stage planned on a GPU on the rank's
own GPU, `cuda:LOCAL_RANK` under torchrun, made the current device, so that replicas on one host
do not share GPUs; a stage planned on the CPU stays there.

Tied weights: a parameter several stages hold (an embedding the output layer reads again) is
loaded by each of their ranks, and each one's backward gives it only its stage's part. The saved
plan's `shared` entries say which stages hold which; `load` makes a gloo group of the ranks
holding them in each replica (every rank makes every group, in one order), and after the
backward each holder's gradient is summed over its group, before the replicas add theirs up.
Each holder then has the model's gradient, and the same optimizer step keeps the copies equal.

The flow, in each replica: its stage-0 rank is also the driver: it splits the inputs into the
plan's micro-batches and sends each stage the graph inputs it reads. Every rank walks its own
stage's row of the timetable (the same `StageRow` the thread runtime walks, so messages follow
the same order; `schedules.message_orders` lists them per pair of ranks), GPipe for a call and
the plan's schedule for `train_step`. Graph outputs go to the last rank, which returns the model's
output (a call) or computes the loss (`train_step`); every other rank returns None. Gradients
are left in each rank's stage parameters' `.grad`, named as in the model. A graph input given to
`train_step` with `requires_grad` gets its gradient on stage 0's rank: the stages on other ranks
reading it send back its gradients once their backwards are done. A `loss_fn` returning
`(loss_sum, count)` gives the mean over every replica's counts (one all-reduce per step tells
every rank the whole count, by which this step's gradients are scaled). `stage.last_run` is
this rank's row of the latest step, timed on its own clock (a `Run`, as `pipe.last_run`).


Failures end every rank: a stage that raises gives its rank a `StageError` naming the rank and
stage, and it sends every peer an abort header behind what it sent before; a rank receiving one
raises `PeerFailedError` (a `DistributedError`) naming the rank that failed first, and tells
every peer in turn. A rank that finished its row still hears it: the step ends with a "done"
header from every peer to every peer, read in order behind their messages. A peer that dies is
met as a closed connection or a timeout, naming it. A rank that cannot load its stage
(`PlanFileError`) makes the others raise a `DistributedError` naming it. A failed step leaves
the stage unusable: close it (`with` does), which reads each peer's messages up to its news of
the failure, so every rank's sends are taken and every rank ends without waiting for a timeout,
and start again.

A plan balances and predicts with what it was told values cost: plan for a run here with
`link="gloo"` (`measure_link`), or `load` warns on rank 0.

Transport: headers go over gloo; tensors over gloo too, or, where the caller started the
default process group with NCCL (every rank's stage on a GPU), over NCCL, from GPU to GPU
without a copy through the CPU.

Weights: `load(path, weights="ckpt/")` reads this rank's stage's tensors only from a
checkpoint (or draws them, "init"), straight to its device, after checking that its planned
memory fits the device; `stage.save_weights(dir)` writes them back, each rank its own shard.

Not in this slice: gradients across ranks in a call (`stage(x)`: each rank's autograd graph
ends at what it received; `train_step` is the way to gradients).

The package stands beside `fxpipe.pipeline`, on the same `fxpipe.runtime`: `launch` (the process
groups, loading this rank's stage), `transport` (`DistributedTransport`, the runtime's
`Transport` between processes) and `stage` (`DistributedStage`: this rank's row of a step, with
the train-step contract of `runtime.step`) and `link` (`measure_link`: a message between two
ranks, the link a plan for torchrun is priced with).
"""

from .link import measure_link
from .launch import WorldSizeError, load, rank_device
from .stage import DistributedStage
from .transport import DistributedError, DistributedTransport, PeerFailedError

__all__ = ["DistributedError", "DistributedStage", "DistributedTransport", "PeerFailedError",
           "WorldSizeError", "load", "measure_link", "rank_device"]
