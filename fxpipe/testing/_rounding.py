"""`assert_same_up_to_rounding`: values computed in another order of sums compared as such."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.passes.compare import equal, output_name

#: The default number of epsilons of the compared set's largest magnitude (see below).
EPSILONS = 64


def assert_same_up_to_rounding(actual: Any, expected: Any, *, epsilons: float = EPSILONS,
                               scale: float | None = None, what: str = "values") -> None:
    """Assert that `actual` equals `expected` up to the rounding of float arithmetic.

    A pipeline computes what the model computes in another order of sums: on other threads
    and thread counts, on micro-batches, split into stages, on another CPU's kernels (an AMD
    and an Intel core block a matrix product differently). Each sum is then off by about an
    epsilon of its terms' magnitude, not of its own: an element that is small because large
    terms cancel (the gradient of a bias right before a BatchNorm, zero in exact arithmetic)
    carries the rounding of the large ones. So the tolerance is not relative to each element,
    nor a fixed absolute one (1e-5 is a thousand epsilons of a gradient of 0.01, and less than
    one of a gradient of 100): every float element must be within `epsilons` epsilons of its
    dtype times the compared set's scale, the largest finite magnitude in `expected` and
    `actual` over all their leaves together (`scale`, where given: the magnitude of what the
    values are computed from). Compare together what is computed together: every gradient
    of a model in one call (a dict), its outputs in another, a loss alone.

    `epsilons` (64 by default) covers the error growing with the depth of the sums and of the
    model, a few epsilons in the models tested here; a real bug (a gradient missing a
    micro-batch, a wrong stage's output) differs by a fraction of the scale, some 1e5 epsilons.
    Pass more for a deep model whose outputs are much larger than its inputs, or a sum of very
    many terms.

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
        diff = (a[finite].to(torch.complex128 if e.is_complex() else torch.float64)
                - e[finite].to(torch.complex128 if e.is_complex() else torch.float64)
                ).abs().max().item()
        allowed = epsilons * torch.finfo(e.dtype).eps * scale
        if diff > allowed:
            where = ((a.double() - e.double()).abs().nan_to_num(0.0).argmax().item()
                     if not e.is_complex() else 0)
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(where), e.shape))
            raise AssertionError(
                f"{name} differs by up to {diff:.3g} (at {index}: {a[index].item():.6g} instead "
                f"of {e[index].item():.6g}), {diff / scale if scale else math.inf:.3g} of the "
                f"set's largest magnitude {scale:.3g}; allowed: {epsilons:g} epsilons of it, "
                f"{allowed:.3g}")


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
