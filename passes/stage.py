"""`Stage`: one stage of a pipeline as plain data, what codegen builds and the runtime runs.

Not a pass: a home for the type both sides read, so that the runtime imports it without
importing codegen (`fxpipe.passes.codegen.Stage` names the same class, as plans saved before
were pickled under it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx


@dataclass(frozen=True)
class Stage:
    """One stage: its module, the values it reads and the values it sends, by original node name."""

    index: int
    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    device: torch.device
