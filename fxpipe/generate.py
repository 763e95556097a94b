"""Generation through the pipeline: `pipe.generate(...)`, as `model.generate(...)`.

Hugging Face's own generation loop runs unchanged (logits processors, stopping criteria,
sampling, `max_new_tokens`, `eos_token_id`, padding after eos): it calls a front that looks like
the model, whose forward runs the stages, and a cache that only counts the tokens seen
(`Counting`). The real key/value cache lives in the stages:

- `CachedLM` wraps the model for capture. Every attention layer's keys and values are buffers
  `kv_keys_{l}` / `kv_values_{l}` of shape (rows, heads, length, head_dim), preallocated for the
  planned rows and length, and written in place (`SlotCache.update`) at the slots the step
  fills, in the rows of the sequences it runs. A buffer write stays with its readers in one
  stage (`fxpipe.passes.state`), so each stage holds its own layers' cache, and nothing about
  the cache crosses a stage boundary: the graph's inputs are the new tokens, their positions,
  the attention mask (4-D, made outside the graph by Hugging Face's own `create_causal_mask`
  over the cache's slots), the slots written and the rows.
- Two plans over the same stage weights: the decode step (one token per sequence; the plan is
  balanced on its costs) and the prefill (a chunk of `prompt` tokens per sequence). Their
  stages hold the same cache tensors: the decode runtime's per-stage state
  (`fxpipe.runtime.state`) owns them and binds them into both.
- Micro-batches of a step are lanes: rows split along the batch, `rows` telling each lane which
  cache rows are its own, so stage i runs lane a while stage i+1 runs lane b.
- A prompt is left-padded to a multiple of the prefill chunk (slots only: the positions the
  model sees are its own, `seen + arange(q)` as it computes them without `position_ids`);
  a longer prompt runs chunk after chunk.

Each generate starts from zeroed caches and frees them when it returns.

Why buffers written in place, not graph inputs and outputs, nor Hugging Face's cache objects:
functionalize keeps a write to a buffer as the state update it is, and the partitioner keeps a
buffer's writes and reads in one stage (`fxpipe.passes.state`), so each stage holds its layers'
cache without any rule of generation's own; a write to a graph input is refused (micro-batches are
cut from inputs), and tensors returned per step would copy the whole cache each token. Why not
Hugging Face's `StaticCache` inside the graph: its layers count positions in a tensor of their own
(`cumulative_length`), one per cache, not per lane. The mask made outside the graph (`_Slots`)
keeps mask logic out of the graph, so one decode graph serves every step; `SlotCache` is the
`Cache` the model sees while captured, reading back whole the rows it wrote, the mask hiding what
is not written yet.

Two plans, because export fixes the query length. Both are planned by `Planner.plan_other`. A
prefill stage on another device than the decode stage holding the same layer is refused. HF's loop
runs on the caller's thread; each step is `call_stages` (GPipe over the lanes) under `fork_rng`, so
the pipeline's seeds do not move the generator that sampling draws from.
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from fxpipe.passes.errors import DeviceError, FxpipeError, InputError

from .runtime.calls import call_stages, runtime_of
from .runtime.state import Planned, readers_of

if TYPE_CHECKING:
    from .plans.plan_data import Plan
# `Pipeline` in annotations is `pipeline.Pipeline`, which imports this module to generate:
# named, never imported (the import runs one way, `tests/test_layers.py`).

try:    # transformers is an optional dependency ('.[hf]')
    from transformers.cache_utils import Cache, StaticLayer
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError:      # pragma: no cover - generation needs transformers
    Cache = object


class GenerationError(FxpipeError):
    """A generation the pipeline cannot run as asked."""


class SlotCache(Cache):
    """The cache a captured step sees: layer l's keys and values are `keys[l]` / `values[l]`
    (rows, heads, length, head_dim); `update` writes the new ones at `slots` in `rows` and
    returns those rows whole (the mask hides the slots not written yet)."""

    is_compileable = True

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                 rows: torch.Tensor, slots: torch.Tensor):
        self.layers = []
        self.keys, self.values, self.rows, self.slots = keys, values, rows, slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        at = (self.rows[:, None], slice(None), self.slots[None, :])
        self.keys[layer_idx][at] = key_states.transpose(1, 2)
        self.values[layer_idx][at] = value_states.transpose(1, 2)
        return (self.keys[layer_idx].index_select(0, self.rows),
                self.values[layer_idx].index_select(0, self.rows))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise GenerationError("the model asked the cache for its length inside a step\n"
                              "pipe.generate does not yet support models that compute "
                              "positions or biases from it (OPT, Falcon)\n"
                              "Fix: generate with the model")


class _Recorder(Cache):
    """Records the shape and dtype of each layer's keys and values, returning them as given."""

    def __init__(self) -> None:
        self.layers = []
        self.shapes: list[tuple[Planned, Planned]] = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.shapes.append((Planned(tuple(key_states.shape), key_states.dtype),
                            Planned(tuple(value_states.shape), value_states.dtype)))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def kv_shapes(model: nn.Module) -> list[tuple[Planned, Planned]]:
    """Each attention layer's (keys, values) for one token of one sequence, by running it."""
    recorder = _Recorder()
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
              cache=recorder, use_cache=True)
    if not recorder.shapes:
        raise GenerationError(f"{type(model).__name__} wrote no key/value cache\n"
                              f"generation needs a causal LM whose attention layers call "
                              f"cache.update")
    return recorder.shapes


class CachedLM(nn.Module):
    """One step of `model` with its cache as buffers (see the module): the last position's logits
    of `input_ids` (rows, q) given its 4-D `attention_mask`, `position_ids`, the `slots` (q,)
    written and the cache `rows` (rows,)."""

    def __init__(self, model: nn.Module, rows: int, length: int):
        super().__init__()
        self.model = model
        self.layers = len(shapes := kv_shapes(model))
        for l, (k, v) in enumerate(shapes):
            for kind, p in (("keys", k), ("values", v)):
                shape = (rows, p.shape[1], length, p.shape[3])
                self.register_buffer(f"kv_{kind}_{l}", torch.zeros(shape, dtype=p.dtype,
                                                                   device=_device(model)),
                                     persistent=False)

    def cache_names(self) -> list[str]:
        return [f"kv_{kind}_{l}" for l in range(self.layers) for kind in ("keys", "values")]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        cache = SlotCache([getattr(self, f"kv_keys_{l}") for l in range(self.layers)],
                          [getattr(self, f"kv_values_{l}") for l in range(self.layers)],
                          rows, slots)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]


class Counting(Cache):
    """The cache Hugging Face's loop sees: it counts the tokens seen; the keys and values are in
    the stages. What would rearrange a cache is refused by name."""

    is_compileable = False

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        raise GenerationError("beam search (num_beams > 1) is not supported yet\n"
                              "it reorders the cache, which pipe.generate does not do yet\n"
                              "Fix: num_beams=1 (greedy or sampling), or generate with the model")

    def crop(self, max_length: int) -> None:
        raise GenerationError("assisted and contrastive decoding are not supported yet\n"
                              "they crop the cache, which pipe.generate does not do yet\n"
                              "Fix: leave out assistant_model, penalty_alpha and "
                              "prompt_lookup_num_tokens")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise GenerationError("num_return_sequences > 1 is not supported yet\n"
                              "it repeats the cache, which pipe.generate does not do yet\n"
                              "Fix: repeat the prompts in the batch instead "
                              "(input_ids.repeat_interleave(n, 0), the mask likewise)")


class _Slots(Cache):
    """What `create_causal_mask` reads of a cache of `length` slots, queries at `offset`."""

    is_compileable = True

    def __init__(self, length: int, offset: int):
        super().__init__(layers=[StaticLayer(length)])
        self.length, self.offset = length, offset

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.offset


class Generation:
    """Two plans of `CachedLM(model)` on `devices` (decode and prefill), for up to `rows`
    sequences of up to `length` tokens, prompts prefilled `prompt` tokens at a time, `chunks`
    lanes; their caches the decode runtime's stage state."""

    def __init__(self, model: nn.Module, devices: Sequence[Any], *, rows: int, prompt: int,
                 length: int, chunks: int, planner: Callable[..., "Plan"], **options: Any):
        self.model, self.rows, self.prompt, self.length = model, rows, prompt, length
        _refuse_sliding_windows(model, length)
        self.lm = CachedLM(model, rows, length)
        self.lm.training = model.training     # (not .eval(): it would switch the model's modules)
        options.setdefault("training", False)  # generation runs forwards only
        dims = {"slots": None}
        self.decode = planner(self.lm, devices, self.example(rows, 1),
                              chunks=min(chunks, rows), batch_dims=dims, **options)
        self.prefill = self.decode if prompt == 1 else planner(
            self.lm, devices, self.example(rows, prompt),
            chunks=min(chunks, rows), batch_dims=dims, **options)
        self.runtimes = {id(self.decode): runtime_of(self.decode)}
        if self.prefill is not self.decode:
            self.runtimes[id(self.prefill)] = runtime_of(self.prefill)
        self._adopt()

    def example(self, rows: int, q: int) -> dict[str, torch.Tensor]:
        """A step's graph inputs: `q` new tokens of `rows` sequences at slots 0..q-1."""
        device = _device(self.model)
        ids = torch.zeros((rows, q), dtype=torch.long, device=device)
        mask = self.mask(torch.ones((rows, q), dtype=torch.long, device=device), q, 0)
        return dict(input_ids=ids, attention_mask=mask,
                    position_ids=torch.arange(q, device=device).expand(rows, q),
                    slots=torch.arange(q, device=device),
                    rows=torch.arange(rows, device=device))

    def mask(self, slot_mask: torch.Tensor, q: int, offset: int) -> torch.Tensor:
        """The 4-D mask of `q` queries at slots `offset`.., over the cache's slots, from the
        2-D mask of the slots written so far (`slot_mask`, (rows, written))."""
        rows, written = slot_mask.shape
        full = slot_mask.new_zeros((rows, self.length))
        full[:, :written] = slot_mask
        dtype = next(self.model.parameters()).dtype
        return create_causal_mask(
            config=self.model.config,
            inputs_embeds=torch.empty((rows, q, 0), dtype=dtype, device=slot_mask.device),
            attention_mask=full, cache=_Slots(self.length, offset), position_ids=None,
            allow_is_causal_skip=False)

    def _adopt(self) -> None:
        """The decode runtime's stage states own the cache buffers, bound into every module
        that reads them (both plans' stages, their costed graphs, `self.lm`); each then freed."""
        decode_rt = self.runtimes[id(self.decode)]
        prefill_stages = {name: stage for stage in self.prefill.stages
                          for name, _ in stage.module.named_buffers() if name.startswith("kv_")}
        for stage in self.decode.stages:
            state = decode_rt.state[stage.index]
            for name, buffer in stage.module.named_buffers():
                if not name.startswith("kv_"):
                    continue
                other = prefill_stages.get(name)
                if other is not None and torch.device(other.device) != torch.device(stage.device):
                    raise DeviceError(
                        f"{name} is on {other.device} for prefill, on {stage.device} for decode\n"
                        f"both plans must read one cache\nFix: plan on devices of one kind, "
                        f"or with prompts of one token (prompt=1)")
                modules = [stage.module, self.lm,
                           *(m for p in (self.decode, self.prefill) for m in
                             ([p.graph] if p.graph is not None else [])),
                           *(s.module for s in self.prefill.stages)]
                readers = [r for m in modules for r in readers_of(m, name)]
                state.adopt(name, Planned(tuple(buffer.shape), buffer.dtype), readers)
            state.free()

    @property
    def states(self) -> list:
        return self.runtimes[id(self.decode)].state

    def kv_bytes(self) -> list[int]:
        """Each decode stage's cache bytes, as allocated."""
        return [state.nbytes for state in self.states]

    def fits(self, rows: int, length: int) -> bool:
        return rows <= self.rows and length <= self.length

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

    def front(self) -> nn.Module:
        """A shallow copy of the model whose forward is `step`: what Hugging Face's loop calls
        (the model itself is left as it is)."""
        front = copy.copy(self.model)
        front.forward = self.step
        return front

    def step(self, input_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None, cache: Counting | None = None,
             position_ids: torch.Tensor | None = None, inputs_embeds: Any = None,
             **ignored: Any) -> Any:
        """One call of Hugging Face's loop: the logits of the last of `input_ids`'s tokens,
        the stages' caches written."""
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
        if seen == 0:
            self._pad = (-q) % self.prompt if q > 1 else 0
        pad = self._pad
        if pad + seen + q > self.length or rows > self.rows:
            raise GenerationError(
                f"{rows} x {pad + seen + q} slots, over the {self.rows} x {self.length} planned\n"
                f"{rows} sequences of {seen + q} tokens, {pad} slots of padding\nFix: generate "
                f"with fewer new tokens (max_new_tokens) or fewer sequences, or plan_generation "
                f"for more")
        slot_mask = torch.cat([attention_mask.new_zeros((rows, pad)), attention_mask], 1)
        if seen == 0 and q > 1:
            logits = self._prefill(input_ids, position_ids, slot_mask)
        elif q == 1:
            logits = self._run(self.decode, input_ids, position_ids, slot_mask, pad + seen)
        else:
            raise GenerationError(f"a step of {q} tokens after {seen} is not supported\n"
                                  f"pipe.generate runs the prompt, then one token at a time")
        cache.seen += q
        return CausalLMOutputWithPast(logits=logits[:, None, :], cache=cache)

    def _prefill(self, ids: torch.Tensor, positions: torch.Tensor,
                 slot_mask: torch.Tensor) -> torch.Tensor:
        """The prompt left-padded to whole chunks, run chunk after chunk."""
        pad, P = self._pad, self.prompt
        ids = torch.cat([ids.new_zeros((ids.shape[0], pad)), ids], 1)
        positions = torch.cat([positions.new_zeros((ids.shape[0], pad)), positions], 1)
        for start in range(0, ids.shape[1], P):
            logits = self._run(self.prefill, ids[:, start:start + P],
                               positions[:, start:start + P], slot_mask[:, :start + P], start)
        return logits

    def _run(self, plan: "Plan", ids: torch.Tensor, positions: torch.Tensor,
             slot_mask: torch.Tensor, offset: int) -> torch.Tensor:
        """One step of `plan`: tokens `ids` at slots `offset`.., the caller's random
        generators untouched (sampling draws from them as for the model)."""
        rows, q = ids.shape
        inputs = dict(input_ids=ids, attention_mask=self.mask(slot_mask, q, offset),
                      position_ids=positions.contiguous(),
                      slots=torch.arange(offset, offset + q, device=ids.device),
                      rows=torch.arange(rows, device=ids.device))
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            return call_stages(plan, self.runtimes[id(plan)], (), inputs)


def plan_generation(pipe: "Pipeline", *, rows: int, prompt: int, length: int,
                    lanes: int | None = None, **options: Any) -> Generation:
    """Plan `pipe`'s generation ahead (`pipe.generate` plans at its first call otherwise, and
    again when a call needs more): for up to `rows` sequences of up to `length` tokens (prompt
    and new tokens, the prompt left-padded to whole prefill chunks), prompts prefilled `prompt`
    tokens at a time, `lanes` micro-batches of sequences in flight (default: the pipeline's
    chunks), on the pipeline's devices; `options` are `fxpipe.plan`'s (`repeats`, `verify`,
    `capture`...). It replaces the pipeline's previous generation plan."""
    recipe = pipe._recipe
    model = recipe.model if recipe is not None else None
    if model is None or not hasattr(model, "generate"):
        raise GenerationError("pipe.generate needs the model it was compiled from\n"
                              "a Hugging Face causal LM; a loaded plan cannot generate yet\n"
                              "Fix: fxpipe.compile(model, ...) the model")
    if pipe._generation is not None:
        pipe._generation.close()
        pipe._generation = None
    devices = [stage.device for stage in pipe.stage_info]
    pipe._generation = Generation(model, devices, rows=rows, prompt=prompt, length=length,
                                  chunks=lanes or pipe.chunks, planner=recipe.plan_other,
                                  **options)
    return pipe._generation


def generate(pipe: "Pipeline", args: tuple, kwargs: dict[str, Any]) -> Any:
    """`pipe.generate(*args, **kwargs)`: `model.generate`'s result, each step run by the
    stages of `pipe`'s generation plan (made by `plan_generation` where none fits the call)."""
    if "cache" in kwargs or "past_key_values" in kwargs:
        raise InputError("pipe.generate takes no cache=\nthe stages keep the key/value cache\n"
                         "Fix: leave cache= out")
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise InputError("pipe.generate takes input_ids, a (batch, length) tensor of token ids")
    rows, q = ids.shape
    generation = pipe._generation
    model = generation.model if generation is not None else (
        pipe._recipe.model if pipe._recipe is not None else None)
    config = getattr(model, "generation_config", None)
    if kwargs.get("num_beams", getattr(config, "num_beams", 1) or 1) > 1:
        Counting().reorder_cache(None)              # refused by name, with the fix
    if kwargs.get("num_return_sequences", 1) > 1:
        Counting().batch_repeat_interleave(kwargs["num_return_sequences"])
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    length = q + new if new is not None else kwargs.get("max_length",
                                                        getattr(config, "max_length", None))
    if generation is None or not generation.fits(rows, length + (-q) % generation.prompt):
        generation = plan_generation(pipe, rows=rows, prompt=q, length=length)
    with generation.session():
        return generation.front().generate(*args, cache=Counting(), **kwargs)


def _refuse_sliding_windows(model: nn.Module, length: int) -> None:
    """Refuse a model whose sliding-window layers would see fewer tokens than `length`: the
    mask made over the cache's slots is a full causal one."""
    config = model.config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if getattr(config, "use_sliding_window", True) is False or (
            types is not None and "sliding_attention" not in types):
        return                        # (a window in the config that no layer uses)
    if window is not None and window < length:
        raise GenerationError(
            f"sliding-window attention ({window} tokens) is not supported yet\n"
            f"{type(model).__name__}'s layers attend to the last {window} tokens, and "
            f"pipe.generate masks the cache as full attention\nFix: generate at most {window} "
            f"tokens in all (prompt and new), or with the model")


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
