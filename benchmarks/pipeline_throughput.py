"""Pipeline throughput on this CPU: fxpipe against one thread, the GPipe bound and
torch.distributed.pipelining, for inference and training, with the cost model's prediction.

    python -m benchmarks.pipeline_throughput [--channels 48] [--batch 64] [--repeats 5]

A chain of 8 Conv2d+ReLU layers (32x32 images) whose forward takes ~100-200 ms on one thread,
split into 2 stages of one thread each. Speed-ups are samples/s relative to the same model run
sequentially on one thread, all measured in this one run: on the whole batch ("x seq"), and on the
same micro-batches one after the other ("x seq-mb"), which separates the pipeline's overlap from
the change in per-sample speed that smaller batches bring. The ideal GPipe bound for k stages and
m micro-batches is k*m/(m+k-1); "% of ideal" is the x seq-mb speed-up over it.
torch.distributed.pipelining runs the same split (the one fxpipe chose) in 2 gloo processes with
ScheduleGPipe. Every process runs with `fxpipe.tune_cpu_allocator()` (glibc keeps freed
activations instead of page-faulting them in again: 2x on this model, for every contender); pass
--default-allocator to see the difference. Run it alone: two cores are easily shared into noise.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch import nn
from torch.nn import functional as F

import fxpipe

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


# Untimed interleaved rounds first, until each function ran this long and at least twice: a
# fresh pipeline's first calls on this machine ran 2-5x slower for its first 2 to 16 calls
# (README net, 2 stages: 2-7 ms, then 1.3 ms), and a median of a few calls read that instead.
WARM_S = 0.2


def side_by_side(fns: dict, repeats: int) -> dict:
    """Median seconds of each function, timed in interleaved rounds so drift hits all alike,
    after warm rounds (`WARM_S`)."""
    ran = {name: [0, 0.0] for name in fns}
    while any(runs < 2 or spent < WARM_S for runs, spent in ran.values()):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            ran[name][0] += 1
            ran[name][1] += time.perf_counter() - start
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def torch_pipelining_worker(rank, channels, split, x, target, chunks, repeats, port, results,
                            tune):
    """One process of torch.distributed.pipelining: stage `rank` of the same split."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if tune:
        fxpipe.tune_cpu_allocator()
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


def torch_pipelining(channels, split, x, target, chunks, repeats, tune) -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(torch_pipelining_worker, nprocs=STAGES, join=True,
             args=(channels, split, x, target, chunks, repeats, port, results, tune))
    return results.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", type=int, default=48)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--no-torch-pipelining", action="store_true")
    parser.add_argument("--default-allocator", action="store_true")
    args = parser.parse_args()
    tune = not args.default_allocator and fxpipe.tune_cpu_allocator()
    print(f"glibc allocator tuned (fxpipe.tune_cpu_allocator): {'yes' if tune else 'no'}")

    torch.set_num_threads(1)
    model = build(args.channels)
    x = torch.randn(args.batch, 3, 32, 32)
    target = torch.randn(args.batch, args.channels, 32, 32)

    def seq_train():
        model.zero_grad()
        F.mse_loss(model(x), target).backward()

    rows = []
    for chunks in args.chunks:
        pipe = fxpipe.compile(model, ["cpu"] * STAGES, (x,), chunks=chunks, training=True,
                              threads_per_stage=1, verify=False)

        def pipe_train():
            model.zero_grad()
            pipe.train_step(x, target, F.mse_loss)

        with torch.no_grad():
            infer = side_by_side({
                "seq": lambda: model(x),
                "seq-mb": lambda: [model(c) for c in x.tensor_split(chunks)],
                "pipe": lambda: pipe(x)}, args.repeats)
        train = side_by_side({"seq": seq_train, "pipe": pipe_train}, args.repeats)
        predicted_infer_s = max(s.end_s for s in pipe.predict())
        predicted_train_s = max(s.end_s for s in pipe.predict(training=True))
        ideal = STAGES * chunks / (chunks + STAGES - 1)
        overlap = infer["seq-mb"] / infer["pipe"]
        row = [chunks, ideal, infer["seq"] / infer["pipe"], overlap, overlap / ideal * 100,
               predicted_infer_s * 1e3, infer["pipe"] * 1e3,
               (predicted_infer_s / infer["pipe"] - 1) * 100,
               train["seq"] / train["pipe"], predicted_train_s * 1e3, train["pipe"] * 1e3,
               (predicted_train_s / train["pipe"] - 1) * 100]
        if not args.no_torch_pipelining:
            split = sum(1 for name, s in pipe.plan.partition.stage_of.items() if s == 0
                        and name.lstrip("_").isdigit())
            tp_infer_s, tp_train_s = torch_pipelining(args.channels, split, x, target, chunks,
                                                      args.repeats, tune)
            row += [infer["seq"] / tp_infer_s, train["seq"] / tp_train_s,
                    tp_infer_s / infer["pipe"], tp_train_s / train["pipe"]]
        rows.append(row)

    headers = ["chunks", "ideal x", "infer x seq", "infer x seq-mb", "% of ideal", "pred ms", "meas ms", "err %",
               "train x seq", "train pred ms", "train meas ms", "train err %"]
    if not args.no_torch_pipelining:
        headers += ["torch.pipelining infer x seq", "torch.pipelining train x seq",
                    "fxpipe / torch.pipelining infer", "fxpipe / torch.pipelining train"]
    print(f"\nfxpipe, {STAGES} stages x 1 thread: speed-up over 1 thread sequential (samples/s "
          f"ratio), predicted and measured time per batch:")
    print(tabulate(rows, headers=headers, floatfmt=".2f"))


if __name__ == "__main__":
    main()
