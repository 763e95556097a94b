"""Compile's checks on the example: the model's runs before placement, and the placed stages
checked against them.

`reference_of` makes every run of the model the checks need before any stage is placed: each
output's batch dimension (an output that reduces or mixes the batch refused by name), the
micro-batch check (the model computes the same on micro-batches as on the whole batch), and the
outputs the pipeline must reproduce (`fxpipe.planning.reference`). `verify` then runs the plan's placed
stages as a pipeline call does (`runtime.calls.call_stages`), in order on the caller's thread, and
compares. `holding` is the model computing with a pipeline's values, which a mode switch
checks against. Both compare within the model's own rounding by default (`rounding_tolerance`:
4 times its float32 outputs' error against one float64 run on the example; a bf16 or fp16
model's outputs against one float32 run), so that another CPU's kernels, thread count or
micro-batch size pass, and a model that mixes samples across the batch does not; the plan
states the tolerance and where it came from (`Reference.stated_tolerance`).

A model built on the meta device is checked streamed, never held whole (`meta_reference`,
`streamed_stages`): its graph, node by node on materialised weights, gives the output dims and
the micro-batch check; the model's own forward on a structural copy whose modules are given
their own tensors just before they run (`streamed`) gives the outputs the stages, each run
node by node, must reproduce. Both read the same weights (`Recipe.materialize`).

Parts, by what they do:

- `verification`: `Reference` and `reference_of` (the model's runs before placement: output
  batch dimensions, the micro-batch check, the outputs to reproduce), and `verify` (the placed
  stages against them).
- `rounding`: the tolerance the checks compare within (`rounding_tolerance`,
  `measured_tolerance`, `reduced_precision`).
- `meta`: a model on the meta device checked streamed (`streamed`, `meta_reference`,
  `streamed_stages`).
- `runs`: what the checks run in the model's or a stage's place (`holding`, a graph or a stage
  on meta run node by node), which the tolerance sees through.
"""

from .meta import meta_reference, streamed, streamed_stages
from .rounding import (ASKED, REDUCED_DTYPES, measured_tolerance, reduced_precision,
                       rounding_tolerance)
from .runs import holding
from .verification import Reference, reference_of, verify

__all__ = ["ASKED", "REDUCED_DTYPES", "Reference", "holding", "measured_tolerance",
           "meta_reference", "reduced_precision", "reference_of", "rounding_tolerance",
           "streamed", "streamed_stages", "verify"]
