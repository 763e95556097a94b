"""Where a stage's tensors come from: a checkpoint read per tensor, or the model's own init.

    weights = open_weights("ckpt/")                  # .safetensors, HF sharded dir, torch file
    tensors = weights.read(like, device="cuda:1")     # like: name -> (meta) tensor of one stage

Names are the model's (`model.layers.0.self_attn.q_proj.weight`), as a stage GraphModule holds
them. `read` gives a real tensor for every name it is asked, with the asked shape and dtype, on
the asked device, and reads nothing else: a stage never reads the whole checkpoint. Names that
share one tensor in `like` (a tied output layer) give one tensor, found under whichever of them
the checkpoint stores. A missing tensor, another shape or dtype is a `PlanFileError` naming the
tensor and the file; a dtype is cast only when the weights were opened with `cast=True`.

`Init` draws values instead, as the model initialises them, module by module; planning's
`Init(..., stand_ins=True)` gives a tensor no rule writes plausible values (`stand_in_`).
`build_on_meta(make_model)` builds a model's structure as on meta, but with its buffers computed
(a non-persistent buffer made in `__init__` is in no checkpoint, and no rule computes it again).

The parts, each importable from here:

- `base.py`: the `Weights` interface, and a state_dict in memory.
- `checkpoints.py`: checkpoint files read per tensor, and `open_weights`, which opens one.
- `model_init.py`: `Init`, `build_on_meta` and `stand_in_`: values as the model makes them.
- `saving.py`: `save_weights` and `shard_layout`: Hugging Face's sharded layout, written per rank.

A plan is data before any Pipeline, so a stage's weights are loaded per stage between `fxpipe.plan`
and `Pipeline(plan)`: `weights=` of `load_plan`, `load_stage` and `Plan.with_weights` fills each
stage's stand-ins, only its own names, a tied one once under any of its names, non-persistent
buffers from the plan's files or `Init` (never a checkpoint). A new checkpoint format is one
`Weights` subclass (`names`, `_read`) chosen in `open_weights`.
"""

from .base import Weights, tied_groups
from .checkpoints import open_weights
from .model_init import Init, build_on_meta, stand_in_
from .saving import (DCP_FILE, INDEX_FILE, MAX_SHARD_BYTES, SINGLE_FILE, TIED_KEY, ShardLayout,
                     save_weights, shard_layout)

__all__ = ["DCP_FILE", "INDEX_FILE", "Init", "MAX_SHARD_BYTES", "SINGLE_FILE", "ShardLayout",
           "TIED_KEY", "Weights", "build_on_meta", "open_weights", "save_weights", "shard_layout",
           "stand_in_", "tied_groups"]
