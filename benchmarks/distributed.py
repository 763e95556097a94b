"""One plan, four runtimes: fxpipe over torch.distributed, fxpipe's threads, torch's pipelining
and the model in one process, side by side on this machine's CPU.

    python -m benchmarks.distributed [--train] [--chunks 1 2 4 8 16] [--channels 48] [--batch 64] [--repeats 5] [--rounds 3]

The chain of 8 Conv2d+ReLU layers of `benchmarks/pipeline_throughput.py`, planned by fxpipe on 2
CPU stages of one thread each with `link="gloo"` (values priced as messages between processes);
for 1, 2, 4, 8 and 16 micro-batches, the throughput of inference (or, with `--train`, of
training steps on GPipe, a mean squared error to a random target) of:
- the model in one process, whole batch, 1 thread and all cores' threads;
- fxpipe's threaded `Pipeline` (two stage threads in this process);
- `fxpipe.distributed`: the saved plan in 2 torchrun processes (gloo on 127.0.0.1);
- torch.distributed.pipelining's `ScheduleGPipe` on the same 2 stages
  (`fxpipe.torch_pipelining.pipeline_stages`), 2 torchrun processes.
Every process runs with `fxpipe.tune_cpu_allocator()` (glibc keeps freed activations: without
it every process page-faults its activations in anew, 35-70% of a step here, more in some
processes than in others). Each runtime is timed in `--rounds` rounds, the three in turn, and its median shown (the
processes' timings move by 20% from one launch to the next here). "x 1 thread" is samples/s
over the model's with one thread; "% of ideal" divides it by the GPipe
bound k*m/(m+k-1) for k = 2 stages and m micro-batches; "plan says" is the samples/s the plan
predicts for a run under torchrun. Run it alone: two cores are easily shared
into noise.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

import fxpipe
from benchmarks.pipeline_throughput import build, median_s

ROOT = Path(__file__).resolve().parents[1]
STAGES = 2


def launched(kind: str, plan: Path, data: Path, repeats: int, train: bool) -> float:
    """The median seconds per step measured by 2 torchrun processes running `kind`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                   str(STAGES), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "benchmarks.distributed", "--worker", kind, str(plan), str(data),
                   str(repeats), out, "train" if train else "infer"]
        subprocess.run(command, cwd=ROOT, check=True, timeout=600,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return float(Path(out, "seconds").read_text())


def worker(kind: str, plan: str, data: str, repeats: str, out: str, mode: str) -> None:
    """One torchrun process: time `repeats` steps (a call, or a training step with GPipe);
    the last rank writes the median."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    fxpipe.tune_cpu_allocator()
    x, target = torch.load(data).values()
    train = mode == "train"
    if kind == "fxpipe":
        from fxpipe import distributed
        stage = distributed.load(plan)
        rank, last = stage.rank, stage.last

        def step():
            if train:
                stage.train_step(x if rank == 0 else None, target if rank == last else None,
                                 F.mse_loss)
            else:
                with torch.no_grad():
                    stage(x if rank == 0 else None)
    else:
        from torch.distributed.pipelining import ScheduleGPipe
        from fxpipe.torch_pipelining import pipeline_stages
        dist.init_process_group("gloo")
        rank, last = dist.get_rank(), dist.get_world_size() - 1
        chunks = fxpipe.load_plan(plan).chunks
        schedule = ScheduleGPipe(pipeline_stages(plan)[0], n_microbatches=chunks,
                                 loss_fn=F.mse_loss if train else None)

        def step():
            if train:
                schedule.step(x) if rank == 0 else schedule.step(target=target)
            else:
                with torch.no_grad():
                    schedule.eval(x) if rank == 0 else schedule.eval()
    seconds = median_s(lambda: (step(), dist.barrier()), int(repeats))
    if rank == last:
        Path(out, "seconds").write_text(repr(seconds))
    if kind == "fxpipe":
        stage.close()
    else:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", type=int, default=48)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the three runtimes in turn; the median round is shown")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                        help="the micro-batch counts to run (default: 1 2 4 8 16)")
    parser.add_argument("--train", action="store_true",
                        help="time training steps (forward, backward; GPipe) instead of calls")
    options = parser.parse_args()
    fxpipe.tune_cpu_allocator()
    torch.manual_seed(0)
    model = build(options.channels).train(options.train)
    x = torch.randn(options.batch, 3, 32, 32)
    target = torch.randn_like(model(x[:1])).expand(options.batch, -1, -1, -1).contiguous()

    def model_step():
        if options.train:
            F.mse_loss(model(x), target).backward()
        else:
            with torch.no_grad():
                model(x)
    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch, "data.pt")
        torch.save({"x": x, "target": target}, data)
        torch.set_num_threads(1)
        one = median_s(model_step, options.repeats)
        torch.set_num_threads(cores)
        every = median_s(model_step, options.repeats)
        for chunks in options.chunks:
            pipe = fxpipe.compile(model, ["cpu"] * STAGES, (x,), chunks=chunks,
                                  threads_per_stage=1, progress=False, link="gloo",
                                  training=options.train)
            plan = Path(scratch, f"plan-{chunks}")
            pipe.plan.save(plan)

            def threads():
                if options.train:
                    pipe.train_step(x, target, F.mse_loss)
                else:
                    with torch.no_grad():
                        pipe(x)
            runs = {"fxpipe threads": lambda: median_s(threads, options.repeats),
                    "fxpipe.distributed": lambda: launched("fxpipe", plan, data, options.repeats,
                                                           options.train),
                    "torch pipelining": lambda: launched("torch", plan, data, options.repeats,
                                                         options.train)}
            rounds = [{label: run() for label, run in runs.items()}
                      for _ in range(options.rounds)]       # interleaved: drift hits all alike
            timings = {label: statistics.median(r[label] for r in rounds) for label in runs}
            ideal = STAGES * chunks / (chunks + STAGES - 1)
            predicted = {"fxpipe.distributed": options.batch / pipe.plan.record.predicted_step_s}
            for label, seconds in timings.items():
                rows.append((chunks, label, options.batch / seconds, predicted.get(label, ""),
                             one / seconds, every / seconds, 100 * one / seconds / ideal))
    print(f"{'training (GPipe)' if options.train else 'inference'}, batch {options.batch}, "
          f"{STAGES} stages x 1 thread, {cores} cores; model: {options.batch / one:.1f} "
          f"samples/s on 1 thread, {options.batch / every:.1f} on {cores}")
    print(tabulate(rows, headers=["chunks", "runtime", "samples/s", "plan says", "x 1 thread",
                                  f"x {cores} threads", "% of ideal"], floatfmt=".2f"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:8])
    else:
        main()
