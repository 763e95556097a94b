"""The train-step contract, written once for every backend (`Pipeline` and `fxpipe.distributed`).

A train step splits the caller's inputs and target into micro-batches, computes each
micro-batch's loss on the last stage, and returns the whole batch's loss with the whole batch's
gradients in `.grad`:

- `reduction="mean"` (a `loss_fn` averaging over rows): each micro-batch's loss is weighted by
  its share of the rows (and, across replicas, by its replica's share), so the weighted sum is
  the whole batch's mean; `"sum"`: micro-batch losses are added.
- a `loss_fn` returning `(loss_sum, count)` (a mean over something other than rows): the step's
  loss is `sum(loss_sums) / sum(counts)`. The whole count is known only once every micro-batch
  ran forward, after 1F1B's first backwards, so this step's gradients accumulate apart
  (`DeferredScale`) and are scaled by one over it at the end.

A `"mean"` loss_fn that is not a mean over rows (a token loss whose rows count different
numbers of tokens: `cross_entropy(..., ignore_index=-100)`) would make that weighted sum differ
from the whole batch's loss. So a backend's first step of more than one micro-batch checks it
(`check_rows_mean`): the last stage keeps each micro-batch's output and loss, detached, and
compares loss_fn on the outputs and targets merged with the rows-weighted sum; where they differ
every participant gives `.grad` back as it was and raises `LossReductionError` naming the
`(loss_sum, count)` form. Across replicas each last stage checks its own shard's micro-batches.

What a backend adds is how the step's totals (the loss sum, the count, whether counts came)
are learnt by every participant: in one process they are already whole (`in_process`); across
ranks, one all-reduce. A backend passes that in as a function (`Totals`).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

import torch
import torch.nn.functional as F

from fxpipe.passes.compare import difference
from fxpipe.passes.errors import BatchError, InputError, LossError, LossReductionError
from fxpipe.passes.graph_values import tensors

from . import microbatch

# The step's totals summed over every participant: ([loss sum, count sum, last stages finding
# loss_fn no mean over rows] float64, counted).
Totals = Callable[[torch.Tensor, bool], tuple[torch.Tensor, bool]]


def in_process(totals: torch.Tensor, counted: bool) -> tuple[torch.Tensor, bool]:
    """One process computed every loss: its totals are the step's."""
    return totals, counted


def step_inputs(signature: Any, inputs: Any) -> dict[str, Any]:
    """The graph's input values by placeholder from `train_step`'s `inputs`: a tensor, a tuple
    of positional inputs or a dict of keyword inputs."""
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (
        (inputs if isinstance(inputs, tuple) else (inputs,)), {})
    try:
        return dict(zip(signature.placeholders, signature.flatten_inputs(args, kwargs)))
    except InputError as e:
        if not isinstance(inputs, dict):
            raise
        raise InputError(f"{e}\ntrain_step takes a dict as the model's keyword inputs; to "
                         f"pass one dict as the model's positional input, wrap it in a tuple: "
                         f"pipe.train_step((batch,), target, loss_fn)") from None


def check_loss(loss: Any, output: Any, expected: str = "a 0-d tensor") -> None:
    """Refuse a micro-batch loss that is not a 0-d tensor, or that autograd cannot reach the
    parameters from (the output requires grad, the loss does not)."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise LossError(f"loss_fn must return {expected}, got {loss!r:.80}")
    if not loss.requires_grad and any(t.requires_grad for t in tensors(output)):
        raise LossError(
            "loss_fn returned a loss that does not require grad, though the output does\n"
            "the model's output requires grad, so nothing would reach .grad; compute the loss "
            "from the output with torch ops (no .detach(), .item(), .data or torch.no_grad() "
            "in loss_fn)")


def micro_loss(loss_fn: Callable[[Any, Any], Any], output: Any, target: Any
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`loss_fn` on one micro-batch (or a stream's item): its loss, and its count where
    loss_fn returned `(loss_sum, count)` (None otherwise), refused as `check_loss` says."""
    loss, count = loss_fn(output, target), None
    if isinstance(loss, tuple) and len(loss) == 2:
        loss, count = loss[0], torch.as_tensor(loss[1]).detach()
    check_loss(loss, output, "a 0-d tensor (or a (loss_sum, count) pair)")
    return loss, count


def check_target(target: Any, rows_in: int, what: str = "train_step") -> None:
    """Refuse a target without rows, or with other rows than the inputs' (`rows_in`), and an
    empty batch (a mean over no rows is no loss)."""
    if not any(isinstance(t, torch.Tensor) and t.dim() > 0 for t in tensors(target)):
        raise InputError(f"{what} needs a target with one row per sample; got {target!r:.80}\n"
                         f"dimension 0 the batch, split into micro-batches with the inputs and "
                         f"given to loss_fn(output, target)")
    rows = microbatch.batch_size(target)
    if rows != rows_in:
        raise BatchError(f"{what}: the target has {rows} rows but the inputs have {rows_in}\n"
                         f"pass one target row per sample")
    if rows == 0:
        raise BatchError(f"{what}: {microbatch.EMPTY_BATCH}")


def check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise LossError(f"reduction={reduction!r} is not 'mean' or 'sum'\n"
                        f"use 'mean' or 'sum', as loss_fn reduces")


class StepLoss:
    """One train step's loss: the last stage's loss of each micro-batch (call it with the
    micro-batch and its graph values), and the step's loss and gradient scale (`finish`).

    `share` is this participant's share of the whole batch's rows (a replica's), `grads` the
    gradients a `(loss_sum, count)` step scales (or a refused step gives back);
    `check_rows_mean`: check that a `"mean"` loss_fn is a mean over rows (see the module's
    docstring), merging outputs along `output_dims`."""

    def __init__(self, loss_fn: Callable[[Any, Any], Any], signature: Any,
                 reduction: Literal["mean", "sum"], grads: "DeferredScale", share: float = 1.0,
                 *, check_rows_mean: bool = False, output_dims: Sequence[int | None] | None = None):
        check_reduction(reduction)
        self.loss_fn = loss_fn
        self.signature = signature
        self.reduction = reduction
        self.grads = grads
        self.share = share
        self.check_rows_mean = check_rows_mean and reduction == "mean"
        self.output_dims = output_dims
        self.targets: list[Any] = []
        self.weights: list[float] = []
        self.counts: dict[int, torch.Tensor] = {}   # kept on their device: no sync per micro-batch
        self.kept: dict[int, tuple[Any, torch.Tensor]] = {}   # checked: (output, loss), detached
        self.suggested = _TOKEN_LOSS.format(slicing=_AS_YOURS)   # the fix's code, once checked

    def split_targets(self, target: Any, chunks: int, device: torch.device, rows_in: int) -> None:
        """`target` in `chunks` micro-batches on `device` (the last stage's), one row per input
        row (`rows_in`), and each micro-batch's weight."""
        check_target(target, rows_in)
        self.take_targets(microbatch.split(target, chunks), device)

    def take_targets(self, targets: Sequence[Any], device: torch.device) -> None:
        """Each micro-batch's target, moved to `device` (the last stage's: the loss runs there,
        with the output), and each micro-batch's weight (its share of the rows, for "mean")."""
        self.targets = [microbatch.on_device(t, device) for t in targets]
        rows = [microbatch.batch_size(t) for t in self.targets]
        self.weights = [self.share * r / sum(rows) if self.reduction == "mean" else 1.0
                        for r in rows]
        self.check_rows_mean = self.check_rows_mean and len(targets) > 1

    def __call__(self, m: int, graph_values: dict[str, Any]) -> torch.Tensor:
        """Micro-batch m's loss, weighted (or its loss sum, its count kept)."""
        return self.of_output(m, self.signature.rebuild_outputs(graph_values))

    def of_output(self, m: int, output: Any) -> torch.Tensor:
        """Micro-batch m's loss from the model's `output` for it."""
        loss, count = micro_loss(self.loss_fn, output, self.targets[m])
        if count is not None:
            self.counts[m] = count
            self.grads.start()   # no backward ran yet: the last stage's comes first
        elif self.counts:
            raise LossError("loss_fn returned (loss_sum, count) for one micro-batch but not "
                            "for another\nreturn the same for every micro-batch")
        if self.counts:
            return loss
        if self.check_rows_mean:
            self.grads.start()   # a refused step gives `.grad` back as it was
            self.kept[m] = (microbatch.detached(output), loss.detach())
        return loss * self.weights[m]

    def _not_rows_mean(self) -> str:
        """Why loss_fn is not a mean over rows on this step's micro-batches (loss_fn on their
        outputs and targets merged against the rows-weighted sum of their losses), or ""."""
        if not self.check_rows_mean or len(self.kept) != len(self.targets):
            return ""
        outputs, losses = zip(*(self.kept[m] for m in range(len(self.targets))))
        rows = [microbatch.batch_size(t) for t in self.targets]
        weighted = sum(loss.double() * r / sum(rows) for loss, r in zip(losses, rows))
        output = microbatch.merge(list(outputs), self.output_dims)
        target = microbatch.merge(self.targets)
        with torch.no_grad():
            whole = self.loss_fn(output, target)
        if not isinstance(whole, torch.Tensor) or whole.dim() != 0:
            return ""     # refused as a micro-batch's loss would be
        if not difference(weighted.to(whole.dtype), whole, None):
            return ""
        self.suggested = token_loss_code(self.loss_fn, output, target, whole)
        return (f"on this batch of {sum(rows)} rows in {len(rows)} micro-batches, loss_fn gives "
                f"{whole.item():.6g} on the whole batch but its micro-batch losses weighted by "
                f"their rows give {weighted.item():.6g}")

    def finish(self, losses: Sequence[torch.Tensor], learn_totals: Totals = in_process
               ) -> torch.Tensor | None:
        """Learn the step's totals from every participant, scale this step's gradients by one
        over the whole count (a step of `(loss_sum, count)` losses) and give back what `.grad`
        held before; the step's loss where `losses` (this participant's, detached) are given.
        Summed where the losses are, as float64: nothing is read on the host (but by a first
        mean step's check, once: see the module's docstring). A step the check refuses raises
        `LossReductionError` on every participant, `.grad` given back as it was."""
        device = losses[0].device if losses else (
            next(iter(self.counts.values())).device if self.counts else torch.device("cpu"))
        not_rows_mean = self._not_rows_mean() if losses else ""
        parts = [torch.stack([x.to(device, torch.float64) for x in xs]).sum() if xs
                 else torch.zeros((), dtype=torch.float64, device=device)
                 for xs in (list(losses), list(self.counts.values()))]
        parts.append(torch.tensor(float(bool(not_rows_mean)), dtype=torch.float64, device=device))
        totals, counted = learn_totals(torch.stack(parts), bool(self.counts))
        loss_sum, count = totals[0], totals[1]
        if self.check_rows_mean and not counted and bool(totals[2] > 0):
            self.grads.give_back()
            raise LossReductionError(_NOT_ROWS_MEAN.format(
                what=not_rows_mean or "on this batch, a last stage found loss_fn no mean over "
                                      "rows (see its rank's error)",
                code=self.suggested))
        scale = torch.where(count > 0, count.reciprocal(), 0.0) if counted else None
        self.grads.finish(scale)
        if scale is not None:
            loss_sum = loss_sum * scale
        if not losses:
            return None
        return loss_sum.to(losses[0].dtype)


_NOT_ROWS_MEAN = (
    "loss_fn is not a mean over rows, as train_step(..., reduction='mean') needs\n"
    "the step weights each micro-batch's loss by its share of the rows, "
    "which gives the whole batch's loss only for a loss_fn averaging over rows; {what} (a token "
    "loss whose rows count different numbers of tokens, e.g. with ignore_index, averages over "
    "tokens)\nno gradient was written; let loss_fn return (loss_sum, count): the step's loss is "
    "then sum(loss_sums) / sum(counts), with the whole batch's gradients, e.g.\n{code}"
    "(a loss that mixes the rows of a batch cannot be split into micro-batches: use chunks=1)")

# The (loss_sum, count) form of a token loss; `{slicing}` is one of the lines below it.
_TOKEN_LOSS = (
    "    def loss_fn(out, labels):\n"
    "        logits = out.logits if hasattr(out, 'logits') else out\n"
    "{slicing}"
    "        loss_sum = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), "
    "ignore_index=-100, reduction='sum')\n"
    "        return loss_sum, (labels != -100).sum()\n")
_SHIFTED = "        logits, labels = logits[:, :-1], labels[:, 1:]   # the next token, as yours\n"
_AS_YOURS = "        # (slice logits and labels here as your loss_fn does: a causal LM shifts them)\n"


def token_loss_code(loss_fn: Callable[[Any, Any], Any], output: Any, target: Any,
                    loss: torch.Tensor) -> str:
    """The `(loss_sum, count)` code to suggest for `loss_fn`, whose `loss` on `output` and
    `target` is not a mean over rows: the token loss, shifted to the next token where that is
    what gives `loss` (a causal LM's), as is where that does, else with a line saying to slice
    as `loss_fn` does. Pasted as is, it trains on the user's own target."""
    logits = getattr(output, "logits", output)
    slicing = _AS_YOURS
    if (isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor)
            and logits.is_floating_point() and not target.is_floating_point()
            and logits.dim() == 3 and target.shape == logits.shape[:2]):
        with torch.no_grad():
            for line, (x, y) in ((_SHIFTED, (logits[:, :-1], target[:, 1:])),
                                 ("", (logits, target))):
                if (y != -100).any():
                    mean = F.cross_entropy(x.flatten(0, -2).float(), y.flatten(),
                                           ignore_index=-100)
                    if not difference(mean.to(loss.dtype), loss, None):
                        slicing = line
                        break
    return _TOKEN_LOSS.format(slicing=slicing)


class DeferredScale:
    """Gradients accumulated from `start()` on, scaled by a factor known only at `finish`.

    A (loss_sum, count) loss's gradient is 1 / (the count of the whole batch), known once every
    micro-batch ran forward, after 1F1B's first backwards. So the backwards accumulate into fresh
    `.grad`s, and `finish` adds them, scaled, to the gradients that were there before.
    """

    def __init__(self, leaves: Sequence[torch.Tensor]):
        self.leaves = list({id(t): t for t in leaves if t.requires_grad and t.is_leaf}.values())
        self.before: list[torch.Tensor | None] | None = None

    def start(self) -> None:
        if self.before is not None:
            return      # started already (a recomputed forward asks again)
        self.before = [t.grad for t in self.leaves]
        for t in self.leaves:
            t.grad = None

    def give_back(self) -> None:
        """Drop what accumulated since `start()`: `.grad` holds what it held before."""
        if self.before is None:
            return
        for t, before in zip(self.leaves, self.before):
            t.grad = before
        self.before = None

    def finish(self, scale: torch.Tensor | None = None) -> None:
        """Scale what accumulated since `start()` by `scale` (a 0-d tensor, read where each
        gradient lives, so the host waits for none; None: as it is) and add back what was
        there before."""
        if self.before is None:
            return
        for t, before in zip(self.leaves, self.before):
            new = t.grad
            if new is not None and scale is not None:
                new.mul_(scale.to(new.device))
            if before is not None and new is not None:
                t.grad = before.add_(new)
            elif before is not None:
                t.grad = before
        self.before = None
