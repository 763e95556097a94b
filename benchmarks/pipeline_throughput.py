"""Pipeline throughput on this CPU: fxpipe against one thread, the GPipe bound and
torch.distributed.pipelining, for inference and training, with the cost model's prediction.

    python benchmarks/pipeline_throughput.py [--channels 48] [--batch 64] [--repeats 5]

A chain of 8 Conv2d+ReLU layers (32x32 images) whose forward takes ~100-200 ms on one thread,
split into 2 stages of one thread each. Speed-ups are samples/s relative to the same model run
sequentially on one thread, all measured in this one run: on the whole batch ("x seq"), and on the
same micro-batches one after the other ("x seq-mb"), which separates the pipeline's overlap from
the change in per-sample speed that smaller batches bring. The ideal GPipe bound for k stages and
m micro-batches is k*m/(m+k-1); "% of ideal" is the x seq-mb speed-up over it.
torch.distributed.pipelining runs the same split (the one fxpipe chose) in 2 gloo processes with
ScheduleGPipe. Run it alone: two cores are easily shared into noise.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fxpipe  # noqa: E402

STAGES = 2


def build(channels: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, channels, 3, padding=1), nn.ReLU()]
    for _ in range(7):
        layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers)


def median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_pipelining_worker(rank, channels, split, x, target, chunks, repeats, port, results):
    """One process of torch.distributed.pipelining: stage `rank` of the same split."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    try:
        model = build(channels)
        part = model[:split] if rank == 0 else model[split:]
        stage = PipelineStage(part, rank, STAGES, torch.device("cpu"))
        infer = ScheduleGPipe(stage, n_microbatches=chunks)
        train = ScheduleGPipe(PipelineStage(part, rank, STAGES, torch.device("cpu")),
                              n_microbatches=chunks, loss_fn=F.mse_loss)

        def run_infer():
            with torch.no_grad():
                infer.eval(x) if rank == 0 else infer.eval()
            dist.barrier()

        def run_train():
            if rank == 0:
                train.step(x)
            else:
                train.step(target=target)
            dist.barrier()

        infer_s, train_s = median_s(run_infer, repeats), median_s(run_train, repeats)
        if rank == 0:
            results.put((infer_s, train_s))
    finally:
        dist.destroy_process_group()


def torch_pipelining(channels, split, x, target, chunks, repeats) -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(torch_pipelining_worker, args=(channels, split, x, target, chunks, repeats, port, results),
             nprocs=STAGES, join=True)
    return results.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", type=int, default=48)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--no-torch-pipelining", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    model = build(args.channels)
    x = torch.randn(args.batch, 3, 32, 32)
    target = torch.randn(args.batch, args.channels, 32, 32)

    with torch.no_grad():
        seq_infer_s = median_s(lambda: model(x), args.repeats)

    def seq_train():
        model.zero_grad()
        F.mse_loss(model(x), target).backward()
    seq_train_s = median_s(seq_train, args.repeats)
    print(f"sequential, 1 thread: inference {seq_infer_s * 1e3:.1f} ms, "
          f"training step {seq_train_s * 1e3:.1f} ms per batch of {args.batch}")

    rows = []
    for chunks in args.chunks:
        with torch.no_grad():
            seq_mb_s = median_s(lambda: [model(c) for c in x.tensor_split(chunks)], args.repeats)
        pipe = fxpipe.compile(model, ["cpu"] * STAGES, (x,), chunks=chunks, training=True,
                              threads_per_stage=1, verify=False)
        with torch.no_grad():
            infer_s = median_s(lambda: pipe(x), args.repeats)

        def train_step():
            model.zero_grad()
            pipe.train_step(x, target, F.mse_loss)
        train_s = median_s(train_step, args.repeats)
        predicted_infer_s = pipe.predict()[-1].end_s
        predicted_train_s = pipe.predict(training=True)[-1].end_s
        ideal = STAGES * chunks / (chunks + STAGES - 1)
        row = [chunks, ideal, seq_infer_s / infer_s, seq_mb_s / infer_s,
               seq_mb_s / infer_s / ideal * 100,
               predicted_infer_s * 1e3, infer_s * 1e3, (predicted_infer_s / infer_s - 1) * 100,
               seq_train_s / train_s, predicted_train_s * 1e3, train_s * 1e3,
               (predicted_train_s / train_s - 1) * 100]
        if not args.no_torch_pipelining:
            split = sum(1 for name, s in pipe.plan.partition.stage_of.items() if s == 0
                        and name.lstrip("_").isdigit())
            tp_infer_s, tp_train_s = torch_pipelining(args.channels, split, x, target, chunks,
                                                      args.repeats)
            row += [seq_infer_s / tp_infer_s, seq_train_s / tp_train_s]
        rows.append(row)

    headers = ["chunks", "ideal x", "infer x seq", "infer x seq-mb", "% of ideal", "pred ms", "meas ms", "err %",
               "train x seq", "train pred ms", "train meas ms", "train err %"]
    if not args.no_torch_pipelining:
        headers += ["torch.pipelining infer x seq", "torch.pipelining train x seq"]
    print(f"\nfxpipe, {STAGES} stages x 1 thread: speed-up over 1 thread sequential (samples/s "
          f"ratio), predicted and measured time per batch:")
    print(tabulate(rows, headers=headers, floatfmt=".2f"))


if __name__ == "__main__":
    main()
