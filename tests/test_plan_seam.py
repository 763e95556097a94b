"""`fxpipe.plan` is a seam: it returns a complete Plan before any Pipeline exists, starting no
stage worker, and `Pipeline(plan)` runs it as the model runs."""

import copy
import dataclasses
import json
import threading
from typing import get_args

import pytest
import torch
from torch.nn import functional as F

import fxpipe
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding
from fxpipe.__main__ import main
from fxpipe.planning.options import LinkName, Options, Recompute
from fxpipe.plans.plan_data import Plan
from fxpipe.passes.stage import Stage
from nets import Skips


@pytest.fixture
def no_pipeline_no_worker(monkeypatch):
    """Inside: building a Pipeline fails, and the name of every thread started is recorded."""
    started = []
    start = threading.Thread.start

    def recording(thread):
        started.append(thread.name)
        return start(thread)

    def no_pipeline(*args, **kwargs):
        raise AssertionError("a Pipeline was built")

    monkeypatch.setattr(threading.Thread, "start", recording)
    monkeypatch.setattr(fxpipe.Pipeline, "__init__", no_pipeline)
    yield started
    monkeypatch.undo()


def stage_workers(names):
    return [n for n in names if n.startswith(("fxpipe-stage", "fxpipe-stream"))]


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_plan_builds_no_pipeline_and_starts_no_stage_worker(no_pipeline_no_worker, training,
                                                            chunks, devices, monkeypatch):
    torch.manual_seed(0)
    model, x = Skips().train(training), torch.randn(12, 16)
    before = set(threading.enumerate())
    plan = fxpipe.plan(model, ["cpu"] * devices, (x,), chunks=chunks, training=training)
    assert stage_workers(no_pipeline_no_worker) == []
    # Measuring what a hand-off costs here (once a layout) runs probes that end with it.
    assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("fxpipe")]
    assert isinstance(plan, Plan) and plan.partition.num_stages == devices
    assert plan.record.predicted_step_s and plan.record.predicted_step_s > 0
    assert plan.output_dims == ((0,) if chunks > 1 else None)
    monkeypatch.undo()

    pipe = fxpipe.Pipeline(plan)
    reference = copy.deepcopy(model)
    if not training:
        with torch.no_grad():
            assert_same_up_to_rounding(pipe(x), model(x))
        return
    target = torch.randn(12, 4)
    loss = pipe.train_step(x, target, F.mse_loss)
    expected = F.mse_loss(reference(x), target)
    expected.backward()
    assert_same_training(pipe, reference, loss=(loss, expected))


def test_a_plan_prints_as_the_pipeline_compiled_with_it():
    torch.manual_seed(0)
    model, x = Skips().eval(), torch.randn(12, 16)
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2)
    text = str(plan)
    assert text.startswith("fxpipe plan: 2 stages, 2 micro-batches")
    assert "per batch: pipeline " in text and " ms predicted, model unpipelined " in text
    assert text.splitlines()[-1].startswith("outputs checked against the model: yes, within ")
    assert str(fxpipe.Pipeline(plan).plan) == text
    compiled = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2).plan

    def shape(plan_text):       # warnings follow this run's timings (a loaded machine adds some)
        return [line.split()[0] for line in plan_text.splitlines()
                if not line.startswith("warning:")]
    assert shape(str(compiled)) == shape(text)
    assert compiled.output_dims == plan.output_dims == (0,)


@pytest.mark.parametrize("option, error", [
    ({"chunks": 0}, fxpipe.BatchError), ({"recompute": "sometimes"}, fxpipe.FxpipeError),
    ({"num_stages": 3}, fxpipe.PartitionError), ({"link": "fast"}, fxpipe.CostError),
    ({"optimizer": "lion"}, fxpipe.FxpipeError)])
def test_options_are_checked_before_anything_runs(option, error, monkeypatch):
    import fxpipe.api

    monkeypatch.setattr(fxpipe.planning.recipe.Recipe, "of", lambda *a: pytest.fail("planning began"))
    with pytest.raises(error, match=next(iter(option))):
        fxpipe.plan(Skips(), ["cpu"] * 2, (torch.randn(4, 16),), **option)
    options = Options(["cpu"] * 2, chunks="auto")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.chunks = 2
    assert options.devices == tuple(fxpipe.DeviceSpec("cpu") for _ in range(2))


def test_the_command_line_offers_the_choices_the_options_take():
    from fxpipe.__main__ import _parser

    plan = _parser()._subparsers._group_actions[0].choices["plan"]
    choices = {a.dest: tuple(a.choices) for a in plan._actions if a.choices}
    assert choices["recompute"] == get_args(Recompute) and choices["link"] == get_args(LinkName)


def test_the_command_line_plans_and_saves_without_a_pipeline(no_pipeline_no_worker, tmp_path,
                                                           capsys):
    assert main(["plan", "torch.nn:TransformerEncoderLayer", "--kwargs",
                 '{"d_model": 32, "nhead": 4, "batch_first": true, "dropout": 0.0}',
                 "--input", "8x10x32", "--chunks", "2", "--quiet",
                 "--save", str(tmp_path / "plan")]) == 0
    assert capsys.readouterr().out.startswith("fxpipe plan: 2 stages, 2 micro-batches")
    assert stage_workers(no_pipeline_no_worker) == []
    assert (tmp_path / "plan" / "timeline.svg").is_file()


def test_a_plan_names_no_module_path_of_fxpipe_so_its_classes_may_move(tmp_path, monkeypatch):
    """A saved plan (format 5) names its types by names of its own (`Plan`, `Stage` is no
    type there at all), not by the modules that define them: a class that moved, as Stage
    moved from `fxpipe.passes.codegen`, leaves saved plans readable."""
    torch.manual_seed(0)
    model, x = Skips().eval(), torch.randn(12, 16)
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2)
    monkeypatch.setattr(Stage, "__module__", "fxpipe.passes.codegen")
    plan.save(tmp_path / "plan")
    monkeypatch.undo()
    data = (tmp_path / "plan" / "plan_data.json").read_bytes()
    assert b"fxpipe.passes" not in data and b"fxpipe.plans.plan_data" not in data
    loaded = fxpipe.load_plan(tmp_path / "plan")
    assert type(loaded) is Plan and all(type(s) is Stage for s in loaded.stages)
    with torch.no_grad():
        assert_same_up_to_rounding(fxpipe.Pipeline(loaded)(x), model(x))


def test_diff_compares_plans_saved_by_other_versions(tmp_path, capsys):
    """`fxpipe diff` reads plan.json through `fxpipe.plans.saved.plan_document`: the checks of a load
    but the versions', which a plan from another torch passes."""
    from fxpipe.plans.saved import _content_digest

    torch.manual_seed(0)
    model, x = Skips().eval(), torch.randn(12, 16)
    for name, k in (("two", 2), ("three", 3)):
        fxpipe.plan(model, ["cpu"] * k, (x,), chunks=2).save(tmp_path / name)
    path = tmp_path / "three" / "plan.json"
    document = json.loads(path.read_text())
    document["torch"] = "1.0.0"
    document["sha256"] = _content_digest(document)
    path.write_text(json.dumps(document))
    with pytest.raises(fxpipe.PlanFileError, match=r"torch 1\.0\.0 \(saved\)"):
        fxpipe.load_plan(tmp_path / "three")
    assert main(["diff", str(tmp_path / "two"), str(tmp_path / "three")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("devices:") and "\ntorch: " in out and "| 1.0.0\n" in out
