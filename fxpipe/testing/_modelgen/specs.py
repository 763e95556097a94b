"""What a generated model is, as data: its ops (`OpSpec`) and the whole graph (`GraphSpec`), and
the bounds generation keeps values within."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal


#: Upper bound on the feature size of generated values (concatenation is
#: only drawn while it keeps the result at most this wide, except when it is
#: the only way to consume a model input or merge outputs).
MAX_FEATURES = 32
#: Feature sizes drawn for model inputs and layer outputs.
_MAX_DRAWN_FEATURES = 8
#: Rough bound on the RMS of any value; ops that would exceed it are not drawn.
_SCALE_LIMIT = 8.0
#: Python scalars used by ``x + c`` / ``x * c``.
_CONSTANTS = (0.5, 2.0, 1.0, 0.1)

_OUTPUT_KINDS = ("tensor", "tuple", "dict")

_MOMENTUM = 0.1


# --------------------------------------------------------------------------- #
# Specs
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One operation of a generated model.

    ``args`` and ``outs`` are value indices: values ``0 .. n_inputs-1`` are the
    model inputs, then each op appends its ``outs`` in order.  ``params`` holds
    the kind-specific static configuration (feature sizes, constants, split
    sizes, ...) and ``attr`` names the submodule / parameter / buffer the op
    owns, if any.
    """

    kind: str
    args: tuple[int, ...]
    outs: tuple[int, ...]
    params: tuple[Any, ...] = ()
    attr: str | None = None


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    """Full description of a generated model (structure plus init seed)."""

    input_features: tuple[int, ...]
    ops: tuple[OpSpec, ...]
    #: Feature size of every value (inputs first, then op outputs).
    value_features: tuple[int, ...]
    outputs: tuple[int, ...]
    output_kind: Literal["tensor", "tuple", "dict"]
    #: ``torch.manual_seed`` used before constructing the model's layers.
    seed: int = 0

    @property
    def n_inputs(self) -> int:
        return len(self.input_features)

    def value_name(self, index: int) -> str:
        n = self.n_inputs
        return f"x{index}" if index < n else f"v{index - n}"

    def output_names(self) -> tuple[str, ...]:
        return tuple(f"out{j}" for j in range(len(self.outputs)))
