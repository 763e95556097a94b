"""`Pipeline`: the module `fxpipe.compile` returns. Call it like the original model.

A façade holding the plan, its runtime (`runtime.calls.runtime_of`) and the watch on the model
compiled (`model_watch.ModelWatch`: a model changed as no stage can follow is refused before a
run). Each way of running is a driver in `runtime/` that checks its own arguments, given the
current mode as a `runtime.front.Facade`: a call (`runtime.calls`), `train_step`
(`runtime.training`), `stream` and `stream_train` (`runtime.streaming`); `generate` is
`fxpipe.generate`'s. It keeps `nn.Module`'s ways: the stages' tensors under the model's names
(`runtime.holding`), `state_dict`, `train()` (a mode-dependent graph gets one set of stages per
mode: the first switch captures the model again, checked against its current values), moves
and pickling refused. Inference keeps autograd whole (`pipe(x).sum().backward()` works).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.codegen import carry_values
from fxpipe.passes.cost_model import default_link
from fxpipe.passes.errors import CostError, DeviceError, PipelineClosedError

from .plans.plan_data import Plan, observe, refuse_without_weights
from .plans.saved import PlanFileError, save_stage_weights
from .runtime import Run, streaming, training
from .runtime.calls import call, runtime_of
from .runtime.front import Facade, LossCheck
from .runtime.holding import check_mode_without_model, gathered
from .runtime.memory import tracked
from .plans.explain import explain
from .model_watch import ModelWatch
from .runtime.schedules import Slot


class Pipeline(nn.Module):
    """The model split into stages that stream micro-batches, all stages working at once.

    `pipe(*args, **kwargs)` equals `model(*args, **kwargs)`. `pipe.stages[s]` is stage `s`'s
    GraphModule (`print(pipe.stages[1].code)`), `pipe.plan` says how the model was split, and
    `pipe.last_run` records what ran when in the latest call, and with `pipe.measure_memory`
    set, what each stage held at its peak (`last_run.peak_bytes`, also beside the prediction in
    `print(pipe.plan)`; tracking costs a Python call per op). A call or `train_step` splits its
    batch into `chunks` micro-batches, or one per row for a batch of fewer rows
    (`pipe.last_run.microbatches` says how many ran); an empty batch is refused. It holds the
    model's own parameters and buffers where its stages are on their devices, copies placed on
    them otherwise, under the model's names: `pipe.state_dict()` loads into the model.
    """

    def __init__(self, plan: Plan, module: nn.Module | None = None):
        """Run `plan`; `module` holds the parameters under the model's names (by default the
        plan's costed graph, or for a loaded plan a module gathering the stages' own)."""
        super().__init__()
        refuse_without_weights(plan)
        self.plan = plan
        self.module = (module if module is not None else
                       plan.graph if plan.graph is not None else gathered(plan.stages))
        self.training = self._planned_mode = (
            self.module.training if plan.training is None else plan.training)
        self._runtime = runtime_of(plan)
        self._watch: ModelWatch | None = None      # the model compiled, to notice it changed
        self._recipe = None                        # how to plan it again in the other mode
        self._modes: dict[bool, dict[str, Any]] = {}
        self._loss_check = LossCheck()              # see runtime.step: a first step checks it
        self.measure_memory = False      # record each stage's peak in last_run (see the class)
        self._generation = None    # `generate`'s plans (`fxpipe.generate.plan_generation`)

    def _keep_recipe(self, recipe: Any) -> None:
        """Keep how `fxpipe.compile` planned the model (a `Planner`): the model, to notice
        it changed, and the recipe, to plan it again in the other mode."""
        self._recipe = recipe
        self._watch = ModelWatch(recipe.model)

    # What runs is the plan's: `stages` are its GraphModules, `stage_info` each `Stage` with its
    # wiring (what it reads and sends, its device).
    chunks = property(lambda self: self.plan.chunks)
    schedule = property(lambda self: self.plan.schedule)
    _output_dims = property(lambda self: self.plan.output_dims)
    stages = property(lambda self: [stage.module for stage in self.plan.stages])
    stage_info = property(lambda self: list(self.plan.stages))

    def close(self) -> None:
        """End the stage workers (each within a second once its work is done); a pipeline used
        after it raises `PipelineClosedError`. Dropped without it, its workers end as collected."""
        for runtime in {id(r): r for r in [self._runtime, *(
                state["_runtime"] for state in self._modes.values())]}.values():
            runtime.close()
        if self._generation is not None:
            self._generation.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._runtime.closed:
            raise PipelineClosedError("this pipeline was closed (close(), or its with block "
                                      "ended)\ncompile or load it again to run it")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        model = self._as_is()
        if model is None:      # as is, the model's own forward runs as it is now: every hook fires
            self._check_model()
        with self._measuring(training=False):
            return call(self.plan, self._runtime, model, args, kwargs)

    def _use(self) -> Facade:
        """The pipeline's current mode, as its drivers see it."""
        return Facade(self.plan, self._runtime, list(self.parameters()), self._as_is(),
                      self._check_open, self._check_model, self._measuring, self._loss_check)

    @contextlib.contextmanager
    def _measuring(self, *, training: bool) -> Iterator[None]:
        """Around a call or step: its time and the speed-up measured so far (`observe`), and
        with `measure_memory` set, each stage's peak measured (`runtime.memory`), into
        `last_run` and the plan's `observed` record."""
        start = time.perf_counter()
        with tracked(self.measure_memory) as measured:
            yield
        record = self.last_run
        if record is None:
            return
        record.call_s = time.perf_counter() - start
        observe(self.plan, record, training)
        if measured is None:
            return
        record.peak_bytes = dict(measured.peak_bytes)
        record.device_peak_bytes = dict(measured.device_peak_bytes)
        self.plan.observed.update(peak_bytes=record.peak_bytes, training=training,
                                  microbatches=record.microbatches)

    def _as_is(self) -> nn.Module | None:
        """The model, when the plan runs it as is (one stage, the whole batch, the caller's
        threads) and it is in the pipeline's mode: then a call runs the model's own forward,
        which costs what the model costs (the traced graph's generated code costs a little more)."""
        if not self.plan.runs_as_is or self._watch is None:
            return None
        model = self._watch.model
        return model if model is not None and model.training == self.training else None

    def train_step(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], Any], *,
                   reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
        """Forward and backward over all micro-batches, following `self.schedule`; returns the loss.

        `inputs` is the model's input: a tensor, a tuple of positional inputs or a dict of keyword
        inputs (a model taking one dict: pass `(batch,)`); `target` is split like them, and
        `loss_fn(output, target)` runs on each micro-batch in the last stage. With
        `reduction="mean"` (a `loss_fn` averaging over the batch) the loss and the gradients left
        in `.grad` equal the whole batch's; with `"sum"` micro-batch losses are added. A mean over
        something else (tokens that are not padding): let `loss_fn` return `(loss_sum, count)`.
        The optimizer step is the caller's. See `fxpipe.runtime.training`.
        """
        return training.train_step(self._use(), inputs, target, loss_fn, reduction)

    def stream(self, items: Iterable[Any], *, max_in_flight: int | None = None) -> Iterator[Any]:
        """The model's output for each item, in order, as the items come: each item is one
        call's input (a tensor, a tuple of positional inputs, or a dict of keyword inputs) run
        whole, the stages working on consecutive items at once, at most `max_in_flight`
        (default: twice the stages) inside at a time. See `fxpipe.runtime.streaming`."""
        self._check_open()
        yield from streaming.stream(self._use(), items, max_in_flight)

    def stream_train(self, items: Iterable[tuple[Any, Any]], loss_fn: Callable[[Any, Any], Any],
                     optimizer: torch.optim.Optimizer, *, window: int = 1,
                     partial: Literal["train", "drop"] = "train",
                     reduction: Literal["mean", "sum"] = "mean",
                     mode: Literal["exact", "async"] = "exact",
                     max_staleness: int | None = None) -> Iterator[torch.Tensor]:
        """Learn from a stream of `(input, target)` items as they come, `window` items at a
        time; yields each window's loss once `optimizer` stepped on it.

        `mode="exact"`: each window is one `train_step` whose micro-batches are its items, then
        `optimizer.step()`: equal to the model trained on the same windows one after another.
        `mode="async"` keeps every stage busy, as `stream()` does, with weight stashing: an
        item's gradient is the model's at the weights it used, applied up to `max_staleness`
        steps later (default: the stages less one). A last window of fewer items is trained
        (`partial="train"`) or dropped (`"drop"`); `reduction` is `train_step`'s. See
        `fxpipe.runtime.streaming` and `fxpipe.runtime.asynchronous`.
        """
        return streaming.stream_train(self._use(), items, loss_fn, optimizer, window=window,
                                      partial=partial, reduction=reduction, mode=mode,
                                      max_staleness=max_staleness)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """`model.generate(*args, **kwargs)` for the Hugging Face causal LM compiled, run by the
        stages, each holding its layers' key/value cache (`fxpipe.generate`)."""
        from .generate import generate
        self._check_open()
        return generate(self, args, kwargs)

    @property
    def last_run(self) -> Run | None:
        """What the latest call or `train_step` ran when; `last_run.error` if it stopped early."""
        return self._runtime.last_run

    def predict(self, *, training: bool = False) -> list[Slot]:
        """The timeline the cost model predicts for one call (or `train_step`): the timetable
        the runtime runs, each action its stage's predicted time (`Plan.predict`)."""
        return self.plan.predict(training=training)

    def explain(self) -> str:
        """For each boundary between stages: the values that cross it (producer, readers, shape,
        bytes) and why the cut is there (the stage times either side, and what a cut one node
        earlier or later would cost). See `fxpipe.plans.explain`."""
        if not isinstance(self.module, fx.GraphModule) or not any(
                "cost" in n.meta for n in self.module.graph.nodes):
            raise CostError("explain() needs the costed graph, which a loaded plan does not keep\n"
                            "compile the model to explain its plan (a compiled pipeline keeps "
                            "the costed graph)")
        part = self.plan.partition
        link = self.plan.link_fn or default_link
        return explain(self.module, dict(part.stage_of), part.devices, link=link,
                       training=any(c.backward_s > 0 for c in part.stages), memory=part.memory)

    def save_weights(self, directory: str | os.PathLike, *,
                     max_shard_bytes: int | None = None) -> Path:
        """Write what `state_dict()` holds into `directory` as Hugging Face sharded safetensors,
        each stage its own shards; `from_pretrained` and `fxpipe.load_plan(path,
        weights=directory)` read them back. See `fxpipe.weights.save_weights`."""
        return save_stage_weights(self.plan, directory, range(len(self.plan.stages)),
                                  max_shard_bytes=max_shard_bytes)

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
        """Run as the model in `mode` runs (`model.train(mode)`). A graph that reads the mode
        (dropout, BatchNorm, `if self.training:`) was captured in one mode: the first switch to
        the other captures the model again and plans its own stages, on the same parameters."""
        if self._recipe is None:
            check_mode_without_model(self.plan, self._planned_mode, mode)
        if self._recipe is not None and mode != self.training and mode not in self._modes:
            self._watch.replaced(self.plan.stages)
            self._modes[self.training] = self._mode_state()
            other = self._recipe.build_for_mode(mode, self.module)
            self._modes[mode] = (self._modes[self.training] if other is None else
                                 Pipeline(other)._mode_state())
        if mode in self._modes:
            carry_values(self.module, self._modes[mode]["module"])
            for name, value in self._modes[mode].items():
                setattr(self, name, value)
        super().train(mode)
        for stage in self.plan.stages:
            stage.module.train(mode)
        return self

    _MODE_FIELDS = ("module", "plan", "_runtime")

    def _mode_state(self) -> dict[str, Any]:
        """What differs between the pipelines of one model in train and in eval mode."""
        return {name: getattr(self, name) for name in self._MODE_FIELDS}

    def _check_model(self) -> None:
        """Refuse to run a model changed since compile as the pipeline cannot follow."""
        if self._watch is not None:
            self._watch.check(self.plan)

    def _apply(self, fn, recurse=True):
        raise DeviceError("a Pipeline cannot be moved: it places each stage on its own device\n"
                          "pass the devices to fxpipe.compile(model, devices=...) instead of "
                          "moving the pipeline")

    def __reduce_ex__(self, protocol):
        raise PlanFileError("a Pipeline cannot be pickled (torch.save(pipe))\nit holds generated "
                            "stage code, devices and threads. Save its weights with "
                            "torch.save(pipe.state_dict(), path); to resume, compile the model "
                            "again and call pipe.load_state_dict(torch.load(path)) (the names are "
                            "the model's, so model.load_state_dict works too)")

    def __repr__(self) -> str:
        return f"Pipeline(\n{self.plan}\n)"
