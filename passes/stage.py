"""`Stage`: one stage of a pipeline as plain data, what codegen builds and the runtime runs.

Not a pass: a home for the type both sides read, so that the runtime imports it without
importing codegen (`fxpipe.passes.codegen.Stage` names the same class, as plans saved before
were pickled under it).

Example (codegen's stages: what each reads and sends, by the graph's node names, and where it
runs):

>>> import torch
>>> from torch import fx, nn
>>> from fxpipe.passes.codegen import split_stages
>>> gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
>>> first, second = split_stages(gm, {"_0": 0, "_1": 1}, ["cpu", "cpu"])
>>> first.index, first.outputs, first.device
(0, ('_0',), device(type='cpu'))
>>> second.inputs, second.outputs
(('_0',), ('_1',))
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
