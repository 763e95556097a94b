"""The model's runs on the example before anything is placed (`reference_of`: each output's
batch dimension, the micro-batch check, the outputs to reproduce, in a `Reference`), and the
plan's placed stages checked against them (`verify`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.compare import difference, output_name
from fxpipe.passes.errors import BatchError, VerificationError
from fxpipe.passes.randomness import microbatch_seeds

from ...runtime import microbatch
from ...runtime.calls import call_stages, runtime_of
from ...plans.plan_data import Plan
from ..reference import copied, run_per_microbatch, unchanged
from .rounding import ASKED, measured_tolerance

if TYPE_CHECKING:
    from ..recipe import Recipe


@dataclass(frozen=True)
class Reference:
    """What the model computed on the example before anything was placed: each output's batch
    dimension (None for one micro-batch) and, to verify against, its outputs run once per
    micro-batch, merged, and whether it draws random numbers."""

    output_dims: tuple[int | None, ...] | None
    expected: Any = None
    verify: bool = False
    random: bool = False
    tolerance: float | None = None      # the one asked, or widened by `rounding_tolerance`
    tolerance_source: str = ""          # where it came from, as the plan states it

    def stated_tolerance(self) -> dict[str, Any]:
        """The plan's fields stating the tolerance its outputs were checked within (none where
        they were not checked)."""
        if not self.verify:
            return {}
        return {"verify_tolerance": self.tolerance,
                "verify_tolerance_source": self.tolerance_source}


def reference_of(model: nn.Module, recipe: Recipe, chunks: int, verify: bool,
                 tolerance: float | None, devices: Sequence[str] = ()) -> Reference:
    """The model's runs that compile's checks need, all made before any of its tensors is
    placed on a stage device: each output's batch dimension, the micro-batch check
    (`_check_batch_independent`), and with `verify` the outputs the pipeline must reproduce
    (see `fxpipe.planning.reference`), compared within `tolerance` or, by default, the model's own
    rounding measured against float64 (`rounding_tolerance`: on a CPU from the float32 run
    already made on the whole example and one float64 run; where the stages' `devices` or the
    model's may compute float32 in TF32, on that GPU). On copies of the example, from fixed
    seeds; the model's buffers and the caller's random state are left as they were."""
    args, kwargs, dims = recipe.args, recipe.kwargs, recipe.input_dims
    if chunks == 1 and not verify:
        return Reference(None)
    with unchanged(model):
        torch.manual_seed(0)
        seeds = microbatch_seeds(chunks)        # those the pipeline draws after manual_seed(0)
        parts = run_per_microbatch(model, args, kwargs, chunks, seeds=seeds, batch_dims=dims)
    whole = parts[0]                            # one micro-batch: the whole example
    if chunks > 1:
        with unchanged(model):
            torch.manual_seed(seeds[0])
            whole = model(*copied(args), **copied(kwargs))
    random = verify and _draws_random_numbers(model, args, kwargs)
    source = ASKED if tolerance is not None else ""
    if verify and tolerance is None:
        # A model drawing random numbers may draw others in float64: measured in eval mode.
        tolerance, source = measured_tolerance(model, args, kwargs, devices,
                                               rounded=None if random else whole, seed=seeds[0])
    output_dims = None
    if chunks > 1:
        rows = [microbatch.batch_size(p, dims)
                for p in microbatch.split((args, kwargs), chunks, dims)]
        output_dims = tuple(_output_dims(whole, parts, rows, tolerance))
    if not verify:
        return Reference(output_dims)
    if chunks > 1:
        _check_batch_independent(model, recipe, output_dims, tolerance, whole, parts, random)
    return Reference(output_dims, microbatch.merge(parts, output_dims), True, random, tolerance,
                     source)


def verify(plan: Plan, recipe: Recipe, reference: Reference,
           tolerance: float | None) -> None:
    """With `verify`, the plan's placed stages checked against the model's outputs
    (`reference_of`): the call a pipeline makes (`call_stages`), on a copy of the example from
    the same seed, every stage in turn on the caller's thread (`Runtime.in_order`: no Pipeline,
    no worker thread), the stages' buffers put back after."""
    if not reference.verify:
        return
    runtime = runtime_of(plan)
    with unchanged(plan.graph), runtime.in_order():
        torch.manual_seed(0)
        actual = call_stages(plan, runtime, copied(recipe.args), copied(recipe.kwargs))
    problem = difference(actual, reference.expected,
                         tolerance if reference.tolerance is None else reference.tolerance)
    if problem and reference.random:
        raise VerificationError(
            f"the pipeline differs from the model run per micro-batch under the same seeds\n"
            f"{problem}\nthe model draws random numbers (two runs from different seeds differ), "
            f"and the pipeline drew other ones: compile with verify=False to accept it, and "
            f"please report it as a bug in fxpipe with the model")
    if problem:
        raise VerificationError(
            f"the pipeline does not reproduce the model on the example inputs\n{problem}\nif this "
            f"is rounding (the number of threads changes the order of sums), relax the check with "
            f"verify_tolerance= (a tolerance relative to each output's largest value) or skip it "
            f"with verify=False; otherwise this is a bug in fxpipe: please report it with the "
            f"model")


def _output_dims(whole: Any, parts: Sequence[Any], rows: Sequence[int],
                 tolerance: float | None) -> list[int | None]:
    """Each output leaf's batch dimension, the one whose size follows the batch size.

    None for a leaf that is the same on every micro-batch and on the whole batch (a constant);
    an output whose shape does not follow the batch, or follows it in several dimensions, is
    refused by name: it reduces or mixes the batch, and micro-batches cannot be merged into it.
    """
    flat_whole, spec = pytree.tree_flatten_with_path(whole)
    flat_parts = [pytree.tree_flatten(p) for p in parts]
    if any(other != pytree.tree_structure(whole) for _, other in flat_parts):
        raise BatchError("the model's output structure differs between the whole batch and a "
                         "micro-batch\nreturn the same structure for every batch, or use chunks=1")
    total = sum(rows)
    dims: list[int | None] = []
    for i, (path, w) in enumerate(flat_whole):
        column = [leaves[i] for leaves, _ in flat_parts]
        if not isinstance(w, torch.Tensor):
            dims.append(None)
            continue
        name = output_name(path)
        if any(not isinstance(c, torch.Tensor) or c.dim() != w.dim() for c in column):
            raise BatchError(f"{name} changes its number of dimensions with the batch size\n"
                             f"return tensors whose batch dimension stays, or use chunks=1")
        changed = [d for d in range(w.dim()) if any(c.shape[d] != w.shape[d] for c in column)]
        shape = "(" + ", ".join("B" if d in changed else str(s) for d, s in enumerate(w.shape)) + \
                ("," if w.dim() == 1 else "") + ")"
        if not changed:
            if all(not difference(c, w, tolerance) for c in column):
                dims.append(None)     # does not depend on the batch: given once
                continue
            raise BatchError(
                f"{name} of shape {tuple(w.shape)} reduces over the batch\nits shape does not "
                f"follow the batch size, so it cannot be rebuilt from micro-batches\nreturn "
                f"per-sample values and reduce after the pipeline, or use chunks=1{_NOT_DIM_0}"
                f"{_TRAIN_STEP if w.dim() == 0 else ''}")
        d = changed[0]
        if len(changed) > 1 or any(w.shape[d] * r != c.shape[d] * total
                                   for c, r in zip(column, rows)):
            raise BatchError(
                f"{name} of shape {shape} mixes the batch (B: the batch size)\neach sample's "
                f"values depend on the others, so micro-batches cannot be merged into it\n"
                f"compute it after the pipeline from per-sample outputs, or use "
                f"chunks=1{_NOT_DIM_0}")
        dims.append(d)
    return dims


_NOT_DIM_0 = (" (if the batch is not dimension 0 of every input, as in a sequence-first RNN, say "
              "which dimension it is with batch_dims=)")


_TRAIN_STEP = (
    "\nto train on a loss (a model's own, computed from labels given as inputs), compile without "
    "the labels and compute it in pipe.train_step(inputs, labels, loss_fn) from the outputs: "
    "loss_fn runs on each micro-batch and the step returns the whole batch's loss and "
    "gradients. For a language model's token loss (-100 ignored) return (loss_sum, count), e.g. "
    "for a causal LM, as its own loss shifts the labels:\n"
    "    def loss_fn(out, labels):\n"
    "        logits, labels = out.logits[:, :-1], labels[:, 1:]\n"
    "        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), "
    "ignore_index=-100, reduction='sum')\n"
    "        return loss_sum, (labels != -100).sum()\n"
    "    loss = pipe.train_step({'input_ids': ids}, labels, loss_fn)")


def _check_batch_independent(model: nn.Module, recipe: Recipe, output_dims, tolerance,
                             whole: Any, parts: Sequence[Any], random: bool) -> None:
    """Refuse a model whose output on micro-batches differs from its output on the whole batch.

    Checked in eval mode (BatchNorm in training mode normalises each micro-batch by design, as
    in GPipe), and only where the model is deterministic there. `whole` and `parts` are the
    runs already made in the model's mode, reused when that is eval; `random`: whether the model
    draws random numbers in its mode.
    """
    args, kwargs, dims = recipe.args, recipe.kwargs, recipe.input_dims
    flags = {m: m.training for m in model.modules()}
    try:
        model.eval()
        if any(flags.values()):
            with unchanged(model):
                whole = model(*copied(args), **copied(kwargs))
                parts = run_per_microbatch(model, args, kwargs, len(parts), batch_dims=dims)
        try:
            merged = microbatch.merge(parts, output_dims)
        except BatchError:      # eval mode returns other outputs than the mode checked
            return
        problem = difference(merged, whole, tolerance)
        if not problem or (random if not any(flags.values()) else
                           _draws_random_numbers(model, args, kwargs)):
            return
    finally:
        for m, flag in flags.items():
            m.training = flag
    raise BatchError(
        f"the model mixes samples across the batch\non micro-batches it computes something else "
        f"than on the whole batch ({problem})\nif the batch is not dimension 0 of every input "
        f"(e.g. a sequence-first RNN), say which it is with batch_dims=; if the model normalises "
        f"or reduces over the batch, use chunks=1, or verify=False to accept micro-batch "
        f"semantics as GPipe does")


def _draws_random_numbers(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether two runs of the model from different seeds differ."""
    with unchanged(model):
        torch.manual_seed(1)
        first = model(*copied(args), **copied(kwargs))
    with unchanged(model):
        torch.manual_seed(2)
        second = model(*copied(args), **copied(kwargs))
    return bool(difference(first, second, 0.0))
