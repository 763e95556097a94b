"""Split inputs into micro-batches along dimension 0, and merge outputs back.

Inputs and outputs are pytrees (nested tuples, lists, dicts, dataclass-like containers that
`torch.utils._pytree` knows) whose leaves are tensors or other values. Splitting one example:

    {"x": tensor(6, 3), "mask": tensor(6), "scale": 0.5}, chunks=4
    -> batch size 6 (every tensor with a dimension must agree), rows per chunk [2, 2, 1, 1]
    -> [{"x": x[0:2], "mask": mask[0:2], "scale": 0.5}, ..., {"x": x[5:6], ...}]

Values without a batch dimension (Python scalars, 0-d tensors) are given whole to every chunk.
`merge` is the inverse: tensors are concatenated along dimension 0; 0-d tensors and other values
must be equal in every chunk.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from passes.errors import BatchError


def batch_size(inputs: Any) -> int:
    """The size of dimension 0 shared by every tensor input that has one."""
    sizes = {}
    for path, leaf in pytree.tree_flatten_with_path(inputs)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            sizes.setdefault(leaf.shape[0], pytree.keystr(path))
    if not sizes:
        raise BatchError("no input has a batch dimension to split into micro-batches: pass at least "
                         "one tensor whose dimension 0 is the batch, or use chunks=1")
    if len(sizes) > 1:
        found = ", ".join(f"{where} has {n} rows" for n, where in sizes.items())
        raise BatchError(f"inputs disagree on the batch size ({found}): every tensor input is split "
                         f"along dimension 0, so all must have the same number of rows")
    return next(iter(sizes))


def split(inputs: Any, chunks: int) -> list[Any]:
    """`inputs` cut into `chunks` pytrees of the same structure, in batch order."""
    if chunks < 1:
        raise BatchError(f"chunks={chunks}: the number of micro-batches must be at least 1")
    rows = batch_size(inputs)
    if rows < chunks:
        raise BatchError(f"a batch of {rows} rows cannot be split into {chunks} micro-batches: "
                         f"pass a batch of at least {chunks} rows, or use chunks<={rows}")
    leaves, spec = pytree.tree_flatten(inputs)
    columns = [torch.tensor_split(leaf, chunks) if _batched(leaf) else [leaf] * chunks
               for leaf in leaves]
    return [pytree.tree_unflatten([column[c] for column in columns], spec) for c in range(chunks)]


def merge(outputs: Sequence[Any]) -> Any:
    """The inverse of `split`: one pytree from per-chunk pytrees of the same structure."""
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    for leaves, other in flat[1:]:
        if other != spec:
            raise BatchError(f"micro-batch outputs differ in structure ({other} vs {spec}): the "
                             f"model must return the same structure for every batch")
    merged = []
    for i, column in enumerate(zip(*(leaves for leaves, _ in flat))):
        first = column[0]
        if isinstance(first, torch.Tensor):
            if first.dim() == 0 and all(torch.equal(v, first) for v in column[1:]):
                merged.append(first)           # a value without batch dimension, e.g. a constant
            elif first.dim() == 0:
                raise BatchError(
                    f"output {i} is a 0-d tensor (a reduction over the batch, like a mean loss), "
                    f"which cannot be rebuilt from micro-batches: return per-sample values and "
                    f"reduce after the pipeline")
            else:
                merged.append(torch.cat(column, dim=0))
        elif all(v == first for v in column[1:]):
            merged.append(first)
        else:
            raise BatchError(f"output {i} is a {type(first).__name__} that differs between "
                             f"micro-batches ({column[0]!r} vs {column[1]!r}): return tensors")
    return pytree.tree_unflatten(merged, spec)


def _batched(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0
