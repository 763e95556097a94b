"""`Pipeline`: the module `fxpipe.compile` returns. Call it like the original model."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from passes.annotate_costs import bind_inputs
from passes.codegen import Stage
from passes.errors import FxpipeError

from . import microbatch
from .report import Plan
from .runtime import Run, Runtime
from .schedules import gpipe


class Pipeline(nn.Module):
    """The model split into stages that stream micro-batches, all stages working at once.

    `pipe(*args, **kwargs)` equals `model(*args, **kwargs)`. `pipe.stages[s]` is stage `s`'s
    GraphModule (`print(pipe.stages[1].code)`), `pipe.plan` says how the model was split, and
    `pipe.last_run` records what ran when in the latest call.

    The pipeline holds the model's own parameters (not copies), under the model's names:
    `pipe.state_dict()` loads into the original model. Stages are placed on their devices by
    `compile`; moving the whole pipeline with `.to()` is refused.
    """

    def __init__(self, graph_module: fx.GraphModule, stages: Sequence[Stage], plan: Plan,
                 chunks: int):
        super().__init__()
        self.module = graph_module     # holds the parameters, under the model's names
        self._stages = list(stages)
        self.plan = plan
        self.chunks = chunks
        self.last_run: Run | None = None
        (output,) = [n for n in graph_module.graph.nodes if n.op == "output"]
        self._output_template = output.args[0]
        self._placeholders = [n.name for n in graph_module.graph.nodes if n.op == "placeholder"]
        self._runtime = Runtime(stages, [n.name for n in output.all_input_nodes
                                         if n.op != "placeholder"])

    @property
    def stages(self) -> list[fx.GraphModule]:
        return [stage.module for stage in self._stages]

    @property
    def stage_info(self) -> list[Stage]:
        """Each stage's module with its wiring: what it reads and sends, its device."""
        return list(self._stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = dict(zip(self._placeholders, bind_inputs(self.module, args, kwargs)))
        chunks = microbatch.split(values, self.chunks)
        outputs, self.last_run = self._runtime.run(gpipe(len(self._stages), self.chunks), chunks)
        return microbatch.merge([_rebuild(self._output_template, {**chunk, **out})
                                 for chunk, out in zip(chunks, outputs)])

    # Parameters, buffers and state are the traced model's, under the model's own names.
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict, assign)

    def train(self, mode: bool = True) -> "Pipeline":
        super().train(mode)
        for stage in self._stages:
            stage.module.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        raise FxpipeError("a Pipeline places each stage on its own device: pass the devices to "
                          "fxpipe.compile(model, devices=...) instead of moving the pipeline")

    def __repr__(self) -> str:
        return f"Pipeline(\n{self.plan}\n)"


def _rebuild(template: Any, values: dict[str, Any]) -> Any:
    """The graph's output structure with every node replaced by its value."""
    if isinstance(template, fx.Node):
        return values[template.name]
    if isinstance(template, tuple):
        items = [_rebuild(v, values) for v in template]
        return type(template)(*items) if hasattr(template, "_fields") else tuple(items)
    if isinstance(template, list):
        return [_rebuild(v, values) for v in template]
    if isinstance(template, dict):
        return {k: _rebuild(v, values) for k, v in template.items()}
    return template
