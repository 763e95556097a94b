"""Checkpoints read per tensor: safetensors files (one, or a Hugging Face sharded directory),
torch.distributed.checkpoint directories, torch state_dict files; `open_weights` picks the one a
path names."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Mapping

import torch

from fxpipe.passes.device import indexed, is_cpu, is_gpu
from fxpipe.passes.errors import PlanFileError

from .base import Weights, _StateDict
from .model_init import Init
from .saving import DCP_FILE, INDEX_FILE, SINGLE_FILE, TIED_KEY


# safetensors' dtype names (its header's "dtype"), as torch's
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _Safetensors(Weights):
    """Safetensors files: each tensor read alone (`safe_open`), straight to the device.

    `files` maps each name to the file holding it (one file, or an HF index's weight_map); only
    the files holding asked names are opened, and only their headers until a tensor is read.
    `tied` maps a name the files do not store to the name of the tensor it shares (an index
    written by `save_weights` lists them).
    """

    def __init__(self, files: Mapping[str, Path], where: str, cast: bool,
                 tied: Mapping[str, str] | None = None):
        tied = {name: stored for name, stored in (tied or {}).items() if stored in files}
        self.files = {**files, **{name: files[stored] for name, stored in tied.items()}}
        self.stored_as, self.where, self.cast = tied, where, cast

    def names(self) -> set[str]:
        return set(self.files)

    def _read(self, like, device):
        from safetensors import SafetensorError, safe_open

        by_file: dict[Path, list[str]] = {}
        for name in like:
            by_file.setdefault(self.files[name], []).append(name)
        # safetensors names a CUDA device by its index ("cuda:0"), not a bare "cuda", and the
        # CPU only as "cpu" (a plan's "cpu:1" is the same memory)
        if is_gpu(device):
            device = indexed(device)
        elif is_cpu(device):
            device = torch.device("cpu")
        out = {}
        for file, names in by_file.items():
            if not file.is_file():
                raise PlanFileError(f"{file} does not exist; {self.where} names it as holding "
                                    f"{names[0]!r}\ncopy the checkpoint whole")
            try:
                with safe_open(file, framework="pt", device=str(device)) as f:
                    for name in names:
                        stored = self.stored_as.get(name, name)
                        if stored not in f.keys():
                            raise PlanFileError(
                                f"tensor {stored!r} is not in {file}, which {self.where} says "
                                f"holds it\nthe index and its files disagree; copy the "
                                f"checkpoint whole, or write it again")
                        header = f.get_slice(stored)
                        dtype = _SAFETENSORS_DTYPES.get(header.get_dtype())
                        self._check(name, str(file), header.get_shape(), dtype, like[name])
                        out[name] = f.get_tensor(stored).to(like[name].dtype)
            except SafetensorError as e:
                raise PlanFileError(f"{file} is not a readable safetensors file ({e})\n"
                                    f"copy the checkpoint again") from e
        return out


class _DistributedCheckpoint(Weights):
    """A torch.distributed.checkpoint directory (as torchtitan saves): names, shapes and dtypes
    from its `.metadata`; `dcp.load` reads only the asked tensors' bytes, in this process alone
    (no collective, so ranks read their own stages independently)."""

    def __init__(self, path: Path, cast: bool):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path, self.where, self.cast = path, f"{path} (torch.distributed.checkpoint)", cast
        entries = FileSystemReader(path).read_metadata().state_dict_metadata
        self.entries = {name: entry for name, entry in entries.items()
                        if isinstance(entry, TensorStorageMetadata)}

    def names(self) -> set[str]:
        return set(self.entries)

    def _read(self, like, device):
        import torch.distributed.checkpoint as dcp

        into = {}
        for name, want in like.items():
            entry = self.entries[name]
            self._check(name, self.where, entry.size, entry.properties.dtype, want)
            into[name] = torch.empty(entry.size, dtype=entry.properties.dtype, device=device)
        with warnings.catch_warnings():     # its note that no_dist=True loads in one process
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(into, storage_reader=dcp.FileSystemReader(self.path), no_dist=True)
        return {name: tensor.to(like[name].dtype) for name, tensor in into.items()}


def open_weights(spec, *, cast: bool = False) -> Weights:
    """The `Weights` that `spec` names.

    spec: a `Weights` (as is); a Mapping[str, Tensor] (a state_dict in memory); a path to a
    .safetensors file, a Hugging Face sharded directory (model.safetensors.index.json), a
    directory holding one model.safetensors, a torch.distributed.checkpoint directory (its
    .metadata), or a torch state_dict file (.pt/.pth/.bin, read with torch.load(mmap=True,
    weights_only=True)); "init" -> Init() (per-module init, seed 0; give it the model with
    `bind`). `cast=True` casts a checkpoint's tensors to the model's dtypes instead of
    refusing them. Opening reads headers and indexes only.
    """
    if isinstance(spec, Weights):
        return spec
    if isinstance(spec, Mapping):
        return _StateDict(spec, "the state_dict given", cast)
    if isinstance(spec, str) and spec == "init":
        return Init()
    if not isinstance(spec, (str, os.PathLike)):
        raise PlanFileError(f"weights={spec!r} is not weights\n"
                            f"give a path to a checkpoint (.safetensors file or directory, "
                            f"torch state_dict file), a state_dict, \"init\" or a "
                            f"fxpipe.weights.Weights")
    path = Path(spec)
    if not path.exists():
        raise PlanFileError(f"no checkpoint at {str(path)!r}: the path does not exist\n"
                            f"give the path of a .safetensors file, a directory of them, or a "
                            f"torch state_dict file")
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            return _safetensors_index(path / INDEX_FILE, cast)
        if (path / SINGLE_FILE).is_file():
            return _safetensors_file(path / SINGLE_FILE, cast)
        if (path / DCP_FILE).is_file():
            return _DistributedCheckpoint(path, cast)
        raise PlanFileError(f"no checkpoint in the directory {path}\n"
                            f"it holds none of {INDEX_FILE} (Hugging Face sharded safetensors), "
                            f"{SINGLE_FILE}, {DCP_FILE} (torch.distributed.checkpoint); give "
                            f"the directory holding one, or the path of a checkpoint file")
    if path.suffix == ".safetensors":
        return _safetensors_file(path, cast)
    return _torch_file(path, cast)


def _safetensors_file(path: Path, cast: bool) -> _Safetensors:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return _Safetensors(dict.fromkeys(f.keys(), path), f"{path} (safetensors)", cast)
    except SafetensorError as e:
        raise PlanFileError(f"{path} is not a readable safetensors file ({e})\n"
                            f"give a checkpoint file") from e


def _safetensors_index(index: Path, cast: bool) -> _Safetensors:
    try:
        document = json.loads(index.read_text())
        files = {name: index.parent / file for name, file in document["weight_map"].items()}
        tied = document.get("metadata", {}).get(TIED_KEY, {})
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PlanFileError(f"{index} is not a Hugging Face index ({type(e).__name__}: {e})\n"
                            f"it needs a \"weight_map\" of tensor names to files; copy the "
                            f"checkpoint again") from e
    return _Safetensors(files, f"{index} (Hugging Face sharded safetensors)", cast, tied)


def _torch_file(path: Path, cast: bool) -> _StateDict:
    """A torch state_dict file, memory-mapped: a tensor's bytes are read when it is copied."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:      # torch raises pickle's, zipfile's or its own errors
        raise PlanFileError(f"{path} is not a checkpoint fxpipe reads ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})\n"
                            f"give a .safetensors file or directory, or a torch state_dict "
                            f"file saved with torch.save(model.state_dict(), path)") from e
    if not isinstance(state, Mapping) or not all(isinstance(t, torch.Tensor)
                                                 for t in state.values()):
        raise PlanFileError(f"{path} holds a {type(state).__name__}, not a state_dict of "
                            f"tensors by name\n"
                            f"save it with torch.save(model.state_dict(), path)")
    return _StateDict(state, f"{path} (torch state_dict)", cast)
