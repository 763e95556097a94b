"""`assert_same_up_to_rounding`: values computed in another order of sums compared as such."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.passes.compare import equal, output_name

#: The default number of epsilons a float32 or float64 tensor may be off (see below).
EPSILONS = 64
#: The default number of epsilons a float16 or bfloat16 tensor may be off: of its own dtype,
#: whose epsilon is 2^-7 (bfloat16) or 2^-10 (float16) where float32's is 2^-23.
EPSILONS_16BIT = 4
#: The share of the set's largest magnitude that every tensor of the set may be off by at least
#: (times the epsilons): a gradient that is zero in exact arithmetic, made of terms as large as
#: the set's (a bias right before a training-mode BatchNorm), carries their rounding. Measured:
#: 7.5 float32 epsilons of the set on an AMD EPYC, against the 32 that half of 64 allows.
SET_FRACTION = 0.5
_16BIT = (torch.float16, torch.bfloat16)


def assert_same_up_to_rounding(actual: Any, expected: Any, *, epsilons: float = EPSILONS,
                               epsilons_16bit: float = EPSILONS_16BIT,
                               set_fraction: float = SET_FRACTION, scale: float | None = None,
                               what: str = "values") -> None:
    """Assert that `actual` equals `expected` up to the rounding of float arithmetic.

    A pipeline computes what the model computes in another order of sums: on other threads
    and thread counts, on micro-batches, split into stages, on another CPU's kernels (an AMD
    and an Intel core block a matrix product differently). Each sum is then off by about an
    epsilon of its terms' magnitude, not of its own, so neither a tolerance relative to each
    element nor a fixed absolute one (1e-5 is a thousand epsilons of a gradient of 0.01, and
    less than one of a gradient of 100) fits. The rule, for each float tensor `t` of the
    compared set:

        |actual - expected| <= epsilons * eps(dtype) * max(own(t), set_fraction * scale)

    element by element, where `own(t)` is the largest finite magnitude of `t` in `expected` and
    `actual`, and `scale` the largest over every tensor of the set together (or the magnitude
    of what the values are computed from, where given). With the defaults, 64 float32 epsilons
    of the tensor's own magnitude, and never less than 32 of the set's: a tensor whose
    gradient is zero in exact arithmetic (a bias right before a training-mode BatchNorm) is
    made of terms as large as the set's and carries their rounding, some 8 epsilons of the set
    measured on an AMD core. So a tensor off by more than 3.8e-6 of the set's largest
    magnitude fails, whatever its own size: a bias's gradient missing a micro-batch beside a
    10^4x larger convolution's is off by some 1e-4 of the set, 26x the allowance. Compare together what is computed together: every gradient of a model in one
    call (`grads_of`), its outputs in another, a loss alone; and compare the whole set, never a
    widened one (a thousand epsilons of a set whose largest gradient is 500 are 0.06: a
    BatchNorm bias's gradient 60% off passed that).

    `epsilons` (64 by default) covers the error growing with the depth of the sums and of the
    model: up to 22 epsilons of a tensor's own magnitude in the models tested here, where a
    real bug (a gradient zeroed, negated, doubled, or missing a micro-batch) moves a tensor by
    a fraction of its own magnitude, some 1e5 epsilons. A float16 or bfloat16 tensor is allowed
    `epsilons_16bit` (4) epsilons of its own dtype instead (so never less than 2 of the set's):
    its epsilon is already 2^16 (bfloat16) or 2^13 (float16) times float32's, and 64 of them
    would be half the tensor's magnitude. Pass more for a deep model whose outputs are much larger than its inputs, or a
    sum of very many terms.

    `actual` and `expected` are tensors, or containers of them (dicts compared by their keys, a
    `None` where a parameter has no gradient): the same structure, shapes and dtypes; integer
    and bool tensors equal, NaNs and infinities in the same places, non-tensor leaves equal.
    """
    flat_expected = {path: leaf for path, leaf in pytree.tree_flatten_with_path(expected)[0]}
    flat_actual = {path: leaf for path, leaf in pytree.tree_flatten_with_path(actual)[0]}
    if flat_actual.keys() != flat_expected.keys():
        missing = [output_name(p) for p in flat_expected if p not in flat_actual]
        extra = [output_name(p) for p in flat_actual if p not in flat_expected]
        raise AssertionError(f"{what}: structure differs (missing: {missing}, extra: {extra}; "
                             f"{pytree.tree_structure(actual)} vs "
                             f"{pytree.tree_structure(expected)})")
    if scale is None:
        scale = max((_largest(t) for t in [*flat_expected.values(), *flat_actual.values()]
                     if isinstance(t, torch.Tensor)), default=0.0)
    for path, e in flat_expected.items():
        a = flat_actual[path]
        name = f"{what}{'' if not path else ' ' + output_name(path).removeprefix('output ')}"
        if not isinstance(e, torch.Tensor) or not isinstance(a, torch.Tensor):
            assert not isinstance(e, torch.Tensor) and not isinstance(a, torch.Tensor), (
                f"{name}: a {type(a).__name__} instead of a {type(e).__name__}")
            assert equal(a, e), f"{name}: {a!r:.80} instead of {e!r:.80}"
            continue
        assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} instead of {tuple(e.shape)}"
        assert a.dtype == e.dtype, f"{name}: dtype {a.dtype} instead of {e.dtype}"
        a, e = a.detach().to(e.device), e.detach()
        if not e.is_floating_point() and not e.is_complex():
            assert torch.equal(a, e), (
                f"{name}: differs in {int((a != e).sum())} of {e.numel()} elements")
            continue
        assert torch.equal(torch.isnan(a), torch.isnan(e)), f"{name}: NaN in other places"
        finite = torch.isfinite(a) & torch.isfinite(e)
        assert torch.equal(a[~finite].nan_to_num(), e[~finite].nan_to_num()), (
            f"{name}: infinities in other places")
        if not finite.any():
            continue
        wide = torch.complex128 if e.is_complex() else torch.float64
        diff = (a[finite].to(wide) - e[finite].to(wide)).abs().max().item()
        count = epsilons_16bit if e.dtype in _16BIT else epsilons
        own = max(_largest(a), _largest(e))
        allowed = allowance(e.dtype, own, scale, epsilons=count, set_fraction=set_fraction)
        if diff > allowed:
            where = ((a.double() - e.double()).abs().nan_to_num(0.0).argmax().item()
                     if not e.is_complex() else 0)
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(where), e.shape))
            held = (f"{count:g} epsilons of its own largest magnitude {own:.3g}"
                    if own >= set_fraction * scale else
                    f"{count:g} epsilons of {set_fraction:g} of the set's largest magnitude "
                    f"{scale:.3g} (its own, {own:.3g}, is smaller)")
            raise AssertionError(
                f"{name} differs by up to {diff:.3g} (at {index}: {a[index].item():.6g} instead "
                f"of {e[index].item():.6g}), {diff / own if own else math.inf:.3g} of its own "
                f"largest magnitude; allowed: {held}, {allowed:.3g}")


def allowance(dtype: torch.dtype, own: float, scale: float, *, epsilons: float | None = None,
              set_fraction: float = SET_FRACTION) -> float:
    """How far a tensor of `dtype` whose largest magnitude is `own`, in a set whose largest is
    `scale`, may be off (`assert_same_up_to_rounding`'s rule; `epsilons` by default
    `EPSILONS_16BIT` for a 16-bit dtype, else `EPSILONS`)."""
    if epsilons is None:
        epsilons = EPSILONS_16BIT if dtype in _16BIT else EPSILONS
    return epsilons * torch.finfo(dtype).eps * max(own, set_fraction * scale)


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient by its name (None where it has none): the set of a model's
    gradients that `assert_same_up_to_rounding` compares together."""
    return {name: p.grad for name, p in module.named_parameters()}


def _largest(t: torch.Tensor) -> float:
    """The largest finite magnitude of a float tensor's elements (0 for others, or none)."""
    if not (t.is_floating_point() or t.is_complex()) or not t.numel():
        return 0.0
    finite = t.detach()[torch.isfinite(t.detach())]
    return finite.abs().max().double().item() if finite.numel() else 0.0
