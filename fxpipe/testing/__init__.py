"""Testing fxpipe, and your own passes and models, the way fxpipe tests itself.

    from hypothesis import given
    from fxpipe.testing import models, assert_pipeline_matches

    @given(models(max_nodes=40, branching=True, inputs=(1, 3)))
    def test_my_model_pipelines(case):
        model, example_inputs = case
        assert_pipeline_matches(model, example_inputs, devices=["cpu"] * 3)

`models` generates random valid nn.Modules, `assert_pipeline_matches` compiles one and compares
the pipeline with the model, naming the first stage whose values differ.
`assert_same_up_to_rounding` compares values computed in another order of sums (other threads,
micro-batches, stages, another CPU) within epsilons of the largest magnitude of the whole set
compared (every gradient of a model together, `grads_of`), not of each element;
`assert_same_training` compares what a training step left in a pipeline (its loss, every
gradient, every buffer) with what the same step left in the model. `dags` generates costed
graphs and devices for partitioner tests (`recomputing_dags` ones whose stages must recompute to
fit, `assignments` valid stages for their nodes), and `brute_force_partition` is the oracle
that tries every valid assignment of a small graph.
"""

from ._check import assert_pipeline_matches
from ._dags import (DagCase, assignments, brute_force_partition, dags, recomputing_dags,
                    synthetic_graph)
from ._modelgen import GeneratedModel, ModelCase, models
from ._rounding import assert_same_up_to_rounding, grads_of
from ._training import assert_same_training

__all__ = ["models", "ModelCase", "GeneratedModel", "assert_pipeline_matches",
           "assert_same_up_to_rounding", "grads_of", "assert_same_training", "dags", "DagCase",
           "assignments", "recomputing_dags", "brute_force_partition", "synthetic_graph"]
