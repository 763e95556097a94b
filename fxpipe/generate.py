"""Generation through the pipeline: `pipe.generate(...)`, as `model.generate(...)`.

Hugging Face's own generation loop runs unchanged (logits processors, stopping criteria,
sampling, `max_new_tokens`, `eos_token_id`, padding after eos): it calls a front that looks like
the model, whose forward runs the stages, and a cache that only counts the tokens seen
(`Counting`). The real key/value cache lives in the stages:

- `CachedLM` (`fxpipe.cached_lm`) wraps the model for capture. Every attention layer's keys and
  values are buffers `kv_keys_{l}` / `kv_values_{l}` of shape (rows, heads, length, head_dim),
  preallocated for the planned rows and length, and written in place (`SlotCache.update`) at the
  slots the step fills, in the rows of the sequences it runs. A buffer write stays with its
  readers in one stage (`fxpipe.passes.state`), so each stage holds its own layers' cache, and
  nothing about the cache crosses a stage boundary: the graph's inputs are the new tokens, their
  positions, the 2-D attention mask over the cache's slots (the slots written so far, this
  step's included), the slots written and the rows. The model makes its own masks from it in the
  graph, as it does in `model.generate`: causal and sliding-window masks (Mistral; Gemma2's mix
  of sliding and global layers), ALiBi biases from the mask's cumulative sum (Falcon), with the
  step's first slot (`SlotCache.get_query_offset`, a tensor) as the queries' offset.
- Two plans over the same stage weights: the decode step (one token per sequence; the plan is
  balanced on its costs) and the prefill (a chunk of `prompt` tokens per sequence). Their
  stages hold the same cache tensors: the decode runtime's per-stage state
  (`fxpipe.runtime.state`) owns them and binds them into both.
- Lanes are rows split along the batch, `rows` telling each lane which cache rows are its own,
  each advancing on its own (`fxpipe.generate_lanes`), so stage i runs lane a while stage i+1
  runs lane b.
- A prompt is left-padded to a multiple of the prefill chunk (slots only: the positions the
  model sees are those Hugging Face's loop passes); a longer prompt runs chunk after chunk,
  all fed at once (`_prefill`), so that stage 1 runs a chunk while stage 0 runs the next.

Each generate starts from zeroed caches and frees them when it returns. `save_generation`
writes both plans, the model's configs and the caches' shapes; `load_generation` runs Hugging
Face's loop over the model's class built on meta from the config (`Generation.of_plans`).

Why buffers written in place, not graph inputs and outputs, nor Hugging Face's cache objects:
functionalize keeps a write to a buffer as the state update it is, and the partitioner keeps a
buffer's writes and reads in one stage (`fxpipe.passes.state`), so each stage holds its layers'
cache without any rule of generation's own; a write to a graph input is refused (micro-batches are
cut from inputs), and tensors returned per step would copy the whole cache each token. Why not
Hugging Face's `StaticCache` inside the graph: its layers count positions in a tensor of their own
(`cumulative_length`), one per cache, not per lane. The mask over the slots as a graph input
lets one decode graph serve every step: the slots are the only offset the model's masks need, and
a slot's distance to another is the tokens' distance (left padding is a run of masked slots at
the front), so windows and ALiBi come out as the model's. Positions are what Hugging Face's loop
passes (`position_ids` from the mask's cumulative sum, OPT and Llama alike). `SlotCache` is the
`Cache` the model sees while captured, reading back whole the rows it wrote, the mask hiding what
is not written yet.

Two plans, because export fixes the query length. Both are planned by `Planner.plan_other`. A
prefill stage on another device than the decode stage holding the same layer is refused. With one
lane (or in lockstep, `Generation.lockstep`) HF's loop runs on the caller's thread, each step
`call_stages` (GPipe over the lanes) under `fork_rng`, so the pipeline's seeds do not move the
generator sampling draws from; otherwise one loop per lane (`fxpipe.generate_lanes`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from fxpipe.passes.device import is_cpu
from fxpipe.passes.errors import DeviceError, InputError

from .planning.generation import GenerationError
from .runtime.calls import call_stages, runtime_of
from .generate_lanes import Lane, on_lanes
from .runtime.lanes import LaneSteps, bubble
from .cached_lm import CachedLM, Counting
from .runtime.state import Planned, readers_of

try:    # transformers is an optional dependency ('.[hf]')
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError:      # pragma: no cover - generation needs transformers
    pass

if TYPE_CHECKING:
    from .plans.plan_data import Plan
# `Pipeline` in annotations is `pipeline.Pipeline`, which imports this module to generate:
# named, never imported (the import runs one way, `tests/test_layers.py`).


class Generation:
    """Two plans of `CachedLM(model)` on `devices` (decode and prefill), for up to `rows`
    sequences of up to `length` tokens, prompts prefilled `prompt` tokens at a time, `chunks`
    lanes ("auto" or None: chosen, `fxpipe.planning.generation`); their caches the decode
    runtime's stage state. `as_is` says why generation runs the model as is, where it does."""

    def __init__(self, model: nn.Module, devices: Sequence[Any], *, rows: int, prompt: int,
                 length: int, chunks: int | str | None, planner: Callable[..., "Plan"],
                 **options: Any):
        from .planning.generation import plan_decode, slower_than_the_model
        self.model, self.rows, self.prompt, self.length = model, rows, prompt, length
        self.lm = CachedLM(model, rows, length)
        self.lm.training = model.training     # (not .eval(): it would switch the model's modules)
        options.setdefault("training", False)  # generation runs forwards only
        dims = {"slots": None}
        loop_s = functools.lru_cache(maxsize=None)(functools.partial(loop_step_s, model))
        self.decode, self.lane_choice = plan_decode(planner, self.lm, devices,
                                                    self.example(rows, 1), rows=rows,
                                                    lanes=chunks, loop_s=loop_s,
                                                    batch_dims=dims, **options)
        why = self.decode.record.reason if self.decode.runs_as_is else ""
        if not why and options.get("num_stages") == "auto":
            why = slower_than_the_model(self.decode, self.lane_choice, loop_s(rows))
        self.as_is = "" if not why else (
            f"no pipeline is predicted to decode faster than the model: it generates as is "
            f"(model.generate); {why}")
        self.prefill = self.decode if prompt == 1 or self.as_is else planner(
            self.lm, devices, self.example(rows, prompt), batch_dims=dims,
            **dict(options, chunks=self.decode.chunks, num_stages=len(self.decode.stages)))
        self.planned = {name: Planned(tuple(b.shape), b.dtype) for stage in self.decode.stages
                        for name, b in stage.module.named_buffers() if name.startswith("kv_")}
        self._start()

    @classmethod
    def of_plans(cls, model: nn.Module, decode: "Plan", prefill: "Plan", *, rows: int,
                 prompt: int, length: int, planned: dict[str, Planned]) -> "Generation":
        """The generation of plans made before (`load_generation`): `model` only the front
        Hugging Face's loop calls (built on meta is fine), `planned` each cache buffer's."""
        self = cls.__new__(cls)
        self.model, self.rows, self.prompt, self.length = model, rows, prompt, length
        self.lm, self.decode, self.prefill, self.planned = None, decode, prefill, planned
        self.lane_choice, self.as_is = None, ""
        self._start()
        return self

    def _start(self) -> None:
        """Runtimes for both plans, the decode stages' states owning the caches (`_adopt`);
        none where generation runs the model as is."""
        held = [sorted(n for n, _ in stage.module.named_buffers() if n.startswith("kv_"))
                for stage in self.decode.stages]
        # The cache bytes each decode stage was planned with (its memory plan counts them among
        # its buffers), before the stage state takes them over.
        self.kv_predicted = [sum(self.planned[n].nbytes for n in names) for names in held]
        self.kv_layers = [sorted({int(n.rsplit("_", 1)[1]) for n in names}) for names in held]
        self.runtimes = {}
        if self.as_is:
            return
        self.runtimes[id(self.decode)] = runtime_of(self.decode)
        if self.prefill is not self.decode:
            self.runtimes[id(self.prefill)] = runtime_of(self.prefill)
        self._adopt()

    def example(self, rows: int, q: int) -> dict[str, torch.Tensor]:
        """A step's graph inputs: `q` new tokens of `rows` sequences at slots 0..q-1 (on the
        CPU for a model on meta: planning runs it on real inputs)."""
        device = _device(self.model)
        device = torch.device("cpu") if device.type == "meta" else device
        ids = torch.zeros((rows, q), dtype=torch.long, device=device)
        mask = self.mask(torch.ones((rows, q), dtype=torch.long, device=device))
        return dict(input_ids=ids, attention_mask=mask,
                    position_ids=torch.arange(q, device=device).expand(rows, q),
                    slots=torch.arange(q, device=device),
                    rows=torch.arange(rows, device=device))

    def mask(self, slot_mask: torch.Tensor) -> torch.Tensor:
        """The 2-D mask over the cache's slots from that of the slots written so far, this
        step's included (`slot_mask`, (rows, written)): the slots after them are empty."""
        rows, written = slot_mask.shape
        full = slot_mask.new_zeros((rows, self.length))
        full[:, :written] = slot_mask
        return full

    def _adopt(self) -> None:
        """The decode runtime's stage states own the cache buffers, bound into every module
        that reads them (both plans' stages, their costed graphs, `self.lm`); each then freed."""
        decode_rt = self.runtimes[id(self.decode)]
        prefill_stages = {name: stage for stage in self.prefill.stages
                          for name, _ in stage.module.named_buffers() if name.startswith("kv_")}
        for stage in self.decode.stages:
            state = decode_rt.state[stage.index]
            for name, _ in stage.module.named_buffers():
                if not name.startswith("kv_"):
                    continue
                other = prefill_stages.get(name)
                if other is not None and torch.device(other.device) != torch.device(stage.device):
                    raise DeviceError(
                        f"{name} is on {other.device} for prefill, on {stage.device} for decode\n"
                        f"both plans must read one cache\nFix: plan on devices of one kind, "
                        f"or with prompts of one token (prompt=1)")
                modules = [stage.module, *([self.lm] if self.lm is not None else []),
                           *(m for p in (self.decode, self.prefill) for m in
                             ([p.graph] if p.graph is not None else [])),
                           *(s.module for s in self.prefill.stages)]
                readers = [r for m in modules for r in readers_of(m, name)]
                state.adopt(name, self.planned[name], readers)
            state.free()

    @property
    def states(self) -> list:
        runtime = self.runtimes.get(id(self.decode))
        return [] if runtime is None else runtime.state

    def kv_bytes(self) -> list[int]:
        """Each decode stage's cache bytes, as its stage state allocates them."""
        return [state.nbytes for state in self.states]

    @property
    def lanes(self) -> int:
        return self.decode.chunks

    def tokens_per_s(self) -> float | None:
        """Decode tokens per second predicted: every sequence's next token per decode step
        (`lane_choice`'s prediction for its lanes; without one, the decode plan's predicted
        time of one call on all rows)."""
        if self.lane_choice is not None and self.lane_choice.tokens_per_s() is not None:
            return self.lane_choice.tokens_per_s()
        step = self.decode.record.predicted_step_s
        return self.rows / step if step else None

    def __str__(self) -> str:
        from .plans.report import describe_generation
        return describe_generation(self)

    def fits(self, rows: int, length: int) -> bool:
        return rows <= self.rows and length <= self.length

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """`model.generate(*args, **kwargs)` on this generation's plans (a loaded one's too):
        what does not fit the rows and length planned is refused, naming them."""
        rows, q, length = _asked(self.model, args, kwargs)
        padded = length + (-q) % self.prompt
        if not self.fits(rows, padded):
            raise GenerationError(
                f"{rows} x {padded} slots, over the {self.rows} x {self.length} planned\n"
                f"{rows} sequences of {padded} slots: the prompt padded to whole chunks of "
                f"{self.prompt}, and the new tokens\nFix: generate fewer new tokens (max_new_tokens) or fewer sequences, or "
                f"plan again from the model (pipe.generate, plan_generation)")
        return self.run(args, kwargs)

    def run(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Hugging Face's loop over the front, the caches allocated for it and freed after:
        one loop per lane (`on_lanes`), or one for the batch where the lanes must keep step
        (`model.generate` itself where the plan runs the model as is)."""
        if self.as_is:
            return self.model.generate(*args, **kwargs)
        from .planning.generation import refuse_meta
        refuse_meta(self.decode)
        with self.session():
            if not self.lockstep(args, kwargs):
                return on_lanes(self, kwargs)
            self.last_lanes = "lockstep"
            return self.front().generate(*args, cache=Counting(), **kwargs)

    def lockstep(self, args: tuple, kwargs: dict[str, Any]) -> bool:
        """Whether one loop runs the batch (its lanes in lockstep): one lane, a streamer,
        `return_dict_in_generate` (its per-step scores and logits are the whole batch's at
        every step, which lanes ending at different steps do not have), or sampling from
        logits off the CPU (the lanes' own generators are the CPU's)."""
        config = kwargs.get("generation_config") or self.model.generation_config
        ids = kwargs.get("input_ids", args[0] if args else None)
        return bool(min(self.lanes, ids.shape[0]) < 2 or args or "inputs" in kwargs
                    or kwargs.get("streamer") is not None
                    or kwargs.get("return_dict_in_generate", config.return_dict_in_generate)
                    or kwargs.get("do_sample", config.do_sample)
                    and not is_cpu(torch.device(self.decode.stages[-1].device)))

    @property
    def last_run(self) -> Any:
        """The latest decode's record (`runtime.record.Run`): on independent lanes, all its
        steps; in lockstep, its last step (None where it runs the model as is)."""
        runtime = self.runtimes.get(id(self.decode))
        return None if runtime is None else runtime.last_run

    def decode_bubble(self) -> float | None:
        """The share of stage-time idle in `last_run`, from its first step to its last."""
        return None if self.last_run is None else bubble(self.last_run)

    def loop(self, lane: Lane, kwargs: dict[str, Any]) -> Any:
        """Hugging Face's loop over `lane`'s rows (`kwargs`: theirs)."""
        return self.front(lane).generate(cache=Counting(), **kwargs)

    def prefill_lanes(self, parts: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        """Every lane's prompt prefilled at once (pipelined over the prefill plan's lanes)."""
        logits = self._prefill(*(torch.cat(part) for part in zip(*parts)))
        return list(logits.split([part[0].shape[0] for part in parts]))

    def close(self) -> None:
        for runtime in self.runtimes.values():
            runtime.close()

    # --- one generate ------------------------------------------------------------------------

    @contextlib.contextmanager
    def session(self) -> Any:
        """The caches allocated (zeroed) for one generate, and freed after it."""
        for state in self.states:
            state.allocate()
        try:
            yield
        finally:
            for state in self.states:
                state.free()

    def front(self, lane: "Lane | None" = None) -> nn.Module:
        """A shallow copy of the model whose forward is `step` (of `lane`, else of the whole
        batch): what Hugging Face's loop calls (the model itself is left as it is)."""
        front = copy.copy(self.model)
        front.forward = functools.partial(self.step, lane=lane)
        return front

    def step(self, input_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None, cache: Counting | None = None,
             position_ids: torch.Tensor | None = None, inputs_embeds: Any = None,
             lane: "Lane | None" = None, **ignored: Any) -> Any:
        """One call of Hugging Face's loop (over `lane`'s rows, else the batch's): the logits
        of the last of `input_ids`'s tokens, the stages' caches written."""
        if inputs_embeds is not None or input_ids is None:
            raise InputError("pipe.generate takes input_ids, not inputs_embeds\n"
                             "Fix: pass the prompts' token ids")
        if not isinstance(cache, Counting):
            raise InputError("pipe.generate takes no cache=\nthe stages keep the key/value cache\n"
                             "Fix: leave cache= out")
        rows, q = input_ids.shape
        seen = cache.seen
        if attention_mask is None:
            attention_mask = torch.ones((rows, seen + q), dtype=torch.long,
                                        device=input_ids.device)
        if position_ids is None:          # what the model computes without them
            position_ids = (torch.arange(q, device=input_ids.device) + seen).expand(rows, q)
        if seen == 0 and lane is None:          # (the lanes' is set before they start)
            self._pad = (-q) % self.prompt if q > 1 else 0
        pad = self._pad
        if pad + seen + q > self.length or rows > self.rows:
            raise GenerationError(
                f"{rows} x {pad + seen + q} slots, over the {self.rows} x {self.length} planned\n"
                f"{rows} sequences of {seen + q} tokens, {pad} slots of padding\nFix: generate "
                f"with fewer new tokens (max_new_tokens) or fewer sequences, or plan_generation "
                f"for more")
        slot_mask = torch.cat([attention_mask.new_zeros((rows, pad)), attention_mask], 1)
        if seen == 0 and q > 1 and lane is not None:
            with lane.random.away(lane.index):
                logits = lane.gathered.give(lane.index, (input_ids, position_ids, slot_mask))
        elif seen == 0 and q > 1:
            logits = self._prefill(input_ids, position_ids, slot_mask)
        elif q == 1:
            logits = self._run(self.decode, input_ids, position_ids, slot_mask, pad + seen,
                               lane)
        else:
            raise GenerationError(f"a step of {q} tokens after {seen} is not supported\n"
                                  f"pipe.generate runs the prompt, then one token at a time")
        cache.seen += q
        return CausalLMOutputWithPast(logits=logits[:, None, :], cache=cache)

    def _prefill(self, ids: torch.Tensor, positions: torch.Tensor,
                 slot_mask: torch.Tensor) -> torch.Tensor:
        """Every chunk of every lane of the prompt (`chunks`: the prefill plan's micro-batches)
        fed at once to the prefill stages (`LaneSteps`), in order: a stage runs a lane's chunks
        one after another (each reads the cache the one before wrote), and stage 1 runs chunk c
        while stage 0 runs chunk c + 1. The last chunk's logits."""
        plan = self.prefill
        chunks, lanes = self.chunks(plan, ids, positions, slot_mask)
        with torch.random.fork_rng(devices=[]), torch.no_grad(), \
                LaneSteps(self.runtimes[id(plan)]) as steps:
            fed = [(steps.feed(values), values) for values in chunks]
            for m, _ in fed[:-lanes]:
                steps.outputs(m)           # (the earlier chunks' logits: not needed)
            return torch.cat([plan.signature.rebuild_outputs({**values, **steps.outputs(m)})
                              for m, values in fed[-lanes:]])

    def chunks(self, plan: "Plan", ids: torch.Tensor, positions: torch.Tensor,
               slot_mask: torch.Tensor) -> tuple[list[dict[str, Any]], int]:
        """The prompt left-padded to whole chunks of `prompt` tokens, cut into `plan`'s lanes:
        each chunk's graph inputs (by placeholder) for each lane, chunk after chunk; and the
        number of lanes."""
        pad, P = self._pad, self.prompt
        ids = torch.cat([ids.new_zeros((ids.shape[0], pad)), ids], 1)
        positions = torch.cat([positions.new_zeros((ids.shape[0], pad)), positions], 1)
        cuts = torch.tensor_split(torch.arange(ids.shape[0], device=ids.device),
                                  min(plan.chunks, ids.shape[0]))
        lanes = [(int(cut[0]), int(cut[-1]) + 1) for cut in cuts]
        signature, chunks = plan.signature, []
        for start in range(0, ids.shape[1], P):
            step = self.inputs(ids[:, start:start + P], positions[:, start:start + P],
                               slot_mask[:, :start + P], start)
            for a, b in lanes:
                lane = {name: v if name == "slots" else v[a:b] for name, v in step.items()}
                chunks.append(dict(zip(signature.placeholders,
                                       signature.flatten_inputs((), lane))))
        return chunks, len(lanes)

    def inputs(self, ids: torch.Tensor, positions: torch.Tensor, slot_mask: torch.Tensor,
               offset: int, rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """A step's graph inputs: tokens `ids` at slots `offset`.., in cache `rows` (None: the
        first rows, one per sequence)."""
        q = ids.shape[1]
        return dict(input_ids=ids, attention_mask=self.mask(slot_mask),
                    position_ids=positions.contiguous(),
                    slots=torch.arange(offset, offset + q, device=ids.device),
                    rows=torch.arange(ids.shape[0], device=ids.device) if rows is None else rows)

    def _run(self, plan: "Plan", ids: torch.Tensor, positions: torch.Tensor,
             slot_mask: torch.Tensor, offset: int, lane: "Lane | None" = None) -> torch.Tensor:
        """One step of `plan`: tokens `ids` at slots `offset`.., in `lane`'s cache rows (as
        its step, fed on its own), else the batch's; the caller's random generators untouched
        (sampling draws from them as for the model)."""
        inputs = self.inputs(ids, positions, slot_mask, offset,
                             None if lane is None else lane.rows)
        if lane is not None:
            signature = plan.signature
            values = dict(zip(signature.placeholders, signature.flatten_inputs((), inputs)))
            with lane.random.away(lane.index):
                out = lane.steps.step(values)
            return signature.rebuild_outputs({**values, **out})
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            return call_stages(plan, self.runtimes[id(plan)], (), inputs)


def loop_step_s(model: nn.Module, rows: int, repeats: int = 3) -> float:
    """Seconds Hugging Face's greedy loop spends per token on `rows` sequences outside the
    model's forward (its Python, the next token's choice, the mask it grows): a front whose
    forward returns zero logits at once, timed at 2 and 10 new tokens, the least of `repeats`
    differences, over 8 (0 for a model on meta: it cannot run here)."""
    device = _device(model)
    if device.type == "meta":
        return 0.0
    logits = torch.zeros((rows, 1, model.config.get_text_config().vocab_size), device=device)
    front = copy.copy(model)
    front.forward = lambda *args, cache=None, **kwargs: CausalLMOutputWithPast(logits=logits,
                                                                               cache=cache)
    ids = torch.ones((rows, 1), dtype=torch.long, device=device)

    def run(new: int) -> float:
        start = time.perf_counter()
        front.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       do_sample=False, pad_token_id=0, eos_token_id=None, cache=Counting())
        return time.perf_counter() - start
    with torch.no_grad():
        return max(0.0, min(run(10) - run(2) for _ in range(repeats)) / 8)


def plan_generation(pipe: "Pipeline | nn.Module", devices: Sequence[Any] | None = None, *,
                    rows: int, prompt: int, length: int, lanes: int | str | None = "auto",
                    **options: Any) -> Generation:
    """Plan `pipe`'s generation ahead (`pipe.generate` plans at its first call otherwise, and
    again when a call needs more): for up to `rows` sequences of up to `length` tokens (prompt
    and new tokens, the prompt left-padded to whole prefill chunks), prompts prefilled `prompt`
    tokens at a time, `lanes` micro-batches of sequences in flight ("auto" or None: chosen on
    the decode costs measured, `fxpipe.planning.generation`), on the pipeline's devices;
    `options` are `fxpipe.plan`'s (`repeats`, `verify`, `capture`, `num_stages`...). It replaces
    the pipeline's previous generation plan.

    Given a causal LM instead of a pipeline, it plans that model's generation on `devices`
    (a model built on meta too: the plan shows each stage's KV bytes and the lanes, and
    `save_generation` keeps it for `load_generation(path, weights=...)`)."""
    from .planning.build import Planner
    if not hasattr(pipe, "_recipe"):            # a model, planned on its own
        if not hasattr(pipe, "generate") or devices is None:
            raise GenerationError("plan_generation takes a pipeline, or a causal LM and its "
                                  "devices\nFix: plan_generation(pipe, ...) or "
                                  "plan_generation(model, ['cpu', 'cpu'], ...)")
        return Generation(pipe, devices, rows=rows, prompt=prompt, length=length,
                          chunks=lanes, planner=Planner.plan_other, **options)
    model = _model_of(pipe)
    if model is None or not hasattr(model, "generate"):
        raise GenerationError("pipe.generate needs the model, a Hugging Face causal LM\n"
                              "a pipeline plans generation from the model it was compiled "
                              "from, or that load_plan(path, model=model) was given\nFix: "
                              "fxpipe.load_plan(path, model=model), fxpipe.compile(model, ...), "
                              "or load a saved generation (fxpipe.generate.load_generation)")
    if pipe._generation is not None:
        pipe._generation.close()
        pipe._generation = None
    devices = [stage.device for stage in pipe.stage_info]
    pipe._generation = Generation(model, devices, rows=rows, prompt=prompt, length=length,
                                  chunks=lanes, planner=Planner.plan_other, **options)
    return pipe._generation


def _model_of(pipe: "Pipeline") -> nn.Module | None:
    """The model a pipeline plans generation from: the one compiled, or the one its loaded plan
    took its weights from (`load_plan(path, model=model)`)."""
    return pipe._recipe.model if pipe._recipe is not None else pipe.plan.model


def generate(pipe: "Pipeline", args: tuple, kwargs: dict[str, Any]) -> Any:
    """`pipe.generate(*args, **kwargs)`: `model.generate`'s result, each step run by the
    stages of `pipe`'s generation plan (made by `plan_generation` where none fits the call)."""
    generation = pipe._generation
    model = generation.model if generation is not None else _model_of(pipe)
    rows, q, length = _asked(model, args, kwargs)
    if generation is None or not generation.fits(rows, length + (-q) % generation.prompt):
        generation = plan_generation(pipe, rows=rows, prompt=q, length=length)
    return generation.run(args, kwargs)


def _asked(model: nn.Module | None, args: tuple, kwargs: dict[str, Any]) -> tuple[int, int, int]:
    """The rows, prompt length and total length a generate asks for; what it cannot run
    refused by name."""
    if "cache" in kwargs or "past_key_values" in kwargs:
        raise InputError("pipe.generate takes no cache=\nthe stages keep the key/value cache\n"
                         "Fix: leave cache= out")
    for asked in ("output_attentions", "output_hidden_states"):
        if kwargs.get(asked):
            raise GenerationError(f"{asked}=True is not supported\nthe stages return only the "
                                  f"last position's logits of each step\nFix: leave {asked} "
                                  f"out (sequences, scores and logits are returned), or "
                                  f"generate with the model")
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise InputError("pipe.generate takes input_ids, a (batch, length) tensor of token ids")
    rows, q = ids.shape
    config = getattr(model, "generation_config", None)
    if kwargs.get("num_beams", getattr(config, "num_beams", 1) or 1) > 1:
        Counting().reorder_cache(None)              # refused by name, with the fix
    if kwargs.get("num_return_sequences", 1) > 1:
        Counting().batch_repeat_interleave(kwargs["num_return_sequences"])
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    length = q + new if new is not None else kwargs.get("max_length",
                                                        getattr(config, "max_length", None))
    return rows, q, length


# --- a generation saved and loaded ----------------------------------------------------------

GENERATION_FILE = "generation.json"


def save_generation(generation: Generation, path: str | os.PathLike) -> Path:
    """Write `generation` to the directory `path`: its decode and prefill plans (`decode/`,
    `prefill/`, each as `Plan.save` writes one, with the weights), the model's config and
    generation config (`model/`, what Hugging Face's loop reads), and `generation.json` (the
    rows, prompt chunk and length planned, each cache buffer's shape and dtype)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    generation.decode.save(root / "decode")
    if generation.prefill is not generation.decode:
        generation.prefill.save(root / "prefill")
    generation.model.config.save_pretrained(root / "model")
    generation.model.generation_config.save_pretrained(root / "model")
    document = dict(rows=generation.rows, prompt=generation.prompt, length=generation.length,
                    caches={name: [list(p.shape), str(p.dtype).removeprefix("torch.")]
                            for name, p in generation.planned.items()})
    (root / GENERATION_FILE).write_text(json.dumps(document, indent=1) + "\n")
    return root


def load_generation(path: str | os.PathLike, devices: Sequence[Any] | None = None, *,
                    weights: Any = None) -> Generation:
    """The generation saved at `path` (`save_generation`), its stages on the devices planned
    (or `devices`, one per stage); `generation.generate(...)` as `model.generate(...)`, without
    the model: Hugging Face's loop runs over a copy of the model's class built on the meta
    device from the saved config, whose forward runs the stages. A generation planned on meta
    saves no weights: `weights` (a checkpoint, a state_dict: what `fxpipe.load_plan` takes)
    gives both plans' stages theirs."""
    from .plans.saved import load_plan
    from .planning.generation import Prefixed
    root = Path(path)
    document, model, planned = read_saved(root)
    weights = None if weights is None else Prefixed(weights)
    decode = load_plan(root / "decode", devices=devices, weights=weights)
    prefill = (load_plan(root / "prefill", devices=devices, weights=weights)
               if (root / "prefill").is_dir()
               else decode)
    return Generation.of_plans(model, decode, prefill, rows=document["rows"],
                               prompt=document["prompt"], length=document["length"],
                               planned=planned)


def read_saved(root: Path) -> tuple[dict[str, Any], nn.Module, dict[str, Planned]]:
    """A saved generation's `generation.json`, the model's class built on meta from its saved
    config (the front Hugging Face's loop calls), and each cache buffer as planned."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    if not (root / GENERATION_FILE).is_file():
        raise GenerationError(f"{str(root)!r} holds no saved generation ({GENERATION_FILE})\n"
                              f"Fix: save one with fxpipe.generate.save_generation(generation, "
                              f"path)")
    document = json.loads((root / GENERATION_FILE).read_text())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(root / "model"))
    model.generation_config = GenerationConfig.from_pretrained(root / "model")
    model.eval()
    planned = {name: Planned(tuple(shape), getattr(torch, dtype))
               for name, (shape, dtype) in document["caches"].items()}
    return document, model, planned


def _config(directory: Path) -> Any:
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(directory)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
