"""Compile's checks on the example: the model's runs before placement, and the placed stages
checked against them.

`reference_of` makes every run of the model the checks need before any stage is placed: each
output's batch dimension (an output that reduces or mixes the batch refused by name), the
micro-batch check (the model computes the same on micro-batches as on the whole batch), and the
outputs the pipeline must reproduce (`fxpipe.reference`). `verify` then runs the plan's placed
stages as a pipeline call does (`runtime.calls.call_stages`), in order on the caller's thread, and
compares. `holding` is the model computing with a pipeline's values, which a mode switch
checks against. Both compare within the model's own rounding by default (`rounding_tolerance`:
4 times its float32 outputs' error against one float64 run on the example; a bf16 or fp16
model's outputs against one float32 run), so that another CPU's kernels, thread count or
micro-batch size pass, and a model that mixes samples across the batch does not; the plan
states the tolerance and where it came from (`Reference.stated_tolerance`).

A model built on the meta device is checked streamed, never held whole (`meta_reference`,
`streamed_stages`): its graph, node by node on materialised weights, gives the output dims and
the micro-batch check; the model's own forward on a structural copy whose modules are given
their own tensors just before they run (`streamed`) gives the outputs the stages, each run
node by node, must reproduce. Both read the same weights (`Recipe.materialize`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.codegen import placed_copy
from fxpipe.passes.compare import difference, output_name
from fxpipe.passes.errors import BatchError, FxpipeError, VerificationError
from fxpipe.passes.materialize import (Materialize, MaterializingInterpreter,
                                       release_freed_memory, run_graph)
from fxpipe.passes.randomness import microbatch_seeds

from . import microbatch
from .runtime.calls import call_stages, runtime_of
from .plan_data import Plan
from .reference import copied, run_per_microbatch, unchanged

if TYPE_CHECKING:
    from .api import Recipe


class _Holding(nn.Module):
    """`model` computing with other values for some of its tensors, by name
    (`torch.func.functional_call`), the model's own left as they are."""

    def __init__(self, model: nn.Module, values: dict[str, torch.Tensor]):
        super().__init__()
        self.model = model
        self.values = values

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.model, self.values, args, kwargs)


def holding(model: nn.Module, held: nn.Module) -> nn.Module:
    """`model` computing with the values `held` has for its tensors where they are other
    tensors (a pipeline's copies on stage devices), copied to where the model's are; the model
    itself where there are none."""
    own = dict([*model.named_parameters(remove_duplicate=False),
                *model.named_buffers(remove_duplicate=False)])
    copies: dict[int, torch.Tensor] = {}       # tied tensors keep one value
    values = {name: copies.setdefault(id(t), t.detach().to(own[name].device, copy=True))
              for name, t in [*held.named_parameters(remove_duplicate=False),
                              *held.named_buffers(remove_duplicate=False)]
              if name in own and own[name] is not t}
    return _Holding(model, values) if values else model


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
    (see `fxpipe.reference`), compared within `tolerance` or, by default, the model's own
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


ASKED = "as asked: verify_tolerance="

# Floating dtypes a model computes in at reduced precision, by the name the plan gives them.
REDUCED_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

# A reduced-precision model whose float32 run is further than this from its own outputs
# (relative to each output's largest magnitude) computes something else in float32.
_REDUCED_MAX_ERROR = 2.0 ** -3


def rounding_tolerance(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any],
                       devices: Sequence[str] = (), *, rounded: Any = None,
                       seed: int = 0) -> float | None:
    """The tolerance the model's own rounding calls for, relative to each output's largest
    magnitude; None where it cannot be measured (then `difference`'s default, 16 epsilons of
    each output's dtype). `measured_tolerance` says where it came from.

    A float32 model: 4 times the largest error of its float32 outputs against float64, at least
    16 float32 epsilons. The order of float32 sums changes with the number of threads, the
    CPU's kernels (an AMD and an Intel core block a convolution differently), the micro-batch
    size and the device, and a deep or wide model amplifies each epsilon: by how much is the
    model's own, so it is measured, not guessed. Two runs that differ only in rounding are each
    about that far from the exact values (what float64 stands for), so 4 times the float32
    run's error covers the difference between them; a model that mixes samples across the batch
    (a mean over it, batch statistics) differs between micro-batches and the whole batch by far
    more than its rounding, and is still refused.

    - On a CPU (or a GPU computing float32 as float32): `rounded`, the model's float32 outputs
      on the whole example in its own mode after `torch.manual_seed(seed)` (the run compile
      made already), against one more run, in float64, of the model as it is from the same
      seed. Without `rounded` (a model drawing random numbers, which float64 may draw
      otherwise), both runs are made in eval mode. An error above 2**-10 is not a CPU's float32
      rounding but a model computing something else in float64 (code branching on the dtype,
      other random draws): None.
    - Where a GPU may compute float32 in reduced precision (the model's or its inputs' GPU,
      else the first GPU in `devices`, those of the stages) with TF32 allowed
      (`torch.backends.cudnn.allow_tf32`, on by default for convolutions, or
      `torch.backends.cuda.matmul.allow_tf32`), it rounds float32 products to 10 bits: the
      model in eval mode on the example in float32 on that GPU, against the same in float64
      where the model is (never reduced).

    None too where the float64 run fails (code that fixes a dtype), or gives no float32 output,
    or where a float64 copy of its tensors would not fit in the host's available memory.

    A reduced-precision model (its parameters in bf16 or fp16, `REDUCED_DTYPES`), whose
    micro-batches round otherwise than its whole batch by its dtype's epsilons: 4 times the
    largest error of its outputs (of any floating dtype: logits cast to float32 too) against
    the same model run in float32 from the same seed, at least one epsilon of its dtype; where
    that cannot be measured, 16 of them. On the model's device (`rounded` as above).

    A graph on the meta device (`_GraphRun`), run on plausible values: against the model's own
    forward run module by module on the same values in the wider dtype (float32 for a
    reduced-precision model, float64 for a float32 one: `_GraphRun.wider`), so that no more than
    one module's tensors are widened at a time.
    """
    return measured_tolerance(model, args, kwargs, devices, rounded=rounded, seed=seed)[0]


def measured_tolerance(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any],
                       devices: Sequence[str] = (), *, rounded: Any = None,
                       seed: int = 0) -> tuple[float | None, str]:
    """`rounding_tolerance`, and where it came from as the plan states it: the rule measured
    (`the model's own bf16 rounding x4, measured against float32`), or why none was."""
    reduced_dtype = reduced_precision(model)
    if reduced_dtype is not None:
        return _reduced_tolerance(model, args, kwargs, reduced_dtype, rounded=rounded, seed=seed)
    tensors = [t for t in [*pytree.tree_leaves((args, kwargs)), *model.parameters(),
                           *model.buffers()] if isinstance(t, torch.Tensor)]
    gpu = next((t.device for t in tensors if t.device.type == "cuda"),
               next((torch.device(d) for d in devices if torch.device(d).type == "cuda"), None))
    inner = model.model if isinstance(model, _Holding) else model
    if isinstance(inner, _GraphRun):
        return _meta_tolerance(inner, args, kwargs, rounded=rounded, seed=seed)
    if any(t.device.type == "meta" for t in tensors):
        return None, "the model's rounding is not measured on the meta device"
    if not _copy_fits(tensors, (torch.float32,), torch.float64):
        return None, "the model's rounding is not measured: a float64 copy would not fit"
    reduced = _reduced_float32(tensors, gpu)
    inner, values = (model.model, model.values) if isinstance(model, _Holding) else (model, {})
    state = {**dict([*inner.named_parameters(), *inner.named_buffers()]), **values}
    double = lambda v: (v.detach().double() if isinstance(v, torch.Tensor)  # noqa: E731
                        and v.dtype == torch.float32 else v)
    onto = lambda v: (v.to(gpu) if isinstance(v, torch.Tensor) and gpu is not None  # noqa: E731
                      and reduced else v)
    if reduced:
        rounded = None              # its float32 run is the GPU's
    in_eval = rounded is None
    flags = {m: m.training for m in inner.modules()}
    try:
        if in_eval:
            inner.eval()
        with unchanged(inner):
            if rounded is None:
                torch.manual_seed(seed)
                rounded = torch.func.functional_call(
                    inner, {n: onto(t) for n, t in state.items()},
                    pytree.tree_map(onto, copied(args)), pytree.tree_map(onto, copied(kwargs)))
            torch.manual_seed(seed)
            exact = torch.func.functional_call(
                inner, {n: double(t) for n, t in state.items()},
                pytree.tree_map(double, copied(args)), pytree.tree_map(double, copied(kwargs)))
    except Exception:       # the model cannot run in float64: no measure of its rounding
        return None, "the model's rounding is not measured: it cannot run in float64"
    finally:
        for m, flag in flags.items():
            m.training = flag
    return _float32_tolerance(rounded, exact, reduced,
                              f"TF32 rounding on {gpu}" if reduced else "float32 rounding")


def _float32_tolerance(rounded: Any, exact: Any, reduced: bool, rule: str
                       ) -> tuple[float | None, str]:
    """4 times the largest error of `rounded`'s float32 outputs against `exact` (float64), at
    least 16 float32 epsilons (see `rounding_tolerance`), and where it came from."""
    errors = _errors(rounded, exact, (torch.float32,))
    if not errors:
        return None, "the model's rounding is not measured: no float32 output"
    if not reduced and max(errors) > 2.0 ** -10:
        return None, ("the model's rounding is not measured: its float64 run computes "
                      "something else")
    least, measured = 16 * torch.finfo(torch.float32).eps, 4 * max(errors)
    if measured < least:
        return least, (f"16 float32 epsilons, the least; the model's own {rule} x4, measured "
                       f"against float64, is {measured:.2g}")
    return measured, f"the model's own {rule} x4, measured against float64"


def _meta_tolerance(graph: _GraphRun, args: Sequence[Any], kwargs: Mapping[str, Any], *,
                    rounded: Any, seed: int) -> tuple[float | None, str]:
    """`measured_tolerance` of a float32 graph on the meta device: its float32 run on plausible
    values (`rounded`) against the model's own forward on the same values in float64, module by
    module (`_GraphRun.wider`), so no more than one module's tensors are widened at a time."""
    if graph.wider is None or rounded is None:
        return None, "the model's rounding is not measured on the meta device"
    double = lambda v: (v.detach().double() if isinstance(v, torch.Tensor)  # noqa: E731
                        and v.dtype == torch.float32 else v)
    try:
        run = graph.wider()
        with unchanged(run):
            torch.manual_seed(seed)
            exact = run(*pytree.tree_map(double, copied(args)),
                        **pytree.tree_map(double, copied(kwargs)))
    except FxpipeError:
        raise
    except Exception:       # the model cannot run in float64 module by module
        return None, "the model's rounding is not measured: it cannot run in float64"
    return _float32_tolerance(rounded, exact, False, "float32 rounding")


def reduced_precision(model: nn.Module) -> torch.dtype | None:
    """The reduced precision `model` computes in (`REDUCED_DTYPES`): the coarsest one among its
    floating parameters (its buffers where it has none), None where it has none (float32)."""
    tensors = [t for t in model.parameters() if t.is_floating_point()] or \
        [t for t in model.buffers() if t.is_floating_point()]
    dtypes = {t.dtype for t in tensors} & set(REDUCED_DTYPES)
    return max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else None


def _reduced_tolerance(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any],
                       dtype: torch.dtype, *, rounded: Any, seed: int) -> tuple[float, str]:
    """`measured_tolerance` of a model computing in `dtype` (bf16, fp16): against float32."""
    name = REDUCED_DTYPES[dtype]
    # Unmeasured, 16 of its epsilons (bf16: 0.125); measured, its own rounding stands down to
    # one epsilon (bf16: 0.0078): a floor of 16 would let a mixing of samples of up to an
    # eighth of the outputs pass as rounding.
    unmeasured_least, least = 16 * torch.finfo(dtype).eps, torch.finfo(dtype).eps

    def unmeasured(why: str) -> tuple[float, str]:
        return unmeasured_least, (f"16 {name} epsilons, the default for a {name} model: its "
                                  f"rounding {why}")
    widen = lambda v: (v.detach().float() if isinstance(v, torch.Tensor)  # noqa: E731
                       and v.dtype in REDUCED_DTYPES else v)
    inner, values = (model.model, model.values) if isinstance(model, _Holding) else (model, {})
    if isinstance(inner, _GraphRun):
        if inner.wider is None or rounded is None:
            return unmeasured("is not measured on the meta device")
        run, state = inner.wider(), None
    else:
        tensors = [t for t in [*pytree.tree_leaves((args, kwargs)), *inner.parameters(),
                               *inner.buffers()] if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" for t in tensors):
            return unmeasured("is not measured on the meta device")
        if not _copy_fits(tensors, tuple(REDUCED_DTYPES), torch.float32):
            return unmeasured("is not measured: a float32 copy would not fit")
        run = inner
        state = {**dict([*inner.named_parameters(), *inner.named_buffers()]), **values}
    flags = {m: m.training for m in inner.modules()}
    try:
        if rounded is None:
            inner.eval()
            with unchanged(inner):
                torch.manual_seed(seed)
                rounded = torch.func.functional_call(inner, state, copied(args), copied(kwargs))
        with unchanged(run):
            torch.manual_seed(seed)
            wide_args, wide_kwargs = (pytree.tree_map(widen, copied(a)) for a in (args, kwargs))
            exact = run(*wide_args, **wide_kwargs) if state is None else \
                torch.func.functional_call(run, {n: widen(t) for n, t in state.items()},
                                           wide_args, wide_kwargs)
    except Exception:       # the model cannot run in float32: no measure of its rounding
        return unmeasured("is not measured: the model cannot run in float32")
    finally:
        for m, flag in flags.items():
            m.training = flag
    errors = _errors(rounded, exact, (torch.float32, *REDUCED_DTYPES))
    if not errors:
        return unmeasured("is not measured: no floating output")
    if max(errors) > _REDUCED_MAX_ERROR:
        return unmeasured("is not measured: its float32 run computes something else")
    measured = 4 * max(errors)
    if measured < least:
        return least, (f"one {name} epsilon, the least for a {name} model; its own rounding x4, "
                       f"measured against float32, is {measured:.2g}")
    return measured, f"the model's own {name} rounding x4, measured against float32"


def _errors(rounded: Any, exact: Any, dtypes: Sequence[torch.dtype]) -> list[float]:
    """The largest error of each output of `rounded` of one of `dtypes` against the same output
    of `exact` (more precise), relative to that output's largest magnitude; [] where the two
    differ in structure or an error is not finite."""
    if pytree.tree_structure(rounded) != pytree.tree_structure(exact):
        return []
    errors = [((r.double() - e.to(r.device).double()).abs().max() /
               e.double().abs().max().clamp_min(1e-30)).item()
              for r, e in zip(pytree.tree_leaves(rounded), pytree.tree_leaves(exact))
              if isinstance(r, torch.Tensor) and r.dtype in dtypes
              and isinstance(e, torch.Tensor) and e.is_floating_point() and r.numel()
              and r.shape == e.shape]
    return errors if all(math.isfinite(e) for e in errors) else []


def _copy_fits(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype],
               to: torch.dtype) -> bool:
    """Whether a copy in `to` of those of `tensors` in `dtypes` fits in half the memory the
    host has available (when it cannot tell: it does)."""
    needed = sum(t.numel() * to.itemsize for t in tensors if t.dtype in dtypes)
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        available = kib * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return True
    return needed <= available / 2


def _reduced_float32(tensors: Sequence[torch.Tensor], gpu: torch.device | None) -> bool:
    """Whether the float32 work among `tensors` may run in TF32 on `gpu`: there is a GPU and
    float32 work, and torch lets convolutions or matrix products there use TF32."""
    return gpu is not None and any(t.dtype == torch.float32 for t in tensors) and \
        (torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32)


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


class _GraphRun(nn.Module):
    """A graph holding meta tensors called as the model is: node by node, each node's weights
    materialised before it runs and dropped after (`fxpipe.passes.materialize.run_graph`).
    `wider` makes the model run module by module on the same values in a wider dtype (float32
    for a reduced-precision model, float64 for a float32 one), which `rounding_tolerance`
    measures the graph's rounding against."""

    def __init__(self, gm: nn.Module, materialize: Materialize, device: torch.device,
                 wider: Callable[[], nn.Module] | None = None):
        super().__init__()
        self.gm, self.materialize, self.device = gm, materialize, device
        self.wider = wider

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return run_graph(self.gm, args, kwargs, self.materialize, self.device)


class _StageRun(nn.Module):
    """A stage's GraphModule holding meta tensors, run node by node on materialised weights."""

    def __init__(self, module: nn.Module, materialize: Materialize, device: torch.device):
        super().__init__()
        self.module, self.materialize, self.device = module, materialize, device

    def forward(self, *inputs: Any) -> Any:
        return MaterializingInterpreter(self.module, materialize=self.materialize,
                                        device=self.device).run(*inputs)


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def streamed(model: nn.Module, materialize: Materialize, device: torch.device) -> nn.Module:
    """A structural copy of `model` that runs its own forward module by module: each module a
    shallow copy with its own tables (tensors, children, hooks), whose meta tensors are given
    real values on `device` by a forward pre-hook and put back to meta by a forward hook, so at
    most the running modules' own tensors are held. `model` is never changed. A forward that
    reads another module's tensor directly (a parent reading `self.child.weight`) meets a meta
    tensor and raises."""
    names: dict[int, str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), path)
    copies: dict[int, nn.Module] = {}

    def copy_of(module: nn.Module) -> nn.Module:
        if id(module) in copies:
            return copies[id(module)]
        copy = type(module).__new__(type(module))
        copy.__dict__.update(module.__dict__)
        copies[id(module)] = copy
        for table in ("_parameters", "_buffers", *_HOOK_TABLES):
            if table in module.__dict__:
                copy.__dict__[table] = type(module.__dict__[table])(module.__dict__[table])
        copy.__dict__["_modules"] = {name: None if child is None else copy_of(child)
                                     for name, child in module._modules.items()}
        own = {name: t for table in (copy._parameters, copy._buffers)
               for name, t in table.items() if t is not None and t.is_meta}
        if own:
            _stream_tensors(copy, own, names[id(module)], materialize, device)
        return copy
    return copy_of(model)


def _stream_tensors(module: nn.Module, own: dict[str, torch.Tensor], path: str,
                    materialize: Materialize, device: torch.device) -> None:
    """Hooks giving `module` (a copy) real values of its `own` meta tensors around its forward."""
    like = {f"{path}.{name}" if path else name: t for name, t in own.items()}

    def give(*_: Any) -> None:
        values = materialize(like, device)
        for (name, t), full in zip(own.items(), like):
            if name in module._parameters:
                module._parameters[name] = nn.Parameter(values[full],
                                                        requires_grad=t.requires_grad)
            else:
                module._buffers[name] = values[full]

    def take(*_: Any) -> None:
        for name, t in own.items():
            (module._parameters if name in module._parameters else module._buffers)[name] = t
        release_freed_memory()
    module.register_forward_pre_hook(give)
    module.register_forward_hook(take, always_call=True)


def meta_reference(model: nn.Module, gm: nn.Module, recipe: Recipe, chunks: int, verify: bool,
                   tolerance: float | None, device: torch.device) -> tuple[Reference, str]:
    """`reference_of` for a model on the meta device (see the module docstring), and why its
    outputs could not be checked ("" when they can be)."""
    materialize = recipe.materialize
    dims = _output_dims_on_meta(gm, recipe, chunks) if chunks > 1 and not verify else None
    # The graph's rounding is measured against the model's own forward in a wider dtype
    # (float32 for a reduced-precision model, float64 for a float32 one), module by module, on
    # the same plausible values: one module's tensors widened at a time.
    wide = torch.float32 if reduced_precision(model) is not None else torch.float64
    reference = Reference(dims) if dims is not None else reference_of(
        _GraphRun(gm, recipe.plausible, device,
                  lambda: streamed(model, _widened(recipe.plausible, wide), device)),
        recipe, chunks, verify, tolerance)
    if not reference.verify:
        return reference, ""
    copy = streamed(model, materialize, device)
    try:
        with unchanged(copy):
            torch.manual_seed(0)
            parts = run_per_microbatch(copy, recipe.args, recipe.kwargs, chunks,
                                       seeds=microbatch_seeds(chunks),
                                       batch_dims=recipe.input_dims)
    except FxpipeError:          # the weights' own (a tensor missing from a checkpoint)
        raise
    except Exception as e:       # the model's forward cannot run module by module
        return replace(reference, verify=False), (
            f"no (the model's forward cannot run one module at a time on materialised weights: "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})")
    return replace(reference, expected=microbatch.merge(parts, reference.output_dims)), ""


def _widened(materialize: Materialize, wide: torch.dtype) -> Materialize:
    """`materialize` giving its floating values narrower than `wide` in `wide`."""
    def read(like: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        return {name: value.to(wide) if value.is_floating_point() and
                torch.finfo(value.dtype).eps > torch.finfo(wide).eps else value
                for name, value in materialize(like, device).items()}
    return read


def _output_dims_on_meta(gm: nn.Module, recipe: Recipe, chunks: int
                         ) -> tuple[int | None, ...] | None:
    """Each output's batch dimension, as `reference_of` finds it, from the graph run on the
    meta device (shapes alone: no weight read, no op computed); None where that cannot tell:
    an op with no meta kernel, or naming another device, or an output whose shape does not
    follow the batch (a constant and a reduction differ in their values alone)."""
    args, kwargs, dims = recipe.args, recipe.kwargs, recipe.input_dims
    parts = microbatch.split((args, kwargs), chunks, dims)
    shapes = placed_copy(gm, "meta")         # its ops naming a device name meta

    def on_meta(batch: Any) -> Any:
        moved = pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v,
                                batch)
        return run_graph(shapes, *moved, None, "meta")
    try:
        whole, outputs = on_meta((args, kwargs)), [on_meta(part) for part in parts]
    except Exception:
        return None
    columns = zip(*(pytree.tree_leaves(o) for o in outputs))
    if not all(isinstance(w, torch.Tensor) and any(c.shape != w.shape for c in column)
               for w, column in zip(pytree.tree_leaves(whole), columns)):
        return None
    try:
        return tuple(_output_dims(whole, outputs, [microbatch.batch_size(p, dims) for p in parts],
                                  None))
    except BatchError:         # the run on values says it with the outputs' values
        return None


def streamed_stages(plan: Plan, materialize: Materialize) -> Plan:
    """`plan` with each stage run node by node on materialised weights, for `verify`."""
    return replace(plan, stages=tuple(
        replace(stage, module=_StageRun(stage.module, materialize, stage.device))
        for stage in plan.stages))
