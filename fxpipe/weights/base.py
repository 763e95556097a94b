"""The `Weights` interface (names, and `read`: real tensors for a stage's names, tied names
resolved, shapes and dtypes checked) and the simplest weights, a state_dict in memory."""

from __future__ import annotations

import abc
import difflib
from typing import Iterable, Mapping

import torch

from fxpipe.passes.errors import PlanFileError


class Weights(abc.ABC):
    """Where tensors come from, by the model's names.

    A subclass says which names it has (`names`) and reads some of them, checked (`_read`);
    `read` resolves tied names first, so a subclass reads each stored tensor once.
    """

    where: str = "weights"      # for messages: "ckpt/model.safetensors (safetensors)"
    cast: bool = False          # whether a dtype other than the asked one is cast

    @abc.abstractmethod
    def names(self) -> set[str]:
        """The names it can give."""

    def read(self, like: Mapping[str, torch.Tensor], device: torch.device | str
             ) -> dict[str, torch.Tensor]:
        """Real tensors for every name in `like`, on `device`, each with like[name]'s shape and
        dtype (`like` values are usually meta tensors). Reads only those tensors. Tied names (two
        names, one tensor object in `like`) give one tensor object, read under whichever name
        the weights hold. Raises PlanFileError naming the tensor and the file when a name is
        missing or has another shape or dtype (cast only with `cast=True` at open)."""
        device = torch.device(device)
        available = self.names()
        wanted: dict[str, list[str]] = {}         # the name read -> the names it gives
        for group in tied_groups(like):
            stored = next((name for name in group if name in available), None)
            if stored is None:
                raise PlanFileError(self._missing(group, available))
            wanted[stored] = group
        tensors = self._read({stored: like[group[0]] for stored, group in wanted.items()}, device)
        return {name: tensors[stored] for stored, group in wanted.items() for name in group}

    @abc.abstractmethod
    def _read(self, like: Mapping[str, torch.Tensor], device: torch.device
              ) -> dict[str, torch.Tensor]:
        """Real tensors for the names of `like`, all of which `names()` holds, checked against
        like's shapes and dtypes (`_check`)."""

    def _check(self, name: str, source: str, shape: Iterable[int], dtype: torch.dtype,
               want: torch.Tensor) -> None:
        """Refuse a tensor whose shape, or dtype without `cast`, is not the model's."""
        if tuple(shape) != tuple(want.shape):
            raise PlanFileError(
                f"shape of {name!r}: {list(shape)} in {source}, {list(want.shape)} in the model"
                f"\nthese weights are for another model (or another "
                f"configuration of it); give the checkpoint of this model")
        if dtype != want.dtype and not self.cast:
            raise PlanFileError(
                f"tensor {name!r} in {source} is {dtype}, the model's is {want.dtype}\n"
                f"open the weights with cast=True (open_weights(..., cast=True)) to cast it, or "
                f"plan the model in {dtype}")

    def _missing(self, group: list[str], available: set[str]) -> str:
        names = " or ".join(repr(name) for name in group)
        close = difflib.get_close_matches(group[0], available, n=1)
        hint = f" (it holds {close[0]!r})" if close else ""
        return (f"tensor {names} is not in {self.where}{hint}\nthese weights are for another "
                f"model, or name its tensors otherwise; give the checkpoint of this model, saved "
                f"under the model's names (model.state_dict()). A tied weight stored once is "
                f"found when the tensors asked share one object under both names, as the "
                f"model's do")


def tied_groups(like: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The names of `like` grouped by tensor object, in order: a tied weight's names share one."""
    groups: dict[int, list[str]] = {}
    for name, tensor in like.items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


class _StateDict(Weights):
    """A state_dict in memory (or memory-mapped): its tensors copied to the device asked."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], where: str, cast: bool):
        self.tensors, self.where, self.cast = tensors, where, cast

    def names(self) -> set[str]:
        return set(self.tensors)

    def _read(self, like, device):
        out = {}
        for name, want in like.items():
            tensor = self.tensors[name]
            self._check(name, self.where, tensor.shape, tensor.dtype, want)
            out[name] = tensor.detach().to(device, want.dtype, copy=True)
        return out
