"""fxpipe's own plan against torch.distributed.pipelining on a split by layer counts, under
torchrun.

    python -m benchmarks.vs_torch [--rounds 3] [--repeats 5] [--modes infer train]

Users of torch's pipelining split a language model by counting layers (torchtitan's rule: the
layers evenly over the stages, the embedding and the output layer counted as one layer each).
Where the output layer is large, that split is unbalanced. The model here is such a decoder:
d=256, 8 layers, a 40000-word vocabulary, batch 16 sequences x 64 tokens, 8 micro-batches, on
2 processes under torchrun (gloo), one thread each, the CPU allocator tuned in every process:
- torch: `PipelineStage` + `ScheduleGPipe` on torchtitan's split (10 units over 2 stages:
  the embedding and layers 0-3, then layers 4-7, the final norm and the output layer);
- fxpipe: its own plan of the model (`fxpipe.plan(..., link="gloo")`, one thread a stage),
  run by `fxpipe.distributed` on GPipe;
- the model whole in one process, on 1 thread and on all cores.
Inference (calls) and training (steps: forward, backward, a cross-entropy over tokens). Each
round launches the two pipelines in turn (drift hits both alike), each launch timing `--repeats`
steps after one warm-up and keeping the median; the table shows the median round, and each
pipeline's output on the last step against the model's (the largest absolute difference of the
logits). Run it alone: two cores are easily shared into noise.
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
from torch import nn

import fxpipe
from benchmarks.pipeline_throughput import median_s

ROOT = Path(__file__).resolve().parents[1]
WIDTH, LAYERS, HEADS, VOCAB = 256, 8, 4, 40000
BATCH, TOKENS, CHUNKS, STAGES = 16, 64, 8, 2


class Block(nn.Module):
    """A pre-norm decoder layer: causal self-attention, then an MLP."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(attended.transpose(1, 2).reshape(b, t, WIDTH))
        return h + self.mlp(self.norm2(h))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class Part(nn.Module):
    """Stage `index` of torchtitan's split of `model` (see the module docstring)."""

    def __init__(self, model: Decoder, index: int):
        super().__init__()
        per_stage = (LAYERS + 2) // STAGES          # the embedding and the head count as layers
        first = max(0, index * per_stage - 1)
        last = min(LAYERS, (index + 1) * per_stage - 1)
        self.embed = model.embed if index == 0 else None
        self.layers = nn.ModuleList(model.layers[first:last])
        self.tail = nn.Sequential(model.norm, model.head) if index == STAGES - 1 else None

    def forward(self, h):
        if self.embed is not None:
            h = self.embed(h)
        for layer in self.layers:
            h = layer(h)
        return self.tail(h) if self.tail is not None else h


def built() -> tuple[Decoder, torch.Tensor, torch.Tensor]:
    """The model (the same in every process: seeded), a batch of token ids and its targets."""
    torch.manual_seed(0)
    model = Decoder()
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS))
    return model, ids, torch.randint(0, VOCAB, (BATCH, TOKENS))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def launched(kind: str, plan: Path, mode: str, repeats: int) -> tuple[float, torch.Tensor]:
    """The median seconds per step of 2 torchrun processes running `kind`, and the output of
    the last rank's last call (inference) or None."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                   str(STAGES), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "benchmarks.vs_torch", "--worker", kind, str(plan), mode,
                   str(repeats), out]
        subprocess.run(command, cwd=ROOT, check=True, timeout=900,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        found = torch.load(Path(out, "result.pt"))
        return found["seconds"], found["output"]


def worker(kind: str, plan: str, mode: str, repeats: str, out: str) -> None:
    """One torchrun process: time `repeats` steps; the last rank saves the median and output."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    fxpipe.tune_cpu_allocator()
    model, ids, target = built()
    train = mode == "train"
    model.train(train)
    output = []
    if kind == "fxpipe":
        from fxpipe import distributed
        stage = distributed.load(plan)
        rank, last = stage.rank, stage.last

        def step():
            if train:
                stage.train_step(ids if rank == 0 else None, target if rank == last else None,
                                 loss_fn)
            else:
                with torch.no_grad():
                    output[:] = [stage(ids if rank == 0 else None)]
    else:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
        dist.init_process_group("gloo")
        rank, last = dist.get_rank(), dist.get_world_size() - 1
        part = Part(model, rank).train(train)
        schedule = ScheduleGPipe(PipelineStage(part, rank, STAGES, torch.device("cpu")),
                                 n_microbatches=CHUNKS, loss_fn=loss_fn if train else None)

        def step():
            if train:
                schedule.step(ids) if rank == 0 else schedule.step(target=target)
            else:
                with torch.no_grad():
                    output[:] = [schedule.eval(ids) if rank == 0 else schedule.eval()]
    seconds = median_s(lambda: (step(), dist.barrier()), int(repeats))
    if rank == last:
        torch.save({"seconds": seconds, "output": output[0] if output else None},
                   Path(out, "result.pt"))
    if kind == "fxpipe":
        stage.close()
    else:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["infer", "train"],
                        choices=["infer", "train"])
    options = parser.parse_args()
    fxpipe.tune_cpu_allocator()
    model, ids, target = built()
    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for mode in options.modes:
            train = mode == "train"
            model.train(train)

            def model_step():
                if train:
                    loss_fn(model(ids), target).backward()
                else:
                    with torch.no_grad():
                        model(ids)
            torch.set_num_threads(1)
            one = median_s(model_step, options.repeats)
            torch.set_num_threads(cores)
            every = median_s(model_step, options.repeats)
            plan = fxpipe.plan(model, ["cpu"] * STAGES, (ids,), chunks=CHUNKS,
                               threads_per_stage=1, link="gloo", training=train,
                               progress=False)
            path = Path(scratch, f"plan-{mode}")
            plan.save(path)
            with torch.no_grad():
                expected = model.eval()(ids)
            model.train(train)
            rounds = [{kind: launched(kind, path, mode, options.repeats)
                       for kind in ("torch", "fxpipe")} for _ in range(options.rounds)]
            seconds = {kind: statistics.median(r[kind][0] for r in rounds)
                       for kind in ("torch", "fxpipe")}
            for kind, label in (("torch", "torch pipelining, split by layer counts"),
                                ("fxpipe", "fxpipe's plan, fxpipe.distributed")):
                output = rounds[-1][kind][1]
                rows.append((mode, label, BATCH / seconds[kind],
                             seconds["torch"] / seconds[kind], one / seconds[kind],
                             every / seconds[kind], "" if output is None else
                             f"{(output - expected).abs().max().item():.1e}"))
            for threads, model_s in ((1, one), (cores, every)):
                rows.append((mode, f"the model whole, {threads} thread{'s' * (threads > 1)}",
                             BATCH / model_s, seconds["torch"] / model_s, one / model_s,
                             every / model_s, ""))
            print(f"{mode}: fxpipe's stages {plan.partition.stages[0].time_s * 1e3:.1f} and "
                  f"{plan.partition.stages[1].time_s * 1e3:.1f} ms per micro-batch (predicted)",
                  flush=True)
    print(f"decoder d={WIDTH}, {LAYERS} layers, vocabulary {VOCAB}; batch {BATCH} x {TOKENS} "
          f"tokens, {CHUNKS} micro-batches, {STAGES} processes x 1 thread, {cores} cores; "
          f"median of {options.rounds} rounds")
    print(tabulate(rows, headers=["mode", "runtime", "samples/s", "x torch", "x model 1 thread",
                                  f"x model {cores} threads", "max |output - model|"],
                   floatfmt=".2f"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:7])
    else:
        main()
