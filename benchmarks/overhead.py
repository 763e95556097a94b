"""The runtime's own cost: host microseconds per stage hop, with kept workers and with threads
started per run (the runtime before workers were kept), beside the model on one thread.

    python -m benchmarks.overhead [--stages 4] [--chunks 16] [--repeats 30] [--gpu]

A tiny model (Linear 16->16 and tanh per stage, one row per micro-batch) does next to no work,
so a pipeline's time is its hand-offs. A hop is one message between two stages or the driver
(counted by the transport as the run sends it): a call of 4 stages and 16 micro-batches makes
80, a train step twice as many less the driver's. "us/hop" is the pipeline's time less the model
run on one thread (the same rows, one call), over the hops; the model on all the caller's cores
is shown too ("x model" is against the model on one thread). Calls, train steps and streams (16
items of one row) are timed in interleaved rounds, the median of each. "per-run threads" ends
the workers after each run, so the next run starts them again, as every run did before the
workers were kept. `--gpu` runs the same on cuda:0 (all stages on the one GPU) where there is one.
Run it alone: two cores are easily shared into noise.
"""

from __future__ import annotations

import argparse
import functools
import queue
import statistics
import threading
import time

import torch
from tabulate import tabulate
from torch import nn

import fxpipe
from fxpipe.runtime.transport import ThreadTransport


class Tiny(nn.Module):
    def __init__(self, stages: int, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(stages))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def hops(run) -> int:
    """How many messages `run()` sends between stages and the driver."""
    count = 0
    send = ThreadTransport.send

    def counting(self, *args, **kwargs):
        nonlocal count
        count += 1
        return send(self, *args, **kwargs)
    ThreadTransport.send = counting
    try:
        run()
    finally:
        ThreadTransport.send = send
    return count


def per_run_threads(pipe: fxpipe.Pipeline, run):
    """`run` as the runtime ran before workers were kept: threads started for it, ended after."""
    workers = pipe._runtime.workers

    def fresh():
        run()
        workers.close()              # the threads end as a per-run thread did
        workers.closed = False       # and the next run starts new ones
    return fresh


def side_by_side(fns: dict, repeats: int, sync) -> dict:
    """Median seconds of each, timed in interleaved rounds so drift hits all alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for r in range(repeats):
        names = list(fns)
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync()
            start = time.perf_counter()
            fns[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(device: str, stages: int, chunks: int, repeats: int) -> list[list]:
    torch.manual_seed(0)
    model = Tiny(stages).to(device)
    x, target = torch.randn(chunks, 16, device=device), torch.randn(chunks, 16, device=device)
    items = list(x.split(1))
    loss_fn = nn.functional.mse_loss
    # Two pipelines of the model: one keeps its workers, the other ends them after each run.
    kept, fresh = (fxpipe.compile(model, [device] * stages, (x,), chunks=chunks, training=True)
                   for _ in range(2))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def call(pipe):
        with torch.no_grad():
            pipe(x)

    def step(pipe):
        pipe.train_step(x, target, loss_fn)

    def stream(pipe):
        with torch.no_grad():
            for _ in pipe.stream(items):
                pass

    def model_call():
        with torch.no_grad():
            model(x)

    def model_step():
        loss_fn(model(x), target).backward()

    def model_stream():
        with torch.no_grad():
            for item in items:
                model(item)

    runs = {"call": (call, model_call), "train_step": (step, model_step),
            "stream": (stream, model_stream)}
    counts = {name: hops(lambda: run(kept)) for name, (run, _) in runs.items()}
    caller = torch.get_num_threads()
    # The plain model on the caller's cores, timed apart (switching thread counts inside a
    # timed run would cost more than this tiny model).
    whole = side_by_side({name: baseline for name, (_, baseline) in runs.items()}, repeats, sync)
    torch.set_num_threads(1)     # the model on one thread (the driver's own work too)
    try:
        fns = {}
        for name, (run, baseline) in runs.items():
            fns[name, "model, 1 thread"] = baseline
            fns[name, "per-run threads"] = per_run_threads(fresh, functools.partial(run, fresh))
            fns[name, "kept workers"] = functools.partial(run, kept)
        times = side_by_side(fns, repeats, sync)
    finally:
        torch.set_num_threads(caller)
        kept.close()
        fresh.close()
    rows = []
    for name in runs:
        base = times[name, "model, 1 thread"]
        rows.append([device, name, "model, all cores", "-", f"{whole[name] * 1e3:.3f}", "-",
                     f"{base / whole[name]:.2f}x"])
        rows.append([device, name, "model, 1 thread", "-", f"{base * 1e3:.3f}", "-", "1.00x"])
        for how in ("per-run threads", "kept workers"):
            t = times[name, how]
            rows.append([device, name, how, counts[name], f"{t * 1e3:.3f}",
                         f"{(t - base) / counts[name] * 1e6:.1f}", f"{base / t:.2f}x"])
    return rows


def queue_hop_us(rounds: int = 20_000) -> float:
    """The floor under any hand-off between threads on this machine: microseconds for one
    message through a `queue.SimpleQueue` to a parked thread (half a ping-pong's round trip)."""
    there, back = queue.SimpleQueue(), queue.SimpleQueue()

    def echo():
        while (item := there.get()) is not None:
            back.put(item)
    thread = threading.Thread(target=echo)
    thread.start()
    try:
        for _ in range(rounds // 20):     # warm
            there.put(1)
            back.get()
        start = time.perf_counter()
        for _ in range(rounds):
            there.put(1)
            back.get()
        return (time.perf_counter() - start) / rounds / 2 * 1e6
    finally:
        there.put(None)
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--gpu", action="store_true", help="also on cuda:0, where there is one")
    args = parser.parse_args()
    rows = measure("cpu", args.stages, args.chunks, args.repeats)
    if args.gpu and torch.cuda.is_available():
        rows += measure("cuda:0", args.stages, args.chunks, args.repeats)
    print(f"{args.stages} stages, {args.chunks} micro-batches of one row (streams: "
          f"{args.chunks} items); median of {args.repeats} interleaved rounds")
    print(tabulate(rows, headers=["device", "run", "runtime", "hops", "ms", "us/hop",
                                  "x model"]))
    print(f"the floor: one message through a queue to a parked thread, {queue_hop_us():.1f} us "
          f"(the runtime's hop is that plus its own Python per message and action)")


if __name__ == "__main__":
    main()
