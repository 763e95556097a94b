"""`Pipeline`: the module `fxpipe.compile` returns. Call it like the original model.

A Pipeline runs what its plan holds (`runtime.calls.runtime_of(plan)`; one call is `call_stages`,
which compile's check runs too): `forward`, `train_step`, `stream`, `stream_train` (each window of
(input, target) items one train step whose micro-batches are the items, then the optimizer's step:
`train_step` and it share `_train`; `mode="async"` is `runtime/asynchronous.py`, refused up front
where its stashes would not fit a device) and `predict`. It holds what its stages hold (the model's
own tensors, or copies on other devices) under the model's names; a pipeline built from a loaded
plan gathers them from its stages under the same names and runs the mode it was planned in. A plan
that runs the model as is calls the model's own forward (`runtime/as_is.py`). A mode-dependent
graph gets one set of stages per mode, swapped by `train()` / `eval()`.

It refuses a model whose modules or tensors were replaced after compile, or whose modules that no
stage calls got hooks (`ModelChangedError`, `fxpipe.model_watch.ModelWatch`: the model held weakly,
checked before each run), and a plan whose stages hold tensors on meta (`DeviceError` naming
`Plan.with_weights` and `load_plan(weights=)`). `save_weights` writes every stage's shards.

Training cuts autograd at stage boundaries; inference keeps it whole, so `pipe(x).sum().backward()`
works as for the model (see `fxpipe.runtime.executor`). A mode switch captures the model again and
checks the new stages against the model computing with the pipeline's current values
(`torch.func.functional_call`, `checks.holding`), since training may have changed the copies.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.codegen import carry_values
from fxpipe.passes.stage import Stage
from fxpipe.passes.cost_model import default_link, format_bytes
from fxpipe.passes.errors import (BatchError, CostError, DeviceError, InputError,
                                  ModelChangedError, PipelineClosedError, StageError)
from fxpipe.passes.graph_values import tensors
from fxpipe.passes.randomness import microbatch_seeds

from .runtime import microbatch
from .plans.plan_data import Plan, observe, refuse_without_weights
from .runtime import Run
from .plans.saved import PlanFileError, save_stage_weights
from .runtime.as_is import run_as_is, train_as_is
from .runtime.asynchronous import AsyncTraining
from .runtime.calls import call_stages, runtime_of
from .runtime.memory import tracked
from .runtime.orchestrator import item_error
from .runtime.step import (DeferredScale, StepLoss, check_reduction, check_target,
                           step_inputs)
from .plans.explain import explain
from .model_watch import ModelWatch
from .runtime.schedules import Slot, timetable_for


class Pipeline(nn.Module):
    """The model split into stages that stream micro-batches, all stages working at once.

    `pipe(*args, **kwargs)` equals `model(*args, **kwargs)`. `pipe.stages[s]` is stage `s`'s
    GraphModule (`print(pipe.stages[1].code)`), `pipe.plan` says how the model was split, and
    `pipe.last_run` records what ran when in the latest call, and with `pipe.measure_memory`
    set, what each stage held at its peak (`last_run.peak_bytes`, also shown beside the
    prediction by `print(pipe.plan)`; tracking costs a Python call per op). A call or `train_step` splits
    its batch into `chunks` micro-batches, or, for a batch of fewer rows (a single request, a
    dataset's last short batch), into one per row (`pipe.last_run.microbatches` says how many
    ran); an empty batch is refused.

    The pipeline holds, under the model's names, the model's own parameters and buffers where
    its stages are on their devices, and copies placed on the stages' devices otherwise (the
    model keeps its own): `pipe.state_dict()` loads into the original model. Stages are placed
    on their devices by `compile`; moving the whole pipeline with `.to()` is refused.
    """

    def __init__(self, plan: Plan, module: nn.Module | None = None):
        """Run `plan`; `module` holds the parameters under the model's names (by default the
        plan's costed graph, which holds the stages' tensors under them, or for a loaded plan a
        module gathering the stages' own)."""
        super().__init__()
        refuse_without_weights(plan)
        self.plan = plan
        self.module = (module if module is not None else
                       plan.graph if plan.graph is not None else _gathered(plan.stages))
        self.training = self._planned_mode = (
            self.module.training if plan.training is None else plan.training)
        self._runtime = runtime_of(plan)
        self._watch: ModelWatch | None = None      # the model compiled, to notice it changed
        self._recipe = None                        # how to plan it again in the other mode
        self._modes: dict[bool, dict[str, Any]] = {}
        self._rows_mean_checked = False            # see runtime.step: a first step checks it
        self.measure_memory = False      # record each stage's peak in last_run (see the class)
        self._generation = None    # `generate`'s plans (`fxpipe.generate.plan_generation`)

    def _keep_recipe(self, recipe: Any) -> None:
        """Keep how `fxpipe.compile` planned the model (a `Planner`): the model, to notice
        it changed, and the recipe, to plan it again in the other mode."""
        self._recipe = recipe
        self._watch = ModelWatch(recipe.model)

    # What runs is the plan's.
    chunks = property(lambda self: self.plan.chunks)
    schedule = property(lambda self: self.plan.schedule)
    _stages = property(lambda self: self.plan.stages)
    _signature = property(lambda self: self.plan.signature)     # model inputs -> graph -> output
    _placeholders = property(lambda self: self.plan.signature.placeholders)
    _output_dims = property(lambda self: self.plan.output_dims)

    _batch_dims = property(lambda self: self.plan.placeholder_dims)

    @property
    def stages(self) -> list[fx.GraphModule]:
        return [stage.module for stage in self._stages]

    @property
    def stage_info(self) -> list[Stage]:
        """Each stage's module with its wiring: what it reads and sends, its device."""
        return list(self._stages)

    def close(self) -> None:
        """End the stage workers (each within a second once its work is done). A pipeline used
        after `close()` raises `PipelineClosedError`; one dropped without it ends its workers
        as it is collected."""
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
        if model is not None:      # the model's own forward, as it is now: every hook fires
            with self._measuring(training=False):
                return run_as_is(self._runtime, self._stages[0], model, args, kwargs)
        self._check_model()
        with self._measuring(training=False):
            return call_stages(self.plan, self._runtime, args, kwargs)

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

    def stream(self, items: Iterable[Any], *, max_in_flight: int | None = None) -> Iterator[Any]:
        """The model's output for each item, in order, as the items come: each item is one
        call's input (a tensor, a tuple of positional inputs, or a dict of keyword inputs) run
        whole, without splitting it into micro-batches, and the stages work on consecutive items
        at once, on the pipeline's workers; at most `max_in_flight` items (default: twice the
        stages) are inside at a time. Stopping early (leaving the loop, an exception in
        `items`, Ctrl-C) stops every worker and waits until it is at rest; a failing item
        raises a `StageError` naming its stage and the item's index. Item m draws from its own seed, taken from the
        caller's generator as it is fed, as `pipe(x)` does for its one micro-batch."""
        self._check_open()
        self._check_model()
        limit = max_in_flight if max_in_flight is not None else 2 * len(self._stages)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise BatchError(f"max_in_flight={max_in_flight!r}: must be a number of items >= 1")
        signature, placeholders = self._signature, self._placeholders

        def graph_inputs() -> Iterator[dict[str, Any]]:
            for item in items:
                yield dict(zip(placeholders, signature.flatten_inputs(*_call_args(item))))

        flowing = self._runtime.stream(graph_inputs(), max_in_flight=limit,
                                       seed=lambda: microbatch_seeds(1)[0])
        try:
            for values, out in flowing:
                yield signature.rebuild_outputs({**values, **out})
        finally:
            flowing.close()

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """`model.generate(*args, **kwargs)` for the Hugging Face causal LM compiled, its
        steps run by the stages, each stage holding its own layers' key/value cache (see
        `fxpipe.generate` and docs/generation.md)."""
        from .generate import generate
        self._check_open()
        return generate(self, args, kwargs)

    @property
    def last_run(self) -> Run | None:
        """What the latest call or `train_step` ran when; `last_run.error` if it stopped early."""
        return self._runtime.last_run

    def train_step(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], Any], *,
                   reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
        """Forward and backward over all micro-batches, following `self.schedule`; returns the loss.

        `inputs` is the model's input: a tensor, a tuple of positional inputs or a dict of keyword
        inputs (a model taking one dict: pass `(batch,)`). `target` is split into micro-batches
        like the inputs, and `loss_fn(output, target)` runs on each micro-batch in the last stage.
        With `reduction="mean"` (a `loss_fn` that averages over the batch) each micro-batch's loss
        is weighted by its share of the rows, so the returned loss and the gradients left in
        `.grad` equal those of the whole batch; with `"sum"` micro-batch losses are added.

        A loss averaged over something other than rows (tokens that are not padding, say) cannot
        be rebuilt from micro-batch means: let `loss_fn` return `(loss_sum, count)` instead, e.g.
        `(F.cross_entropy(out, t, ignore_index=-100, reduction="sum"), (t != -100).sum())`. The
        step's loss is then `sum(loss_sums) / sum(counts)`, and the gradients of the parameters
        and of the inputs are those of the whole batch's mean (`reduction` is not used).
        The first `"mean"` step of more than one micro-batch checks that loss_fn averages over
        rows (loss_fn on the whole batch's outputs against the weighted micro-batch losses), and
        otherwise raises `LossReductionError`, `.grad` left as it was.
        The optimizer step is the caller's.
        """
        check_reduction(reduction)
        self._check_open()
        self._check_model()
        values = step_inputs(self._signature, inputs)
        chunks = microbatch.split_up_to(values, self.chunks, self._batch_dims)
        rows = microbatch.batch_size(values, self._batch_dims)
        check_target(target, rows)
        model = self._as_is()
        with self._measuring(training=True):
            if model is not None:
                return train_as_is(self._runtime, self._stages, self._signature,
                                   [*self.parameters(), *tensors(values)], model,
                                   *_call_args(inputs), target, loss_fn, reduction)
            loss = self._train(chunks, microbatch.split(target, len(chunks)), loss_fn,
                               reduction, leaves=tensors(values))
            self.last_run.rows = rows
            return loss

    def _train(self, chunks: list[dict[str, Any]], targets: list[Any],
               loss_fn: Callable[[Any, Any], Any], reduction: Literal["mean", "sum"], *,
               leaves: list[torch.Tensor]) -> torch.Tensor:
        """Forward and backward of these micro-batches (graph inputs by placeholder, with their
        targets) following the plan's schedule, each from its own seed; the step's loss.
        `leaves`: the caller's input tensors, whose gradients accumulate as the parameters'."""
        step = StepLoss(loss_fn, self._signature, reduction,
                        DeferredScale([*self.parameters(), *leaves]),
                        check_rows_mean=not self._rows_mean_checked,
                        output_dims=self._output_dims)
        step.take_targets(targets, self._stages[-1].device)
        timetable = timetable_for(self.schedule, len(self._stages), len(chunks), backward=True)
        try:
            losses, _ = self._runtime.run(timetable, chunks, loss_of=step,
                                    seeds=microbatch_seeds(len(chunks)))
        except BaseException:
            step.finish([])     # the gradients held aside are given back
            raise
        loss = step.finish(losses)
        self._rows_mean_checked = self._rows_mean_checked or bool(step.kept)
        return loss

    def stream_train(self, items: Iterable[tuple[Any, Any]], loss_fn: Callable[[Any, Any], Any],
                     optimizer: torch.optim.Optimizer, *, window: int = 1,
                     partial: Literal["train", "drop"] = "train",
                     reduction: Literal["mean", "sum"] = "mean",
                     mode: Literal["exact", "async"] = "exact",
                     max_staleness: int | None = None) -> Iterator[torch.Tensor]:
        """Learn from a stream of `(input, target)` items as they come, `window` items at a
        time; yields each window's loss once `optimizer` stepped on it.

        `mode="exact"` (below) equals the model trained on the same windows one after another.
        `mode="async"` keeps every stage busy instead, as `stream()` does: an item's forward
        enters while earlier items' backwards are still to come, against the weights of the
        latest optimizer step then (kept for its backward: weight stashing), so its gradient is
        that of the model at those weights, applied up to `max_staleness` steps later (default:
        the stages less one, which keeps them all busy; 0 is the exact mode with window 1).
        `pipe.last_run.versions[i]` and `.staleness[i]` say, per item, which weights it used
        and how many steps old its gradient was when applied. Each stage then holds up to
        `max_staleness + 1` copies of its parameters (`plan.stream_train_memory`); a stream
        that would not fit a device's memory is refused before it starts. While it runs, the
        caller's thread (the loop's body) computes with one intra-op thread: the stages hold
        the cores. See `fxpipe.runtime.asynchronous`.

        Each window is one `train_step` whose micro-batches are the window's items, each run
        whole (an item's input is a tensor, a tuple of positional inputs or a dict of keyword
        inputs; its target has one row per input row): `optimizer.zero_grad()`, forward and
        backward of the items on the plan's schedule, the stages working on different items at
        once, then `optimizer.step()`. So the losses, weights and buffers after each window
        equal those of the model trained on the same windows one after another, each item
        drawing from its own seed and updating buffers in order. A last window of fewer items is
        trained (`partial="train"`) or dropped (`"drop"`). `reduction` is `train_step`'s: with
        "mean" a window's loss is the mean over its rows.

        Stopping early (leaving the loop, an exception in `items`, Ctrl-C) leaves every worker
        at rest and writes no `.grad` and no optimizer state afterwards; a window that fails leaves
        `.grad` zeroed and the weights those after the last window yielded (buffers keep the
        forwards that ran, as after a failed `train_step`), and a failing item raises a
        `StageError` naming its stage and the item's index in the stream.
        """
        check_reduction(reduction)
        self._check_open()
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise BatchError(f"window={window!r}: must be a number of items >= 1 per optimizer "
                             f"step")
        if partial not in ("train", "drop"):
            raise BatchError(f"partial={partial!r} is not 'train' or 'drop'\n"
                             f"use 'train' to train a last window of fewer items than "
                             f"window={window}, or 'drop' to leave it out")
        held = {id(p) for p in self.parameters()}
        if not any(id(p) in held for group in optimizer.param_groups for p in group["params"]):
            raise InputError("the optimizer holds none of the pipeline's parameters\n"
                             "nothing would learn: make it from them, e.g. "
                             "torch.optim.SGD(pipe.parameters(), lr=1e-2)")
        if mode == "exact":
            if max_staleness is not None:
                raise BatchError(f"max_staleness={max_staleness!r} bounds mode='async', not "
                                 f"mode='exact'\nthe exact mode applies every gradient before "
                                 f"the next window enters; pass mode='async', or leave "
                                 f"max_staleness out")
            return self._windows(iter(items), loss_fn, optimizer, window, partial == "train",
                                 reduction)
        if mode != "async":
            raise BatchError(f"mode={mode!r} is not 'exact' or 'async'\n"
                             f"use 'exact' (equal to the model trained window after window) or "
                             f"'async' (all stages busy, stale gradients)")
        bound = len(self._stages) - 1 if max_staleness is None else max_staleness
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
            raise BatchError(f"max_staleness={max_staleness!r}: must be a number of optimizer "
                             f"steps >= 0")
        self._check_async_memory(bound, window)
        return self._async(iter(items), loss_fn, optimizer, window, bound, partial == "train",
                           reduction)

    def _check_async_memory(self, max_staleness: int, window: int) -> None:
        """Refuse an asynchronous stream whose stashed weights would not fit a device."""
        need = self.plan.stream_train_memory(max_staleness, window)
        for s, (bytes_, device) in enumerate(zip(need, self.plan.partition.devices)):
            if bytes_ > device.memory_bytes:
                params = sum(p.numel() * p.element_size() for p in self.stages[s].parameters())
                raise DeviceError(
                    f"stage {s} would hold {format_bytes(bytes_)}, over {device.name}'s "
                    f"{format_bytes(device.memory_bytes)}\nin stream_train(mode='async', "
                    f"max_staleness={max_staleness}, window={window}) each step of staleness "
                    f"stashes one more copy of its parameters ({format_bytes(params)}), more than "
                    f"the device holds\nlower max_staleness, or use mode='exact'")

    def _async(self, items: Iterator[tuple[Any, Any]], loss_fn: Callable[[Any, Any], Any],
               optimizer: torch.optim.Optimizer, window: int, max_staleness: int,
               train_partial: bool, reduction: Literal["mean", "sum"]) -> Iterator[torch.Tensor]:
        """`stream_train(mode="async")`'s loop (see `fxpipe.runtime.asynchronous`)."""
        self._check_model()
        run = AsyncTraining(self._runtime, list(self.parameters()), loss_fn=loss_fn,
                            signature=self._signature, optimizer=optimizer, window=window,
                            max_staleness=max_staleness, reduction=reduction,
                            train_partial=train_partial, seed=lambda: microbatch_seeds(1)[0])
        yield from run.run(self._stream_item(i, item) for i, item in enumerate(items))

    def _windows(self, items: Iterator[tuple[Any, Any]], loss_fn: Callable[[Any, Any], Any],
                 optimizer: torch.optim.Optimizer, window: int, train_partial: bool,
                 reduction: Literal["mean", "sum"]) -> Iterator[torch.Tensor]:
        """`stream_train`'s loop (a generator of its own, so that its arguments are checked
        when it is called)."""
        first = 0          # the stream's index of the window's first item
        while True:
            taken = list(itertools.islice(items, window))
            if not taken or (len(taken) < window and not train_partial):
                return
            self._check_model()
            chunks, targets = zip(*(self._stream_item(first + i, item)
                                    for i, item in enumerate(taken)))
            optimizer.zero_grad()
            try:
                loss = self._train(list(chunks), list(targets), loss_fn, reduction,
                                   leaves=tensors(chunks))
            except StageError as e:
                optimizer.zero_grad()       # no part of a window's gradients is left
                error = item_error(e, first)
                raise error from error.__cause__
            except BaseException:
                optimizer.zero_grad()
                raise
            optimizer.step()
            yield loss
            first += len(taken)

    def _stream_item(self, index: int, item: Any) -> tuple[dict[str, Any], Any]:
        """Item `index` of `stream_train`'s stream: its graph inputs by placeholder, and its
        target; an item that is no `(input, target)` pair is refused, naming its index."""
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            what = f" of {len(item)}" if isinstance(item, (tuple, list)) else ""
            raise InputError(f"item {index} of the stream is a {type(item).__name__}{what}\n"
                             f"stream_train takes (input, target) pairs, the input a tensor, a "
                             f"tuple of positional inputs or a dict of keyword inputs")
        inputs, target = item
        try:
            values = step_inputs(self._signature, inputs)
            check_target(target, microbatch.batch_size(values, self._batch_dims), "stream_train")
        except (InputError, BatchError) as e:
            raise type(e)(f"item {index} of the stream: {e}") from e
        return values, target

    def predict(self, *, training: bool = False) -> list[Slot]:
        """The timeline the cost model predicts for one call (or one `train_step`).

        The same timetable the runtime executes, each action taking its stage's predicted time.
        `max(slot.end_s for slot in pipe.predict())` is the predicted duration of the whole step.
        """
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
        """Write the pipeline's parameters and persistent buffers (what `state_dict()` holds:
        the model's names) into `directory` as Hugging Face sharded safetensors with
        `model.safetensors.index.json`, each stage its own shards, a tied weight once (where
        its stages share a device); `model.load_state_dict` (`fxpipe.weights.open_weights`),
        `from_pretrained` and `fxpipe.load_plan(path, weights=directory)` read them back. See
        `fxpipe.weights.save_weights`."""
        return save_stage_weights(self.plan, directory, range(len(self._stages)),
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
        """Run as the model in `mode` runs (`model.train(mode)`).

        A graph that reads the mode (`F.dropout(h, training=self.training)`, `if
        self.training:`, any torch.export graph with dropout or BatchNorm) was captured in one
        mode only: the first switch to the other captures the model again in that mode and plans
        its own stages, on the same parameters, from the example given to `compile`.
        """
        captured = self.plan.capture.training
        if self._recipe is None and captured is not None and captured != mode:
            have, want = ("train", "eval") if captured else ("eval", "train")
            raise ModelChangedError(
                f"this pipeline's graph was captured by torch.export in {have} mode\n"
                f"that fixes how its dropout and BatchNorm behave: compile the model after "
                f"model.{want}() to run it in {want} mode")
        if self._recipe is None and mode != self._planned_mode:
            # Without the model there is no capturing it again, and an fx graph may have read
            # `self.training` in Python at capture: run only the mode it was planned in.
            have, want = ("train", "eval") if self._planned_mode else ("eval", "train")
            raise ModelChangedError(
                f"a plan made in {have} mode has no model to capture in {want} mode\n"
                f"this pipeline runs such a plan; plan the model after model.{want}() for "
                f"that (or compile it, which switches modes)")
        if self._recipe is not None and mode != self.training and mode not in self._modes:
            self._watch.replaced(self._stages)
            self._modes[self.training] = self._mode_state()
            other = self._recipe.build_for_mode(mode, self.module)
            self._modes[mode] = (self._modes[self.training] if other is None else
                                 Pipeline(other)._mode_state())
        if mode in self._modes:
            carry_values(self.module, self._modes[mode]["module"])
            for name, value in self._modes[mode].items():
                setattr(self, name, value)
        super().train(mode)
        for stage in self._stages:
            stage.module.train(mode)
        return self

    _MODE_FIELDS = ("module", "plan", "_runtime")

    def _mode_state(self) -> dict[str, Any]:
        """What differs between the pipelines of one model in train and in eval mode."""
        return {name: getattr(self, name) for name in self._MODE_FIELDS}

    def _check_model(self) -> None:
        """Refuse to run when the model changed since compile in a way the pipeline cannot
        follow (`ModelWatch`)."""
        if self._watch is not None:
            self._watch.check(self.plan)

    def _apply(self, fn, recurse=True):
        raise DeviceError("a Pipeline cannot be moved: it places each stage on its own device\n"
                          "pass the devices to fxpipe.compile(model, devices=...) instead of "
                          "moving the pipeline")

    def __reduce_ex__(self, protocol):
        raise PlanFileError("a Pipeline cannot be pickled (torch.save(pipe))\n"
                            "it holds generated stage code, devices and threads. Save its "
                            "weights with "
                            "torch.save(pipe.state_dict(), path); to resume, compile the model "
                            "again and call pipe.load_state_dict(torch.load(path)) (the names are "
                            "the model's, so model.load_state_dict works too)")

    def __repr__(self) -> str:
        return f"Pipeline(\n{self.plan}\n)"


def _call_args(inputs: Any) -> tuple[tuple, dict[str, Any]]:
    """A call's `(args, kwargs)` from what `train_step` and streams take: a tensor, a tuple of
    positional inputs or a dict of keyword inputs."""
    if isinstance(inputs, dict):
        return (), inputs
    return (inputs if isinstance(inputs, tuple) else (inputs,)), {}


def _gathered(stages: Sequence[Stage]) -> nn.Module:
    """One module holding every stage's parameters and buffers under their own names (the
    model's: stages keep the names of what they hold), each once, non-persistent buffers
    (marked so in the stages) out of its `state_dict` as out of the model's."""
    root = nn.Module()
    for stage in stages:
        for table in ("_parameters", "_buffers"):
            for path, owner in stage.module.named_modules():
                for name, value in getattr(owner, table).items():
                    target = _module_at(root, path)
                    held = getattr(target, table).get(name)
                    if held is not None and held is not value:
                        raise PlanFileError(f"stages hold two different tensors named "
                                            f"{'.'.join(filter(None, (path, name)))!r}")
                    getattr(target, table)[name] = value
                    if name in owner._non_persistent_buffers_set:
                        target._non_persistent_buffers_set.add(name)
    root.train(all(stage.module.training for stage in stages))
    return root


def _module_at(root: nn.Module, path: str) -> nn.Module:
    """The submodule of `root` at the dotted `path`, made empty where missing."""
    module = root
    for part in filter(None, path.split(".")):
        if part not in module._modules:
            module._modules[part] = nn.Module()
        module = module._modules[part]
    return module
