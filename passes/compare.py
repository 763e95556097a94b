"""Whether two outputs are the same, as a user comparing them would judge: one comparison for
every check fxpipe makes (the trace against the model, the pipeline against the model).

Containers compare by their keys and values (a `dict` equals an `OrderedDict` with the same
items), tensors by shape and within a tolerance scaled to their largest magnitude: the order of
sums changes with the number of threads, and random-init deep networks output values up to 1e12
that differ by a few epsilons relative, as the model differs from itself on another thread count.

Example (a rounding apart is the same; a dict and an OrderedDict of the same items too):

>>> import torch
>>> from collections import OrderedDict
>>> from fxpipe.passes.compare import difference
>>> x = torch.tensor([1.0, 2.0])
>>> difference({"y": x + 1e-7}, OrderedDict(y=x), None)
''
>>> difference({"y": x * 2}, {"y": x}, None)
"output 'y' differs by up to 2 (1 of its largest magnitude 2; allowed: 1.91e-06 of it + 1e-05)"
>>> print(difference({"y": x}, {"z": x}, None))
outputs differ in structure (...)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils._pytree as pytree


def difference(actual: Any, expected: Any, tolerance: float | None) -> str:
    """Why `actual` differs from `expected`, or "" when every leaf is close.

    A float leaf is close when no element differs by more than `tolerance` times the leaf's
    largest magnitude (default 16 epsilons of its dtype; the order of sums changes with the
    number of threads, by about an epsilon per term of magnitude), plus assert_close's atol.
    Compile's verification passes the model's own rounding instead, measured against float64
    (`fxpipe.planning.checks.rounding_tolerance`), which a deep or wide model makes larger.
    Containers compare as the user would: same keys, same values.
    """
    flat_expected = pytree.tree_flatten_with_path(expected)[0]
    flat_actual, actual_spec = pytree.tree_flatten(actual)
    if len(flat_actual) != len(flat_expected) or not same_structure(actual, expected):
        return f"outputs differ in structure ({actual_spec} vs {pytree.tree_structure(expected)})"
    for (path, e), a in zip(flat_expected, flat_actual):
        name = output_name(path)
        if isinstance(e, torch.Tensor) != isinstance(a, torch.Tensor):
            return f"{name} is a {type(a).__name__} instead of a {type(e).__name__}"
        if not isinstance(e, torch.Tensor):
            if not equal(a, e):
                return f"{name} is {a!r:.60} instead of {e!r:.60}"
            continue
        if a.shape != e.shape:
            return f"{name} has shape {tuple(a.shape)} instead of {tuple(e.shape)}"
        a = a.detach().to(e.device)
        e = e.detach()
        if not e.is_floating_point() and not e.is_complex():
            if not torch.equal(a, e):
                return f"{name} differs in {int((a != e).sum())} of {e.numel()} elements"
            continue
        if not torch.equal(torch.isnan(a), torch.isnan(e)):
            return f"{name} has NaN in other places"
        finite = torch.isfinite(e) & torch.isfinite(a)
        if not torch.equal(a[~finite].nan_to_num(), e[~finite].nan_to_num()):
            return f"{name} has infinities in other places"
        if not finite.any():
            continue
        diff = (a[finite].double() - e[finite].double()).abs().max().item()
        scale = e[finite].double().abs().max().item()
        rtol = 16 * torch.finfo(e.dtype).eps if tolerance is None else tolerance
        atol = 1e-7 if e.dtype == torch.float64 else 1e-5
        if diff > rtol * scale + atol:
            return (f"{name} differs by up to {diff:.3g} ({diff / scale if scale else math.inf:.3g} "
                    f"of its largest magnitude {scale:.3g}; allowed: {rtol:.3g} of it + {atol:g})")
    return ""


def equal(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:       # a value whose == does not give a bool
        return False


def same_structure(a: Any, b: Any) -> bool:
    """Same pytree structure, a dict and an OrderedDict with the same keys counting as equal."""
    paths_a = [p for p, _ in pytree.tree_flatten_with_path(a)[0]]
    paths_b = [p for p, _ in pytree.tree_flatten_with_path(b)[0]]
    return paths_a == paths_b


def output_name(path) -> str:
    """`output 'logits'`, `output 1.0`, or `the output` for a model returning one tensor."""
    if not path:
        return "the output"
    parts = []
    for key in path:
        if isinstance(key, pytree.MappingKey):
            parts.append(repr(key.key))
        elif isinstance(key, pytree.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, pytree.GetAttrKey):
            parts.append(repr(key.name))
        else:
            parts.append(str(key))
    return "output " + ".".join(parts)
