"""Per-stage state: tensors a stage keeps from one run to the next (a key/value cache).

A stage's GraphModule reads and writes its state as buffers (`get_attr` nodes, written in place:
`fxpipe.passes.state` keeps every write with its readers, in one stage). Which tensors those
buffers hold is not the graph's business but the runtime's: each stage of a `Runtime` has one
`StageState`, made with the runtime, that owns them. Its lifetime:

- created empty with the runtime (`Runtime.state[s]`): it only knows the names of the buffers
  it manages, their planned shapes and dtypes, and the modules that read them (`adopt`);
- `allocate()` places zeroed tensors of the planned shapes on the stage's device and binds them
  into every module that reads them (a second plan over the same stage weights, a prefill and a
  decode graph, reads the same tensors); `reset()` zeroes them again, so nothing of one use
  leaks into the next;
- `free()` binds empty tensors in their place and drops them; `Runtime.close()` frees every
  stage's state.

A tensor belongs to one stage: `adopt` refuses a name another stage of the runtime already
holds (no stage reads another's state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from fxpipe.passes.errors import FxpipeError


@dataclass(frozen=True)
class Planned:
    """A state tensor as planned: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class StageState:
    """The state tensors stage `index` keeps across runs, on `device` (see the module)."""

    def __init__(self, index: int, device: torch.device):
        self.index = index
        self.device = torch.device(device)
        self.planned: dict[str, Planned] = {}
        self.tensors: dict[str, torch.Tensor] = {}           # allocated, by buffer name
        self._readers: dict[str, list[tuple[nn.Module, str]]] = {}

    def adopt(self, name: str, planned: Planned, readers: Iterable[tuple[nn.Module, str]]) -> None:
        """Manage buffer `name` (its owner module and attribute in each of `readers`),
        planned as `planned`."""
        held = self.planned.get(name)
        if held is not None and held != planned:
            raise FxpipeError(f"state {name!r} is planned twice\nstage {self.index} holds "
                              f"it as {held}, and was given {planned}")
        self.planned[name] = planned
        self._readers.setdefault(name, []).extend(readers)
        if name in self.tensors:
            self._bind(name, self.tensors[name])

    @property
    def nbytes(self) -> int:
        """The bytes the state holds once allocated."""
        return sum(p.nbytes for p in self.planned.values())

    @property
    def allocated(self) -> bool:
        return bool(self.tensors)

    def allocate(self) -> None:
        """Zeroed tensors of the planned shapes, bound into every reader (again: zeroed)."""
        if self.allocated:
            self.reset()
            return
        for name, p in self.planned.items():
            self.tensors[name] = torch.zeros(p.shape, dtype=p.dtype, device=self.device)
            self._bind(name, self.tensors[name])

    def reset(self) -> None:
        """Every state tensor zeroed: what one use wrote is gone before the next."""
        with torch.no_grad():
            for t in self.tensors.values():
                t.zero_()

    def free(self) -> None:
        """Empty tensors bound in the state's place, the state dropped."""
        for name, p in self.planned.items():
            self._bind(name, torch.empty((0,), dtype=p.dtype, device=self.device))
        self.tensors.clear()

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        for owner, attr in self._readers.get(name, []):
            owner._buffers[attr] = tensor


def readers_of(module: nn.Module, name: str) -> list[tuple[nn.Module, str]]:
    """`(owner, attribute)` of the buffer `name` (a dotted path) in `module`, if it holds one."""
    path, _, attr = name.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        return []
    return [(owner, attr)] if attr in owner._buffers else []


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
