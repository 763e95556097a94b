"""Tests for the random model strategy ``fxpipe.testing._modelgen.models``."""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import pickle
import re
import sys
import textwrap

import pytest
import torch
import torch.fx
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

try:
    from fxpipe.testing import _modelgen
except Exception:  # fxpipe/__init__.py may be mid-edit: load the package directly
    _path = pathlib.Path(__file__).resolve().parents[1] / "fxpipe" / "testing" / "_modelgen"
    _spec = importlib.util.spec_from_file_location("_fxpipe_modelgen", _path / "__init__.py",
                                                   submodule_search_locations=[str(_path)])
    _modelgen = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _modelgen
    _spec.loader.exec_module(_modelgen)

models = _modelgen.models
ModelCase = _modelgen.ModelCase

FAST = settings(max_examples=50, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def flat(out):
    """Outputs as a list of tensors (tensor / tuple / dict, in order)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return list(out.values())
    return list(out)


def graph_calls(case):
    gm = torch.fx.symbolic_trace(case.model)
    return gm, [n for n in gm.graph.nodes]


def has_cat(case) -> bool:
    _, nodes = graph_calls(case)
    return any(n.op == "call_function" and n.target is torch.cat for n in nodes)


def exec_source(source: str) -> dict:
    namespace: dict = {}
    with torch.random.fork_rng(devices=[]):
        exec(compile(source, "<ModelCase>", "exec"), namespace)
    return namespace


# --------------------------------------------------------------------------- #
# generated models are valid
# --------------------------------------------------------------------------- #
@FAST
@given(models())
def test_runs_and_traces(case):
    model, example_inputs = case
    assert isinstance(case, ModelCase)
    assert isinstance(model, torch.nn.Module) and not model.training
    assert isinstance(example_inputs, tuple) and example_inputs
    batch = example_inputs[0].shape[0]
    assert all(x.dim() == 2 and x.shape[0] == batch for x in example_inputs)
    assert 1 <= batch <= 8 and len(case.spec.ops) <= 20

    with torch.no_grad():
        out = model(*example_inputs)
    outs = flat(out)
    assert outs and all(o.shape[0] == batch and torch.isfinite(o).all() for o in outs)
    # Declared feature sizes are the real ones.
    for o, v in zip(outs, case.spec.outputs):
        assert o.shape == (batch, case.spec.value_features[v])

    gm = torch.fx.symbolic_trace(model)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in placeholders] == [f"x{i}" for i in range(len(example_inputs))]
    with torch.no_grad():
        torch.testing.assert_close(gm(*example_inputs), out)


@FAST
@given(models(batch=(2, 8)), st.data())
def test_micro_batches_match_full_batch(case, data):
    model, example_inputs = case
    batch = example_inputs[0].shape[0]
    chunks = data.draw(st.integers(2, batch), label="chunks")
    pieces = [torch.tensor_split(x, chunks, dim=0) for x in example_inputs]
    with torch.no_grad():
        full = model(*example_inputs)
        parts = [model(*(p[i] for p in pieces)) for i in range(chunks)]
    if isinstance(full, torch.Tensor):
        merged = torch.cat(parts, dim=0)
    elif isinstance(full, dict):
        merged = {k: torch.cat([p[k] for p in parts], dim=0) for k in full}
    else:
        merged = tuple(torch.cat([p[j] for p in parts], dim=0) for j in range(len(full)))
    # Micro-batches sum in other orders (other kernels for other batch sizes): equal up to
    # rounding, epsilons of the outputs' largest magnitude (generated models reach 1e12).
    from fxpipe.testing import assert_same_up_to_rounding
    assert_same_up_to_rounding(merged, full, what="merged micro-batches")


@FAST
@given(models())
def test_every_value_is_used(case):
    spec = case.spec
    consumed = {i for op in spec.ops for i in op.args}
    assert set(range(spec.n_inputs)) <= consumed
    assert set(range(len(spec.value_features))) <= consumed | set(spec.outputs)
    for op in spec.ops:  # no degenerate (constant-valued) ops
        assert not (op.kind == "sub" and op.args[0] == op.args[1])
        if op.kind in ("softmax", "layer_norm"):
            assert spec.value_features[op.args[0]] >= 2
    gm = torch.fx.symbolic_trace(case.model)
    for node in gm.graph.nodes:
        if node.op != "output":
            assert node.users, f"unused node {node.format_node()}"


# --------------------------------------------------------------------------- #
# printed source
# --------------------------------------------------------------------------- #
@FAST
@given(models())
def test_source_round_trips(case):
    model, example_inputs = case
    source = repr(case)
    assert source == case.source()
    assert "class Model(nn.Module):" in source and "def forward(self" in source
    ns = exec_source(source)

    # Fresh instance of the printed class, weights copied over: same outputs.
    fresh = ns["Model"]().eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = model(*example_inputs)
        torch.testing.assert_close(fresh(*example_inputs), expected)
        # The printed class is fx-traceable too.
        torch.testing.assert_close(torch.fx.symbolic_trace(fresh)(*example_inputs), expected)

    # The printed seed reproduces weights and inputs exactly.
    torch.testing.assert_close(ns["model"].state_dict(), model.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(ns["example_inputs"], example_inputs, rtol=0, atol=0)


def test_source_example_is_readable():
    spec = _modelgen.GraphSpec(
        input_features=(3,),
        ops=(
            _modelgen.OpSpec("linear", (0,), (1,), (3, 4), "linear0"),
            _modelgen.OpSpec("split", (1,), (2, 3), (1, 3)),
            _modelgen.OpSpec("mul_buffer", (3,), (4,), (3,), "buf2"),
            _modelgen.OpSpec("cat", (2, 4), (5,)),
        ),
        value_features=(3, 4, 1, 3, 3, 4),
        outputs=(5,),
        output_kind="tensor",
        seed=7,
    )
    case = _modelgen.build_case(spec, batch=2)
    assert repr(case) == textwrap.dedent('''\
        import torch
        import torch.nn as nn
        import torch.nn.functional as F


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear0 = nn.Linear(3, 4)
                self.register_buffer("buf2", torch.rand(3))

            def forward(self, x0):  # x0: (B, 3)
                v0 = self.linear0(x0)  # (B, 4)
                v1, v2 = torch.split(v0, [1, 3], dim=1)  # (B, 1), (B, 3)
                v3 = v2 * self.buf2  # (B, 3)
                v4 = torch.cat([v1, v3], dim=1)  # (B, 4)
                return v4


        torch.manual_seed(7)
        model = Model().eval()
        example_inputs = (torch.randn(2, 3),)
        ''')
    ns = exec_source(repr(case))
    torch.testing.assert_close(ns["model"](*ns["example_inputs"]), case.model(*case.example_inputs))


# --------------------------------------------------------------------------- #
# feature flags
# --------------------------------------------------------------------------- #
@FAST
@given(models(branching=False, inputs=(1, 3), max_nodes=8))
def test_no_branching_gives_a_chain(case):
    ops = case.spec.ops
    assert ops[0].args[0] == 0
    for prev, op in zip(ops, ops[1:]):
        assert set(op.args) & set(prev.outs), (prev, op)


@FAST
@given(models(inputs=(2, 4), max_nodes=6))
def test_inputs_bounds_and_max_nodes(case):
    model, example_inputs = case
    assert 2 <= len(example_inputs) <= 4
    assert len(case.spec.ops) <= 6
    gm = torch.fx.symbolic_trace(model)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(example_inputs)
    assert all(n.users for n in placeholders)


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict"])
def test_output_kind(kind):
    @settings(max_examples=10, deadline=None, database=None)
    @given(models(outputs=kind, max_nodes=8))
    def check(case):
        model, example_inputs = case
        out = model(*example_inputs)
        expected_type = {"tensor": torch.Tensor, "tuple": tuple, "dict": dict}[kind]
        assert isinstance(out, expected_type)
        if kind == "dict":
            assert list(out) == [f"out{i}" for i in range(len(out))]
        if kind != "tensor":
            assert len(out) >= 1 and all(isinstance(o, torch.Tensor) for o in flat(out))

    check()


@FAST
@given(models(buffers=False, constants=False))
def test_no_buffers_no_constants(case):
    model, _ = case
    assert not list(model.buffers())
    kinds = {op.kind for op in case.spec.ops}
    assert not kinds & {"add_const", "mul_const", "add_buffer", "mul_buffer", "reshape_mean", "conv"}
    gm = torch.fx.symbolic_trace(model)
    for node in gm.graph.nodes:
        assert node.target != "reshape"
        assert not any(isinstance(a, float) for a in node.args), node.format_node()


def test_graphs_cover_all_node_kinds():
    seen: set[str] = set()

    @settings(max_examples=40, deadline=None, database=None)
    @given(models())
    def collect(case):
        seen.update(n.op for n in graph_calls(case)[1])

    collect()
    assert {"placeholder", "output", "call_module", "call_function", "call_method",
            "get_attr"} <= seen


def test_invalid_arguments():
    for kwargs in [dict(max_nodes=0), dict(inputs=(0, 2)), dict(inputs=(3, 2)),
                   dict(inputs=(5, 6), max_nodes=4), dict(outputs="list"), dict(batch=(0, 2))]:
        with pytest.raises(InvalidArgument):
            models(**kwargs)


# --------------------------------------------------------------------------- #
# shrinking
# --------------------------------------------------------------------------- #
def test_find_shrinks_to_small_model():
    case = find(models(), has_cat, settings=settings(database=None, max_examples=500))
    assert has_cat(case)
    assert len(case.spec.ops) <= 3, repr(case)


def test_failing_test_reports_small_pasteable_model():
    failing_cases = []

    @settings(max_examples=50, deadline=None, database=None)
    @given(models(max_nodes=12))
    def model_has_no_cat(case):
        if has_cat(case):
            failing_cases.append(case)
            raise AssertionError("model contains torch.cat")

    with pytest.raises(AssertionError) as info:
        model_has_no_cat()
    minimal = failing_cases[-1]  # Hypothesis replays the shrunk example last
    assert len(minimal.spec.ops) <= 3, repr(minimal)

    report = "\n".join(getattr(info.value, "__notes__", []))
    assert "class Model(nn.Module):" in report
    # The code between the marker comments pastes as-is (after dedenting).
    block = re.search(r"# ModelCase source:\n(.*?)\n\s*# end of ModelCase source", report, re.S)
    assert block is not None, report
    ns = exec_source(textwrap.dedent(block.group(1)))
    torch.testing.assert_close(ns["model"](*ns["example_inputs"]),
                               minimal.model(*minimal.example_inputs))


# --------------------------------------------------------------------------- #
# misc
# --------------------------------------------------------------------------- #
@settings(max_examples=10, deadline=None, database=None)
@given(models(max_nodes=8))
def test_copy_and_pickle(case):
    model, example_inputs = case
    expected = model(*example_inputs)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(clone) is type(model)
        torch.testing.assert_close(clone(*example_inputs), expected)


def test_docstring_example_runs():
    doc = models.__doc__
    example = textwrap.dedent(doc.split("Example::\n", 1)[1].split("\n\n    On failure", 1)[0])
    assert "from fxpipe.testing import models" in example
    ns: dict = {}
    exec(compile(example, "<docstring>", "exec"), ns)
    ns["test_traced_model_matches_eager"]()


# --------------------------------------------------------------------------- #
# the idioms a pipeline must keep: dropout, training branches, grad regions,
# buffer updates
# --------------------------------------------------------------------------- #
IDIOMS = dict(dropout=True, training_branches=True, grad_regions=True, buffer_updates=True)


def test_idioms_are_off_by_default_and_each_is_generated_when_asked():
    def kinds(case):
        return {op.kind for op in case.spec.ops}

    idiom_kinds = {"dropout", "train_branch", "frozen_linear", "running_mean"}
    with pytest.raises(Exception):   # never drawn by default
        find(models(max_nodes=8), lambda c: kinds(c) & idiom_kinds,
             settings=settings(database=None, max_examples=300))
    for kind in idiom_kinds:
        find(models(max_nodes=8, **IDIOMS), lambda c, kind=kind: kind in kinds(c),
             settings=settings(database=None, max_examples=500))


@FAST
@given(models(max_nodes=10, **IDIOMS), st.booleans())
def test_idiom_models_paste_as_the_same_model_in_both_modes(case, training):
    pasted = exec_source(repr(case))["model"]
    model = case.model
    model.train(training)
    pasted.train(training)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        expected = flat(model(*case.example_inputs))
        torch.manual_seed(0)
        actual = flat(pasted(*case.example_inputs))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    for (name, a), (_, e) in zip(pasted.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(a, e, msg=name)


@FAST
@given(models(max_nodes=10, grad_regions=True))
def test_frozen_branches_get_no_gradient(case):
    model, inputs = case
    frozen = [getattr(model, op.attr) for op in case.spec.ops if op.kind == "frozen_linear"]
    out = sum(t.sum() for t in flat(model(*inputs)))
    if out.requires_grad:
        out.backward()
    assert all(p.grad is None for layer in frozen for p in layer.parameters())
