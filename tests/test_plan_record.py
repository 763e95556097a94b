"""A plan holds apart what runs and the record of what was weighed (`Plan`, `PlanRecord`), and
a saved plan keeps the layout of format 5: one object of fields, the record's among the rest."""

import dataclasses
import json

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.plans.plan_data import PlanRecord
from fxpipe.plans.plan_format import regrouped

# The fields of plan_data.json's "plan" object as format 5 was first written (before plans held
# their record apart): a saved plan keeps exactly these, so plans saved before and after load alike.
FORMAT_5_FIELDS = {
    "batch_dims", "calibration", "capture", "chosen", "chunks", "considered", "example_rows",
    "link", "measurements", "output_dims", "partition", "planning_peak_rss_bytes",
    "predicted_step_s", "raced", "reason", "recompute", "runs", "schedule", "signature",
    "spread", "stage_modules", "stage_param_bytes", "stage_recomputed", "stage_saved_bytes",
    "stage_spans", "stand_ins", "training", "unpipelined_s", "unpipelined_spread",
    "unpipelined_threads", "verified", "verify_tolerance", "verify_tolerance_source", "weights",
    "wiring",
    "host"}     # added since: a plan saved without it loads with nothing priced (`HostCosts()`)


@pytest.fixture(scope="module")
def planned():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4)).eval()
    x = torch.randn(12, 8)
    return model, x, fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=4)


def test_a_pipeline_runs_a_plan_without_its_record(planned):
    model, x, plan = planned
    bare = dataclasses.replace(plan, record=PlanRecord())
    with torch.no_grad():
        torch.testing.assert_close(fxpipe.Pipeline(bare)(x), model(x))
    assert plan.record.verified == "yes" and plan.record.chosen is not None


def test_a_saved_plan_keeps_format_5s_fields_and_its_record(planned, tmp_path):
    model, x, plan = planned
    plan.save(tmp_path / "plan")
    data = json.loads((tmp_path / "plan" / "plan_data.json").read_text())
    assert set(data["plan"]) == FORMAT_5_FIELDS
    loaded = fxpipe.load_plan(tmp_path / "plan")
    assert loaded.record == plan.record and str(loaded) == str(plan)
    with torch.no_grad():
        torch.testing.assert_close(fxpipe.Pipeline(loaded)(x), model(x))


def test_a_pickled_plan_of_format_4_gets_its_record_back(planned):
    _, _, plan = planned
    flat = dataclasses.replace(plan)           # as format 4 pickled it: every field on the plan
    state = vars(flat)
    for f in dataclasses.fields(PlanRecord):
        state[f.name] = getattr(state["record"], f.name)
    del state["record"]
    assert regrouped(flat).record == plan.record
    assert not {f.name for f in dataclasses.fields(PlanRecord)} & set(vars(flat))
