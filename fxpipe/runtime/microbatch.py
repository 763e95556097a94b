"""Split inputs into micro-batches along their batch dimension, and merge outputs back.

Inputs and outputs are pytrees (nested tuples, lists, dicts, dataclass-like containers that
`torch.utils._pytree` knows) whose leaves are tensors or other values. Splitting one example:

    {"x": tensor(6, 3), "mask": tensor(6), "scale": 0.5}, chunks=4
    -> batch size 6 (every tensor with a batch dimension must agree), rows per chunk [2, 2, 1, 1]
    -> [{"x": x[0:2], "mask": mask[0:2], "scale": 0.5}, ..., {"x": x[5:6], ...}]

The batch dimension is 0 unless `dims` says otherwise: an int for every leaf, or a pytree prefix
of the inputs whose leaves are ints (`{"x": 1, "mask": 0}`: `x` is split along dimension 1), None
for a value given whole to every chunk. Values without the batch dimension (Python scalars, 0-d
tensors) are given whole to every chunk. `merge` is the inverse: each output leaf is concatenated
along its own batch dimension (`dims[i]`, 0 by default); values with None, and 0-d tensors, must
be equal in every chunk. With one chunk nothing is split or merged. A pipeline's runs split with
`split_up_to`: a batch of fewer rows than `chunks` runs as one micro-batch per row.

Fewer rows than `chunks`: the timetable and the seeds are built for that count
(`Run.microbatches`); an empty batch is refused.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from fxpipe.passes.errors import BatchError

Dims = Any   # an int, None, or a pytree prefix of the inputs with ints (or None) as leaves


def rows_of(inputs: Any, dims: Dims = 0) -> int | None:
    """The batch's rows (`batch_size`), or None where no input has a batch dimension (0-d
    inputs, run as one micro-batch): what a call's record and the plan's example say."""
    try:
        return batch_size(inputs, dims)
    except BatchError:
        return None


def batch_size(inputs: Any, dims: Dims = 0) -> int:
    """The size of the batch dimension shared by every tensor input that has one."""
    sizes: dict[int, str] = {}
    others = []
    for (path, leaf), dim in zip(pytree.tree_flatten_with_path(inputs)[0], _leaf_dims(inputs, dims)):
        if _batched(leaf, dim):
            sizes.setdefault(leaf.shape[dim], _where(path))
        elif leaf is None or type(leaf).__module__ == "numpy":
            others.append(f"{_where(path)} is {'None' if leaf is None else 'a numpy array'}")
    if not sizes:
        found = f" ({', '.join(others)})" if others else ""
        raise BatchError(f"no input has a batch dimension to split into micro-batches{found}\n"
                         f"pass torch tensors with the batch along dimension 0 "
                         f"(torch.from_numpy(a) for a numpy array), or say which dimension is "
                         f"the batch with batch_dims=")
    if len(sizes) > 1:
        found = ", ".join(f"{where} has {n} rows" for n, where in sizes.items())
        raise BatchError(f"inputs disagree on the batch size ({found})\n"
                         f"every tensor input is split along its batch dimension (0 unless "
                         f"batch_dims= says otherwise), so all must have the same number of rows")
    return next(iter(sizes))


def split(inputs: Any, chunks: int, dims: Dims = 0) -> list[Any]:
    """`inputs` cut into `chunks` pytrees of the same structure, in batch order."""
    if chunks < 1:
        raise BatchError(f"chunks={chunks}: the number of micro-batches must be at least 1")
    if chunks == 1:
        return [inputs]
    rows = batch_size(inputs, dims)
    if rows == 0:
        raise BatchError(EMPTY_BATCH)
    if rows < chunks:
        raise BatchError(f"a batch of {rows} rows cannot be split into {chunks} micro-batches\n"
                         f"pass a batch of at least {chunks} rows, or compile with chunks<={rows}")
    leaves, spec = pytree.tree_flatten(inputs)
    columns = [torch.tensor_split(leaf, chunks, dim) if _batched(leaf, dim) else [leaf] * chunks
               for leaf, dim in zip(leaves, _leaf_dims(inputs, dims))]
    return [pytree.tree_unflatten([column[c] for column in columns], spec) for c in range(chunks)]


def split_up_to(inputs: Any, chunks: int, dims: Dims = 0) -> list[Any]:
    """`inputs` cut as a pipeline runs them: into `chunks` micro-batches, or one per row where
    the batch has fewer rows (a single request, a dataset's last short batch), so that a
    pipeline takes any batch the model takes. An empty batch has no micro-batch to run and is
    refused (with one chunk nothing is split, as `split` does)."""
    if chunks <= 1:
        return split(inputs, chunks, dims)
    rows = batch_size(inputs, dims)
    if rows == 0:
        raise BatchError(EMPTY_BATCH)
    return split(inputs, min(chunks, rows), dims)


EMPTY_BATCH = "the batch is empty (0 rows)\npass at least one sample"


def merge(outputs: Sequence[Any], dims: Sequence[int | None] | None = None) -> Any:
    """The inverse of `split`: one pytree from per-chunk pytrees of the same structure.

    `dims[i]` is output leaf `i`'s batch dimension (default 0), None for a value that has none.
    """
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    for leaves, other in flat[1:]:
        if other != spec:
            raise BatchError(f"micro-batch outputs differ in structure ({other} vs {spec})\n"
                             f"the model must return the same structure for every batch")
    merged = []
    for i, column in enumerate(zip(*(leaves for leaves, _ in flat))):
        first = column[0]
        dim = 0 if dims is None else dims[i]
        if isinstance(first, torch.Tensor):
            if (dim is None or first.dim() == 0) and all(torch.equal(v, first) for v in column[1:]):
                merged.append(first)           # a value without batch dimension, e.g. a constant
            elif dim is None or first.dim() == 0:
                raise BatchError(
                    f"output {i} ({'a 0-d tensor' if first.dim() == 0 else tuple(first.shape)}): "
                    f"no batch dimension, but micro-batches differ\n"
                    f"a reduction over the batch, like a mean loss, cannot be rebuilt from "
                    f"micro-batches: return per-sample values and reduce after the pipeline")
            else:
                merged.append(torch.cat(column, dim=dim))
        elif all(v == first for v in column[1:]):
            merged.append(first)
        else:
            raise BatchError(f"output {i} is a {type(first).__name__} that differs between "
                             f"micro-batches\n{column[0]!r} vs {column[1]!r}; return tensors")
    return pytree.tree_unflatten(merged, spec)


def on_device(value: Any, device: torch.device) -> Any:
    """`value` (a pytree) with its tensors on `device`, where a stage computes with them (a
    move keeps the tensor's autograd history: gradients reach the caller's tensor)."""
    return pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


def detached(value: Any) -> Any:
    """`value` (a pytree) with its tensors detached from autograd."""
    return pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


def _leaf_dims(inputs: Any, dims: Dims) -> list[int | None]:
    """`dims` broadcast to one entry per leaf of `inputs`."""
    spec = pytree.tree_structure(inputs)
    leaf_dims = pytree._broadcast_to_and_flatten(_whole_for_none(dims), spec)
    if leaf_dims is None:
        raise BatchError(f"batch_dims={dims!r} does not match the inputs' structure\n"
                         f"the inputs' structure: {spec}\ngive an int for every input, or one per "
                         f"input")
    return leaf_dims


class _Whole:
    """A batch dimension of None, as a pytree leaf (pytrees take None for an empty node)."""


_WHOLE = _Whole()


def _whole_for_none(dims: Dims) -> Any:
    if dims is None:
        return _WHOLE
    if isinstance(dims, (tuple, list)):
        return type(dims)(_whole_for_none(d) for d in dims)
    if isinstance(dims, dict):
        return {k: _whole_for_none(d) for k, d in dims.items()}
    return dims


def _batched(leaf: Any, dim: Any) -> bool:
    return (isinstance(leaf, torch.Tensor) and isinstance(dim, int) and
            -leaf.dim() <= dim < leaf.dim())


def _where(path) -> str:
    return pytree.keystr(path)
