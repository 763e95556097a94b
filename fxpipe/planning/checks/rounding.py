"""The tolerance compile's checks compare within: by default the model's own rounding, measured
(`rounding_tolerance`; `measured_tolerance` says where it came from, as the plan states it). A
float32 model's outputs against one float64 run, a bf16 or fp16 model's (`reduced_precision`)
against one float32 run, a graph on the meta device's against the model streamed in the wider
dtype.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.passes.device import is_gpu, reduces_float32
from fxpipe.passes.errors import FxpipeError

from ..reference import copied, unchanged
from .runs import _GraphRun, _Holding


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
    gpu = next((t.device for t in tensors if is_gpu(t.device)),
               next((torch.device(d) for d in devices if is_gpu(d)), None))
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
        reduces_float32(gpu)

