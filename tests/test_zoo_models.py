"""Fast checks of the model zoo (examples/zoo) at size "tiny"."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

from examples.zoo import SIZES, ZOO, ZooCase, build
from examples.zoo import dynamic
from fxpipe.testing import assert_same_up_to_rounding

# Over ~100 layers rounding grows: micro-batches of 1 and 3 rows differ from the whole batch by
# up to 120 float32 epsilons of the largest output here (inception); O(1) where samples mix.
ZOO_TOLERANCE = dict(epsilons=2048)

BATCH = 4
NAMES = sorted(ZOO)
TRACEABLE = [n for n in NAMES if n != "dynamic"]

# expected output shape without the batch dimension
OUTPUT_SHAPES = {
    "resnet50": (10,),
    "inception": (10,),
    "densenet": (10,),
    "mobilenet": (10,),
    "unet": (3, 32, 32),
    "vit": (10,),
    "swin": (10,),
    "dynamic": (10,),
}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_cache: dict[str, tuple[ZooCase, torch.Tensor]] = {}


def case_and_output(name: str) -> tuple[ZooCase, torch.Tensor]:
    """Tiny case for ``name`` and its eager output (built once per session)."""
    if name not in _cache:
        case = build(name, size="tiny", batch=BATCH, seed=0)
        with torch.no_grad():
            out = case.model(*case.example_inputs, **case.example_kwargs)
        _cache[name] = (case, out)
    return _cache[name]


def test_registry():
    assert set(OUTPUT_SHAPES) == set(ZOO)
    assert SIZES == ("tiny", "small", "full")
    assert [n for n in NAMES if not ZOO[n]().fx_traceable] == ["dynamic"]


@pytest.mark.parametrize("name", NAMES)
def test_forward_tiny(name):
    case, out = case_and_output(name)
    assert isinstance(case, ZooCase)
    assert not case.model.training, "build() must return the model in eval mode"
    assert all(x.shape[0] == BATCH for x in case.example_inputs)
    assert tuple(out.shape) == (BATCH, *OUTPUT_SHAPES[name])
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert out.abs().max() > 0


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_build(name):
    _, out = case_and_output(name)
    again = build(name, size="tiny", batch=BATCH, seed=0)
    with torch.no_grad():
        torch.testing.assert_close(again.model(*again.example_inputs), out, rtol=0, atol=0)
    other = build(name, size="tiny", batch=BATCH, seed=1)
    assert not torch.equal(other.example_inputs[0], again.example_inputs[0])


@pytest.mark.parametrize("name", NAMES)
def test_microbatches_match_full_batch(name):
    """Batch is dim 0 and no op mixes samples: split/concat gives the same output."""
    case, out = case_and_output(name)
    (x,) = case.example_inputs
    with torch.no_grad():
        parts = [case.model(chunk) for chunk in (x[:1], x[1:])]
    # Different batch sizes take different conv kernels, in other orders of sums: equal up to
    # rounding (`fxpipe.testing`). Mixing samples would be O(1) wrong.
    assert_same_up_to_rounding(torch.cat(parts), out, **ZOO_TOLERANCE)


@pytest.mark.parametrize("name", TRACEABLE)
def test_fx_symbolic_trace_reproduces_output(name):
    case, out = case_and_output(name)
    assert case.fx_traceable
    gm = fx.symbolic_trace(case.model)
    # every tensor the graph needs is a real parameter or buffer, not a baked constant
    assert not [n for n, _ in gm.named_buffers() if "_tensor_constant" in n]
    assert sum(n.op == "call_module" or n.op == "call_function" for n in gm.graph.nodes) > 10
    with torch.no_grad():
        traced = gm(*case.example_inputs, **case.example_kwargs)
    torch.testing.assert_close(traced, out)


def test_dynamic_fails_fx_symbolic_trace():
    case, _ = case_and_output("dynamic")
    assert not case.fx_traceable
    with pytest.raises(fx.proxy.TraceError):
        fx.symbolic_trace(case.model)


def test_dynamic_traces_with_leaf_submodule():
    case, out = case_and_output("dynamic")
    gm = dynamic.symbolic_trace_with_leaves(case.model)
    leaves = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert "downsample" in leaves
    with torch.no_grad():
        torch.testing.assert_close(gm(*case.example_inputs), out)


def test_dynamic_torch_export_non_strict():
    case, out = case_and_output("dynamic")
    ep = torch.export.export(case.model, case.example_inputs, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(*case.example_inputs), out)


def test_build_rejects_unknown_names_and_sizes():
    with pytest.raises(KeyError):
        build("no-such-model")
    with pytest.raises(ValueError):
        build("resnet50", size="huge")


def test_case_is_frozen_and_rng_untouched():
    state = torch.random.get_rng_state()
    case = build("unet", batch=2, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert case.example_inputs[0].shape[0] == 2
    assert case.example_kwargs == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        case.fx_traceable = False  # type: ignore[misc]
