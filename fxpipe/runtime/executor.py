"""The stage executor: one stage's forward and backward for one micro-batch, on the calling thread.

It knows nothing of threads, queues or other stages: it is given the values a stage reads and
returns the values it computed (forward), or is given the gradients its readers sent and returns
its inputs' gradients (backward). Whoever moves those values, and on which thread, is the
orchestrator's and the transport's business.

Whether a micro-batch is trained is read off the timetable, not off a flag: a stage whose
timetable holds micro-batch m's backward cuts autograd where m's values came from other stages
(they become fresh leaves, so the backward stops at the stage boundary) and keeps m's inputs and
outputs until that backward, which runs `torch.autograd.backward` on the outputs with the
gradients the readers sent, then frees them. The stage given a `loss_of` (the last one) turns
micro-batch m's values into its loss, whose backward starts there. Without a backward to come,
tensors stay attached to autograd, so `pipe(x).sum().backward()` works as for the model.

Random draws follow the seeds the caller's `Pipeline` drew, one per micro-batch (see
`fxpipe.passes.randomness`): micro-batch m's forward runs under `microbatch_seed(seeds[m])`.

On a GPU the stage computes on its own CUDA stream, with its GPU current on the thread, which
first waits for the caller's stream (its inputs, the latest optimizer step), and which the
caller's stream waits for at the end.
The caller's thread-local modes (grad mode, autocast) are captured when the executor is made, on
the caller's thread, and entered again wherever the stage computes (`computing()`).

Recomputation changes memory and time, never results. A recomputing stage (whole: its forward keeps
only its inputs and the backward runs it again first; or runs of its nodes,
`fxpipe.passes.recompute`) draws the same random numbers (the generator state is a graph value; a
recomputed run carries the micro-batch seed it first ran under, since autograd recomputes a GPU's
runs on its own thread for that device), and its buffers are written once (put back after the
backward through `.data`: nothing read on the host, no version bumped, so kept nodes' saved buffers
stay valid). It recomputes only in `train_step`: a plain call runs as is. The partitioner prices a
stage by the same `Memory` rules the plan prints.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx

from fxpipe.passes.device import Stream, autocast_types, current_stream, use_stream, wait_stream
from fxpipe.passes.stage import Stage
from fxpipe.passes.graph_values import tensors
from fxpipe.passes.randomness import microbatch_seed
from fxpipe.passes.recompute import Recomputed, recomputing
from fxpipe.passes.state import unchanged_state

from .memory import stage_memory

LossFn = Callable[[int, dict[str, Any]], torch.Tensor]   # (micro-batch, graph values) -> loss
Grads = dict[str, list[torch.Tensor | None]]             # value name -> gradient of each tensor


class _Every(Collection[int]):
    """Every micro-batch (a stream's items): `backward_for=EVERY` keeps each forward for its
    backward."""

    def __contains__(self, m: object) -> bool:
        return True

    def __iter__(self) -> Iterator[int]:
        raise TypeError("every item: not to be listed")

    def __len__(self) -> int:
        raise TypeError("every item: not to be counted")

    def __bool__(self) -> bool:
        return True


EVERY = _Every()


@dataclass
class _Saved:
    """What a forward keeps for its backward."""

    inputs: dict[str, Any]       # what it received, other stages' tensors as detached leaves
    outputs: dict[str, Any]
    loss: torch.Tensor | None = None


class StageExecutor:
    """Runs one stage's forwards and backwards, one micro-batch at a time, on the calling thread.

    `from_stages`: the names of the values other stages send (the stage's inputs, and graph
    outputs the loss reads), cut from autograd before a backward, and whose gradients `backward`
    returns; `backward_for`: the micro-batches whose backward will run here; `loss_of`: given
    to the stage that computes the loss; `seeds[m]`: micro-batch m's seed; `stream`: its stream.
    Made on the caller's thread; on any other, call `forward` and `backward` inside `computing()`.
    """

    def __init__(self, stage: Stage, *, from_stages: Collection[str] = (),
                 backward_for: Collection[int] = (), loss_of: LossFn | None = None,
                 seeds: Sequence[int | None] | None = None,
                 stream: Stream | None = None, recompute: bool = False):
        self.stage = stage
        self.recompute = recompute
        self.from_stages = tuple(from_stages)
        self.backward_for = backward_for if backward_for is EVERY else frozenset(backward_for)
        self.loss_of = loss_of
        self.seeds = seeds
        self.stream = stream
        self.losses: dict[int, torch.Tensor] = {}    # micro-batch -> its loss, detached
        self._saved: dict[int, _Saved] = {}
        # Runs of nodes recomputed in the backward (`fxpipe.passes.recompute`) write the buffers
        # again there (and draw from the micro-batch's seed again, which each run carries).
        self._regions = any(isinstance(m, Recomputed) for m in stage.module.modules())
        self._grad_enabled = torch.is_grad_enabled() or bool(self.backward_for)
        self._autocast = [(kind, torch.get_autocast_dtype(kind)) for kind in autocast_types()
                          if torch.is_autocast_enabled(kind)]

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """The caller's grad mode and autocast, and this stage's stream, on the current thread."""
        with contextlib.ExitStack() as context:
            context.enter_context(stage_memory(self.stage))   # off unless track_memory() is on
            context.enter_context(torch.set_grad_enabled(self._grad_enabled))
            for kind, dtype in self._autocast:
                context.enter_context(torch.autocast(kind, dtype=dtype))
            context.enter_context(use_stream(self.stream))    # its GPU current first
            yield

    def wait_for_caller(self) -> None:
        """Start this stage's GPU work after the caller's queued work (inputs, optimizer step)."""
        if self.stream is not None:
            wait_stream(self.stream, current_stream(self.stream.device))

    def make_caller_wait(self) -> None:
        """Queue the caller's later GPU work (losses, reading `.grad`) after this stage's."""
        if self.stream is not None:
            wait_stream(current_stream(self.stream.device), self.stream)

    def forward(self, m: int, values: Mapping[str, Any]) -> dict[str, Any]:
        """Micro-batch m's outputs from the values the stage received (`values`, by name).

        With `recompute`, a forward whose backward is to come keeps only what the stage
        received: it runs without autograd, and the backward runs it again, with autograd."""
        keep = m in self.backward_for
        if keep:
            values = {k: _detach_leaf(v) if k in self.from_stages else v for k, v in values.items()}
        if keep and self.recompute:
            with torch.no_grad():
                out, loss = self._run(m, values)
            self._saved[m] = _Saved(dict(values), {})
            return {k: _needing_grad(v) for k, v in out.items()}
        with recomputing() if keep and self._regions else contextlib.nullcontext():
            out, loss = self._run(m, values)
        if keep:
            self._saved[m] = _Saved(dict(values), out, loss)
        return out

    def _run(self, m: int, values: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        """The stage's outputs for micro-batch m, from its seed, and its loss on the last stage."""
        # `forward`, not `__call__`: fx's wrapper around generated code prints errors to stderr
        # and drops the traceback that names the failing statement.
        with microbatch_seed(self.seeds[m] if self.seeds is not None else None):
            out = dict(zip(self.stage.outputs,
                           self.stage.module.forward(*(values[n] for n in self.stage.inputs))))
        loss = None
        if self.loss_of is not None:
            loss = self.loss_of(m, {**values, **out})
            self.losses[m] = loss.detach()
        return out, loss

    def _recomputed(self, m: int, saved: _Saved) -> _Saved:
        """Micro-batch m's forward run again, with autograd, from what it received: the same
        seed draws the same random numbers. (`backward` puts back the buffers it writes.)"""
        with torch.enable_grad():
            out, loss = self._run(m, saved.inputs)
        return _Saved(saved.inputs, out, loss)

    def backward(self, m: int, grads: Iterable[Mapping[str, Sequence[torch.Tensor | None]]]
                 ) -> Grads:
        """Micro-batch m's backward: `grads` holds one message per reader, naming this stage's
        outputs; returns the gradients of the inputs other stages sent, and frees m's values."""
        saved = self._saved.pop(m)
        if not self.recompute and not self._regions:
            return self._backward(saved, grads)
        if not self.recompute:    # each recomputed run carries its micro-batch seed
            with unchanged_state(self.stage.module):
                return self._backward(saved, grads)
        # Buffers the forward writes (BatchNorm's running statistics) are put back once the
        # backward is done (autograd checks them until then): the first forward updated them.
        with unchanged_state(self.stage.module):
            return self._backward(self._recomputed(m, saved), grads)

    def _backward(self, saved: _Saved, grads: Iterable[Mapping[str, Sequence[torch.Tensor | None]]]
                  ) -> Grads:
        roots: list[torch.Tensor] = []
        root_grads: list[torch.Tensor | None] = []
        for message in grads:
            for name, output_grads in message.items():
                for leaf, g in zip(tensors(saved.outputs[name]), output_grads):
                    if g is not None and leaf.requires_grad:
                        roots.append(leaf)
                        root_grads.append(g)
        if saved.loss is not None and saved.loss.requires_grad:   # no parameters, no graph
            roots.append(saved.loss)
            root_grads.append(None)
        if roots:   # autograd sums the gradients of an output read by several stages
            torch.autograd.backward(roots, root_grads)
        return {name: [leaf.grad for leaf in tensors(saved.inputs[name])]
                for name in self.from_stages}


def _needing_grad(value: Any) -> Any:
    """A value computed without autograd, its floating-point tensors marked as needing grad, so
    that the stages reading them send their gradients back (the recomputed forward has the
    graph those gradients flow into)."""
    def mark(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().requires_grad_(True)
        return v
    return fx.node.map_aggregate(value, mark)


def _detach_leaf(value: Any) -> Any:
    """A received tensor as a fresh autograd leaf, so this stage's backward stops here."""
    def cut(v):
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return v.detach().requires_grad_(True)
        return v
    return fx.node.map_aggregate(value, cut)
