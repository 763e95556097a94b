"""Writing weights as Hugging Face sharded safetensors (`save_weights`), each rank its own
shards of a layout every rank computes alike (`shard_layout`); the layout's file names."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from fxpipe.passes.errors import PlanFileError


# The files that name a checkpoint directory's layout (`checkpoints.open_weights`).
INDEX_FILE, SINGLE_FILE, DCP_FILE = "model.safetensors.index.json", "model.safetensors", ".metadata"


# Writing: Hugging Face's layout (shards model-<k>-of-<n>.safetensors and an index mapping each
# name to its shard), the names a tied tensor shares listed in the index's metadata.
TIED_KEY = "tied"
MAX_SHARD_BYTES = 5 * 2 ** 30


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which file each tensor is written to, decided from names and sizes alone, so that every
    torchrun rank computes the same layout and no rank needs another's tensors.

    files: stored name -> shard file name; shards: each group's shard files (group k writes
    shards[k]); tied: a name not stored -> the stored name whose tensor it shares; total_size:
    bytes of the stored tensors (the index's metadata).
    """

    files: dict[str, str]
    shards: list[list[str]]
    tied: dict[str, str]
    total_size: int


def shard_layout(groups: Sequence[Mapping[str, torch.Tensor]], *,
                 max_shard_bytes: int = MAX_SHARD_BYTES,
                 tied: Mapping[str, str] | None = None) -> ShardLayout:
    """The layout of tensors written by several writers (one group each: a stage, a rank), in
    order; meta tensors are fine. A group's tensors go to its own shards (a shard never mixes
    groups), a new shard when the next tensor would pass `max_shard_bytes`. A tensor is stored
    once, under its first name: a later name for the same tensor (one object, or the same
    memory) or a name an earlier group stores is not stored again. `tied` adds names the model
    gives a stored tensor that no group holds (name -> stored name: a stage holds a tied
    weight under the model's first name only)."""
    if max_shard_bytes <= 0:
        raise PlanFileError(f"max_shard_bytes={max_shard_bytes} must be positive\n"
                            f"give the most bytes one shard file may hold")
    first_name: dict[object, str] = {}
    stored_names: set[str] = set()
    tied = dict(tied or {})
    shards: list[list[list[str]]] = []          # per group, its shards' names
    total = 0
    for group in groups:
        shards.append([])
        filled = 0
        for name, tensor in group.items():
            if name in stored_names or name in tied:
                continue
            stored = first_name.setdefault(_same_tensor(tensor), name)
            if stored != name:
                tied[name] = stored
                continue
            stored_names.add(name)
            size = tensor.numel() * tensor.element_size()
            if not shards[-1] or filled + size > max_shard_bytes:
                shards[-1].append([])
                filled = 0
            shards[-1][-1].append(name)
            filled += size
            total += size
    count = sum(map(len, shards))
    numbered = iter(range(1, count + 1))
    files, group_files = {}, []
    for group_shards in shards:
        group_files.append([])
        for names in group_shards:
            file = f"model-{next(numbered):05d}-of-{count:05d}.safetensors"
            group_files[-1].append(file)
            files.update(dict.fromkeys(names, file))
    missing = {name: stored for name, stored in tied.items() if stored not in files}
    if missing:
        name, stored = next(iter(missing.items()))
        raise PlanFileError(f"tied name {name!r} shares tensor {stored!r}, which no group holds\n"
                            f"give the groups every stored tensor")
    return ShardLayout(files, group_files, tied, total)


def _same_tensor(tensor: torch.Tensor) -> object:
    """A key equal for two tensors that are one (one object, or one view of the same memory:
    `model.state_dict()` gives a tied weight as two tensor objects)."""
    if tensor.is_meta or tensor.numel() == 0:         # no memory to compare
        return id(tensor)
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def save_weights(tensors: Mapping[str, torch.Tensor], directory: str | os.PathLike, *,
                 max_shard_bytes: int = MAX_SHARD_BYTES, layout: ShardLayout | None = None,
                 group: int = 0, write_index: bool = True) -> Path:
    """Write `tensors` (the model's names, as `model.state_dict()` gives them: persistent
    tensors only) as Hugging Face sharded safetensors in `directory` (made if needed), with
    model.safetensors.index.json: a tied tensor once, its other names listed in the index's
    metadata ("tied").

    Read back with `open_weights(directory)` (tied names resolved), `from_pretrained(directory)`
    for a Hugging Face model, or `model.load_state_dict(open_weights(directory).read(
    model.state_dict(), "cpu"), strict=True)`.

    Under torchrun, every rank computes the layout of the whole model from names and sizes
    (`shard_layout`, one group per stage, in stage order) and passes it with its stage's tensors
    and its group: it writes that group's shards; the rank passing `write_index=True` writes the
    index from the layout. No rank gathers another's tensors. Returns the directory.
    """
    directory = Path(directory)
    layout = layout or shard_layout([tensors], max_shard_bytes=max_shard_bytes)
    unknown = [name for name in tensors if name not in layout.files and name not in layout.tied]
    if unknown:
        raise PlanFileError(f"tensor {unknown[0]!r} is not in the layout given to save_weights\n"
                            f"compute the layout from every stage's names (shard_layout)")
    if not 0 <= group < len(layout.shards):
        raise PlanFileError(f"group={group}, but the layout has groups 0 to "
                            f"{len(layout.shards) - 1}\ngive the index of this writer's group")
    directory.mkdir(parents=True, exist_ok=True)
    names_in: dict[str, list[str]] = {}
    for name, file in layout.files.items():
        names_in.setdefault(file, []).append(name)
    for file in layout.shards[group]:
        names = names_in[file]
        absent = [name for name in names if name not in tensors]
        if absent:
            raise PlanFileError(f"shard {file}: tensor {absent[0]!r} was not given to this "
                                f"save_weights call\n"
                                f"give group {group}'s tensors as shard_layout was given them")
        _write_shard({name: tensors[name] for name in names}, directory / file)
    if write_index:
        index = {"metadata": {"total_size": layout.total_size, TIED_KEY: layout.tied},
                 "weight_map": layout.files}
        _replace(directory / INDEX_FILE, lambda tmp: tmp.write_text(json.dumps(index, indent=2)))
    return directory


def _write_shard(shard: Mapping[str, torch.Tensor], path: Path) -> None:
    """One safetensors file, its tensors on CPU, each its own memory (safetensors refuses views
    of one storage)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    on_cpu = {}
    for name, tensor in shard.items():
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        on_cpu[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    _replace(path, lambda tmp: save_file(on_cpu, tmp, metadata={"format": "pt"}))


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """Write `path` whole or not at all (a crash leaves the old file, never half a new one)."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)
