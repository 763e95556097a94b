"""What a pipeline equals: the model run once per micro-batch, in micro-batch order.

A pipeline with `chunks=c` computes, for micro-batch `m`, what the model computes when called on
micro-batch `m` alone right after `torch.manual_seed(seeds[m])` (the seeds of
`fxpipe.passes.randomness.microbatch_seeds`), the calls made in micro-batch order; outputs are merged
along their batch dimension. So BatchNorm normalises each micro-batch (as in GPipe), buffers are
updated once per micro-batch, and dropout draws the numbers the model draws under those seeds.
`run_per_microbatch` is that reference; `unchanged` lets a check run it without side effects.

Each layer runs on its stage's device, and each device draws from its own generator, as in torch:
CPU stages and stages on one GPU draw what the model draws there, while a plan over several GPUs
starts each GPU's draws from the seed (as the model placed by hand over them would) and draws other
numbers than one GPU. Every pass that runs the model or the graph on the example works on copies of
the inputs and leaves buffers, mode flags and the caller's generator as they were. Where a
construct cannot meet this contract it is refused at compile by name, never approximated.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.device import forked_generators
from fxpipe.passes.state import unchanged_state
from fxpipe.passes.capture import attributes_restored

from ..runtime import microbatch


def run_per_microbatch(model: nn.Module, args: tuple, kwargs: Mapping[str, Any] | None = None,
                       chunks: int = 1, *, seeds: Sequence[int] | None = None,
                       batch_dims: microbatch.Dims = 0) -> list[Any]:
    """`model`'s output on each micro-batch of `(args, kwargs)`, in order.

    Micro-batch `m` runs after `torch.manual_seed(seeds[m])` when `seeds` is given, on its own
    copy of the inputs (the caller's tensors are never written). `batch_dims` is a pytree prefix
    of `(args, kwargs)`, as `microbatch.split` takes it. Buffers change as the model changes them:
    wrap the call in `unchanged(model)` to leave the model as it was.
    """
    parts = microbatch.split((tuple(args), dict(kwargs or {})), chunks, batch_dims)
    outputs = []
    for m, (part_args, part_kwargs) in enumerate(parts):
        if seeds is not None:
            torch.manual_seed(seeds[m])
        outputs.append(model(*copied(part_args), **copied(part_kwargs)))
    return outputs


def copied(inputs: Any) -> Any:
    """`inputs` with every tensor replaced by a copy, so a run that writes them changes nothing."""
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, inputs)


@contextlib.contextmanager
def unchanged(model: nn.Module) -> Iterator[None]:
    """Inside, run `model` freely: its parameters and buffers (the tensors, and the buffers'
    values, `fxpipe.passes.state.unchanged_state`), its modules' plain attributes
    (`fxpipe.passes.capture.attributes_restored`) and the random generators are restored after;
    gradients are off."""
    with unchanged_state(model), attributes_restored(model), forked_generators(), \
            torch.no_grad():
        yield
