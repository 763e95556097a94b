"""Plan once, then train with one process per stage under torchrun.

    python examples/torchrun_train.py plan plans/tiny-lm --stages 2      # once, anywhere
    torchrun --nproc-per-node 2 examples/torchrun_train.py train plans/tiny-lm --steps 5
    torchrun --nproc-per-node 4 examples/torchrun_train.py train plans/tiny-lm   # 2 replicas

The model is a tiny language model whose output layer reads the embedding's weight again (tied
weights): stage 0 and the last stage both hold it, and `fxpipe.distributed` adds up their
gradients, so each copy takes the same optimizer step as the model's one weight would.

`plan` traces and measures the model and saves the plan (code and weights per stage). `train`
is what every rank runs: it loads only its own stage (`fxpipe.distributed.load`), makes the
same synthetic batches as every other rank (one seed), gives stage 0 the tokens and the last
stage the targets (with replicas, each replica its shard of the rows), and steps its own
stage's parameters with its own optimizer. The last stage of replica 0 prints each step's loss,
the whole batch's.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe

VOCAB, WIDTH, LENGTH, BATCH = 50, 16, 6, 12


class TinyLM(nn.Module):
    """Embed, two layers, and logits by the embedding's own weight (tied)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = self.norm(h + self.down(torch.relu(self.up(h))))
        return F.linear(h, self.embed.weight)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over the batch's tokens (every row has LENGTH)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of (tokens, next tokens), the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        text = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=generator)
        out.append((text[:, :-1], text[:, 1:]))
    return out


def make_plan(path: str, stages: int) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    tokens, _ = batches(1)[0]
    # link="gloo": values between stages priced as messages between processes (measured here)
    plan = fxpipe.plan(model, ["cpu"] * stages, (tokens,), chunks=2, training=True,
                       link="gloo")
    plan.save(path)
    print(f"saved to {path}:\n{plan}")


def train(path: str, steps: int, lr: float) -> None:
    import fxpipe.distributed
    fxpipe.tune_cpu_allocator()      # keep freed activations (CPU stages; whole process)
    with fxpipe.distributed.load(path) as stage:
        optimizer = torch.optim.SGD(stage.parameters(), lr=lr)
        first, last = stage.index == 0, stage.index == stage.last
        for step, (tokens, targets) in enumerate(batches(steps), 1):
            tokens, targets = (t.chunk(stage.replicas)[stage.replica] for t in (tokens, targets))
            optimizer.zero_grad()
            loss = stage.train_step(tokens if first else None, targets if last else None,
                                    loss_fn)
            optimizer.step()
            if last and stage.replica == 0:
                print(f"step {step} loss {loss.item():.6f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["plan", "train"])
    parser.add_argument("path", help="the plan's directory")
    parser.add_argument("--stages", type=int, default=2, help="plan: how many stages")
    parser.add_argument("--steps", type=int, default=5, help="train: how many steps")
    parser.add_argument("--lr", type=float, default=0.5, help="train: SGD's learning rate")
    args = parser.parse_args(argv)
    if args.command == "plan":
        make_plan(args.path, args.stages)
    else:
        train(args.path, args.steps, args.lr)


if __name__ == "__main__":
    main()
