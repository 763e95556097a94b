"""Reading the command line: the model a `module:factory` builds, shapes, dtypes, devices and
sizes, each refused with a `UsageError` naming the flag."""

from __future__ import annotations

import contextlib
import importlib
import json
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

import fxpipe
from fxpipe.passes.errors import FxpipeError

from ..weights import build_on_meta


class UsageError(FxpipeError):
    """A command line that cannot be carried out: an unknown model, shape, dtype or device."""


# ---- reading the command line -------------------------------------------------------------------

def _model(target: str, kwargs: str, *, config: str | None = None, meta: bool = False,
           dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The model `target` builds: called with `kwargs`, or from `config`, on meta with `meta`,
    in `dtype` (a float dtype) when given."""
    factory = _factory(target)
    options = _json_object("--kwargs", kwargs, "'{\"num_classes\": 10}'")
    builder = _hugging_face_builder(factory) if config is not None else None
    if config is not None and builder is None:
        options = {**_json_object(f"--config {config}", _read(config),
                                  "a JSON object of the factory's keyword arguments"), **options}
    def build() -> Any:
        if builder is not None:
            hf_config = _hugging_face_config(config, options, dtype)
            try:
                return builder(hf_config)
            except Exception as e:       # a configuration the factory does not build
                raise UsageError(f"{target} from --config {config} failed\n"
                                 f"{type(e).__name__}: {_first_line(e)}") from None
        try:
            return factory(**options)
        except Exception as e:       # the factory's own complaint, e.g. a missing argument
            raise UsageError(f"{target}(**{options}) failed\n{type(e).__name__}: "
                             f"{_first_line(e)}\npass its arguments with --kwargs") from None

    with _in_dtype(dtype):
        # On meta, its buffers computed (a rotary inv_freq): the plan keeps them, so that it
        # runs from a checkpoint alone (no checkpoint holds a non-persistent buffer).
        model = build_on_meta(build) if meta else build()
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{target} returned a {type(model).__name__}, not an nn.Module")
    if dtype is not None and any(p.is_floating_point() and p.dtype != dtype
                                 for p in model.parameters()):
        model = model.to(dtype)      # a factory that fixed its own dtype
    return model


def _factory(target: str) -> Any:
    """The callable `module:factory` names."""
    module_name, _, factory_name = target.partition(":")
    if not module_name or not factory_name:
        raise UsageError(f"model {target!r} is not module:factory\nwrite it as "
                         f"module:factory, e.g. torch.nn:TransformerEncoderLayer")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"cannot import {module_name!r} ({e})\nis it installed, or on "
                         f"PYTHONPATH?") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise UsageError(f"{module_name!r} has no factory {factory_name!r}")
    return factory


def _json_object(what: str, text: str, example: str) -> dict[str, Any]:
    """`text` read as a JSON object."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{what} {text if len(text) < 60 else text[:57] + '...'!r} is not "
                         f"JSON ({e.msg})\ne.g. {example}") from None
    if not isinstance(options, dict):
        raise UsageError(f"{what} is not a JSON object\ngive a JSON object of keyword "
                         f"arguments")
    return options


def _read(config: str) -> str:
    """The text of the configuration file `config`."""
    path = Path(config)
    if not path.is_file():
        raise UsageError(f"--config {config}: no such file")
    return path.read_text()


def _hugging_face_builder(factory: Any) -> Any:
    """How a Hugging Face factory builds a model from its configuration (an `AutoModel...`
    class's `from_config`, a model class's `_from_config`), None for any other factory."""
    if callable(getattr(factory, "from_config", None)):
        return factory.from_config
    if isinstance(factory, type) and hasattr(factory, "config_class") and \
            callable(getattr(factory, "_from_config", None)):
        return factory._from_config
    return None


def _hugging_face_config(config: str, overrides: dict[str, Any],
                         dtype: torch.dtype | None) -> Any:
    """The Hugging Face configuration in the file `config` (a config.json, or a directory
    holding one), read from disk, `overrides` set on it, in `dtype` when given."""
    path = Path(config)
    if not (path / "config.json" if path.is_dir() else path).is_file():
        raise UsageError(f"--config {config}: no such file" + (
            " (the directory holds no config.json)" if path.is_dir() else ""))
    from transformers import AutoConfig
    try:
        loaded = AutoConfig.from_pretrained(str(path), local_files_only=True, **overrides)
    except Exception as e:       # not JSON, an unknown model_type
        raise UsageError(f"--config {config}: transformers cannot load it\n"
                         f"{type(e).__name__}: {_first_line(e)}") from None
    if dtype is not None:
        loaded.dtype = dtype
    return loaded


@contextlib.contextmanager
def _in_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Inside, floating tensors are made in `dtype` when given."""
    default = torch.get_default_dtype()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        yield
    finally:
        torch.set_default_dtype(default)


def _dtype(name: str) -> torch.dtype:
    """The torch dtype `name` says: a torch name (bfloat16, float32, int64) or bf16, fp16,
    fp32, fp64."""
    dtype = getattr(torch, DTYPE_NAMES.get(name.lower(), name), None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"--dtype {name!r} is not a torch dtype\ne.g. float32, bf16, "
                         f"fp16, int64")
    return dtype


DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32",
               "f32": "float32", "fp64": "float64", "f64": "float64"}


def _token_shape(text: str) -> tuple[int, int]:
    """`--tokens BxS` as (B, S)."""
    try:
        shape = tuple(int(size) for size in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 2 or min(shape) < 1:
        raise UsageError(f"--tokens {text!r} is not BxS\na batch of B sequences of S tokens, "
                         f"sizes >= 1, e.g. 1x512")
    return shape


def _vocabulary(model: torch.nn.Module) -> int:
    """How many token ids `model` takes: its input embedding's rows (a Hugging Face model's
    `get_input_embeddings()`, else its first `nn.Embedding`), else its config's
    `vocab_size`."""
    embedding = None
    if callable(getattr(model, "get_input_embeddings", None)):
        try:
            embedding = model.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            embedding = None
    if not isinstance(embedding, torch.nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if embedding is not None:
        return embedding.num_embeddings
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    raise UsageError("--tokens: the model has no nn.Embedding (nor config.vocab_size)\n"
                     "nothing says its vocabulary; give its inputs with --input SHAPE --dtype "
                     "int64")


def _devices(text: str, memory: float | None) -> list[str | fxpipe.DeviceSpec]:
    """`--devices`: comma-separated names, each with `=SIZE` (its memory) if wanted; `memory`
    (`--memory`) for those without."""
    devices: list[str | fxpipe.DeviceSpec] = []
    for entry in text.split(","):
        name, given, size = (part.strip() for part in entry.partition("="))
        if not name:
            raise UsageError(f"--devices {text!r}: a device name is missing\ne.g. "
                             f"cpu:0=400MB,cpu:1=400MB")
        bytes_ = _size(f"--devices {entry.strip()!r}:", size) if given else memory
        devices.append(name if bytes_ is None else fxpipe.DeviceSpec(name, memory_bytes=bytes_))
    return devices


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def _size(what: str, text: str) -> float:
    """A memory size: bytes (8e9), or with a unit (400MB, 80GB, 16GiB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match[2] not in _UNITS or not float(match[1]) > 0:
        raise UsageError(f"{what} {text!r} is not a memory size\nbytes > 0, e.g. 8e9, 400MB, "
                         f"80GB or 16GiB")
    return float(match[1]) * _UNITS[match[2]]


def _random_inputs(shapes: Sequence[str], dtype_name: str) -> tuple[torch.Tensor, ...]:
    dtype = _dtype(dtype_name)
    torch.manual_seed(0)
    inputs = []
    for text in shapes:
        try:
            shape = [int(size) for size in text.lower().split("x")]
        except ValueError:
            shape = []
        if not shape or min(shape) < 1:
            raise UsageError(f"--input {text!r} is not a shape\nsizes >= 1 joined by x, "
                             f"e.g. 8x3x224x224")
        inputs.append(torch.randint(0, 100, shape, dtype=dtype) if not dtype.is_floating_point
                      else torch.randn(shape, dtype=dtype))
    return tuple(inputs)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def _batch_dims(text: str) -> Any:
    """--batch-dims: an int or null for every input, or a list of them, one per --input."""
    try:
        dims = json.loads(text)
    except json.JSONDecodeError:
        dims = text
    if dims is None or (isinstance(dims, int) and not isinstance(dims, bool)):
        return dims
    if isinstance(dims, list) and all(d is None or (isinstance(d, int) and not isinstance(d, bool))
                                      for d in dims):
        return dict(enumerate(dims))
    raise UsageError(f"--batch-dims {text!r} is not a dimension\ngive an int (1: every input's "
                     f"dimension 1), null, or a list with one per --input, e.g. [1, null]")


def _count(text: str) -> int | str:
    """A count option as given: a number, or "auto" (and any other text, which the options
    refuse by name)."""
    return int(text) if text.isdigit() else text


def _ms(value) -> str:
    return f"{float(value) * 1e3:.3f} ms"
