import pytest
import torch
from hypothesis import given, strategies as st

from fxpipe.runtime import microbatch
from fxpipe.passes.errors import BatchError


@given(rows=st.integers(1, 12), chunks=st.integers(1, 12), features=st.integers(1, 3))
def test_split_then_merge_is_the_identity(rows, chunks, features):
    if chunks > rows:
        return
    inputs = {"x": torch.randn(rows, features), "pair": (torch.arange(rows), 3.0), "scalar": torch.tensor(2.0)}
    parts = microbatch.split(inputs, chunks)
    assert len(parts) == chunks
    assert [p["x"].shape[0] for p in parts] == [len(c) for c in torch.arange(rows).tensor_split(chunks)]
    assert all(p["scalar"] is inputs["scalar"] and p["pair"][1] == 3.0 for p in parts)
    merged = microbatch.merge(parts)
    torch.testing.assert_close(merged["x"], inputs["x"])
    torch.testing.assert_close(merged["pair"][0], inputs["pair"][0])


def test_a_batch_smaller_than_chunks_is_refused_with_both_numbers():
    with pytest.raises(BatchError, match="3 rows cannot be split into 4"):
        microbatch.split((torch.randn(3, 2),), 4)


def test_inputs_without_a_batch_dimension_are_refused():
    with pytest.raises(BatchError, match="no input has a batch dimension"):
        microbatch.split((torch.tensor(1.0), 2), 2)


def test_inputs_that_disagree_on_the_batch_size_are_named():
    with pytest.raises(BatchError, match=r"\[0\] has 4 rows.*\[1\] has 5 rows"):
        microbatch.split((torch.randn(4), torch.randn(5)), 2)


def test_a_reduced_output_cannot_be_merged():
    with pytest.raises(BatchError, match="0-d tensor"):
        microbatch.merge([torch.tensor(1.0), torch.tensor(2.0)])


def test_split_and_merge_along_the_dimension_given_per_input():
    x, mask = torch.randn(5, 6, 3), torch.randn(6)
    parts = microbatch.split({"x": x, "mask": mask, "table": torch.ones(2)}, 3,
                             {"x": 1, "mask": 0, "table": None})
    assert [p["x"].shape[1] for p in parts] == [2, 2, 2] and all(p["table"].shape == (2,) for p in parts)
    torch.testing.assert_close(microbatch.merge([p["x"] for p in parts], [1]), x)
    torch.testing.assert_close(microbatch.merge([(p["x"], p["mask"]) for p in parts], [1, 0]), (x, mask))


def test_one_chunk_needs_no_batch_dimension():
    inputs = (torch.tensor(1.0), None)
    assert microbatch.split(inputs, 1) == [inputs]
