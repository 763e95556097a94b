"""What a captured generation step is made of: `CachedLM`, one step of a causal LM with its
key/value cache as buffers written in place (`SlotCache`, the cache the captured model sees),
each attention layer's shapes found by running the model once (`kv_shapes`), and `Counting`,
the cache Hugging Face's loop sees while the stages hold the real one. Why buffers, and how the
masks and positions come out as the model's: `fxpipe.generate`'s docstring."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from .planning.generation import GenerationError
from .runtime.state import Planned

try:    # transformers is an optional dependency ('.[hf]')
    from transformers.cache_utils import Cache
except ImportError:      # pragma: no cover - generation needs transformers
    Cache = object


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

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        return self.slots[0]              # the slots before this step's, as a tensor

    def get_query_offset(self, layer_idx: int = 0) -> torch.Tensor:
        return self.slots[0]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.keys[layer_idx].shape[2], 0


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
    of `input_ids` (rows, q) given its 2-D `attention_mask` over the cache's slots, `position_ids`, the `slots` (q,)
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


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
