"""What the checks run in the model's or a stage's place: the model holding a pipeline's values
(`holding`), a graph on the meta device run node by node (`_GraphRun`, which also carries the
model's run in a wider dtype that the tolerance measures it against) and a stage on meta run so
(`_StageRun`). `rounding` sees through the first two to the model or graph they run.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fxpipe.passes.materialize import Materialize, MaterializingInterpreter, run_graph


class _Holding(nn.Module):
    """`model` computing with other values for some of its tensors, by name
    (`torch.func.functional_call`), the model's own left as they are."""

    def __init__(self, model: nn.Module, values: dict[str, torch.Tensor]):
        super().__init__()
        self.model = model
        self.values = values

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.model, self.values, args, kwargs)


def holding(model: nn.Module, held: nn.Module) -> nn.Module:
    """`model` computing with the values `held` has for its tensors where they are other
    tensors (a pipeline's copies on stage devices), copied to where the model's are; the model
    itself where there are none."""
    own = dict([*model.named_parameters(remove_duplicate=False),
                *model.named_buffers(remove_duplicate=False)])
    copies: dict[int, torch.Tensor] = {}       # tied tensors keep one value
    values = {name: copies.setdefault(id(t), t.detach().to(own[name].device, copy=True))
              for name, t in [*held.named_parameters(remove_duplicate=False),
                              *held.named_buffers(remove_duplicate=False)]
              if name in own and own[name] is not t}
    return _Holding(model, values) if values else model


class _GraphRun(nn.Module):
    """A graph holding meta tensors called as the model is: node by node, each node's weights
    materialised before it runs and dropped after (`fxpipe.passes.materialize.run_graph`).
    `wider` makes the model run module by module on the same values in a wider dtype (float32
    for a reduced-precision model, float64 for a float32 one), which `rounding_tolerance`
    measures the graph's rounding against."""

    def __init__(self, gm: nn.Module, materialize: Materialize, device: torch.device,
                 wider: Callable[[], nn.Module] | None = None):
        super().__init__()
        self.gm, self.materialize, self.device = gm, materialize, device
        self.wider = wider

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return run_graph(self.gm, args, kwargs, self.materialize, self.device)


class _StageRun(nn.Module):
    """A stage's GraphModule holding meta tensors, run node by node on materialised weights."""

    def __init__(self, module: nn.Module, materialize: Materialize, device: torch.device):
        super().__init__()
        self.module, self.materialize, self.device = module, materialize, device

    def forward(self, *inputs: Any) -> Any:
        return MaterializingInterpreter(self.module, materialize=self.materialize,
                                        device=self.device).run(*inputs)
