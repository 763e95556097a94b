"""Choosing stages, micro-batches and schedule: `chunks`, `num_stages` and `schedule` = "auto"."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.planning import search
from fxpipe.plans import prediction
from fxpipe.runtime.schedules import Phase, timetable_for
from fxpipe.testing import assert_pipeline_matches
from fxpipe.passes.cost_model import CostGraph, DeviceSpec
from fxpipe.passes.errors import PartitionError

CPU = DeviceSpec("cpu")


def candidate(stages, chunks, predicted_s, schedule="gpipe"):
    return prediction.Candidate(prediction.Config(stages, chunks, schedule, 1), predicted_s, 0)


candidates = st.lists(st.builds(candidate, st.integers(1, 4), st.sampled_from([1, 2, 4, 8]),
                                st.one_of(st.none(), st.floats(1e-3, 1.0))), min_size=1)


@given(candidates, st.floats(1e-3, 1.0))
def test_choose_never_picks_a_plan_predicted_slower_than_the_model(found, model_s):
    as_is = candidate(1, 1, model_s)
    fitting = [c for c in found if c.predicted_s is not None]
    if not fitting:
        assert search.choose(found, as_is)[0] is as_is
        with pytest.raises(PartitionError, match="no configuration fits"):
            search.choose(found, None)
        return
    chosen, reason = search.choose(found, as_is)
    assert chosen.predicted_s <= model_s
    fastest = min(c.predicted_s for c in fitting)
    if chosen is as_is:
        assert fastest >= model_s * (1 - search.TIE) and reason.startswith("no pipeline")
    else:
        assert chosen.predicted_s <= fastest * (1 + search.TIE)
        assert chosen.predicted_s < model_s * (1 - search.TIE)
        smaller = [c for c in fitting if c.predicted_s <= fastest * (1 + search.TIE)
                   and (c.config.num_stages, c.config.chunks)
                   < (chosen.config.num_stages, chosen.config.chunks)]
        assert not smaller, "among equally fast configurations the smallest wins"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, chunks", [(1, 1), (2, 3), (4, 8), (3, 2)])
def test_in_flight_micro_batches_are_read_off_the_timetable(schedule, stages, chunks):
    held = prediction.in_flight(True, schedule, chunks, stages)
    expected = [chunks if schedule == "gpipe" else min(chunks, stages - s) for s in range(stages)]
    assert held == expected
    assert prediction.in_flight(False, schedule, chunks, stages) == [1] * stages
    for s, actions in enumerate(timetable_for(schedule, stages, chunks, backward=True)):
        assert sum(a.phase is Phase.FORWARD for a in actions) == chunks


def chain(times_s):
    n = len(times_s)
    return CostGraph(names=("x",) + tuple(f"n{i}" for i in range(n)),
                     time_s=(0.0,) + tuple(times_s), out_bytes=(8,) * (n + 1),
                     param_bytes=(0,) * (n + 1),
                     preds=((),) + tuple((i,) for i in range(n)),
                     is_input=(True,) + (False,) * n, to_output=(False,) * n + (True,))


def test_a_balanced_chain_is_worth_pipelining_and_the_prediction_follows_the_timetable():
    graph = chain([0.01] * 8)
    costed = search.Costed(graph, graph)
    one = search.consider(search.Config(1, 1, "gpipe", 1), costed, [CPU] * 4, _free, False)
    four = search.consider(search.Config(4, 8, "gpipe", 1), search.Costed(chain([0.00125] * 8),
                                                                           chain([0.00125] * 8)),
                           [CPU] * 4, _free, False)
    assert one.predicted_s == pytest.approx(0.08)
    # 4 stages of 2.5 ms each, 8 micro-batches: (8 + 3) slots of the bottleneck.
    assert four.predicted_s == pytest.approx(11 * 0.0025)
    chosen, _ = search.choose([one, four], candidate(1, 1, 0.08))
    assert chosen is four


def _free(src, dst):
    return fxpipe.Link(0.0)


class Residual(nn.Module):
    def __init__(self, width=16, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width),
                                                  nn.GELU()) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize("training", [False, True])
def test_auto_chooses_a_configuration_it_predicts_no_slower_and_stays_equal(training):
    torch.manual_seed(0)
    model, x = Residual().train(training), torch.randn(16, 16)
    pipe = assert_pipeline_matches(model, (x,), devices=["cpu"] * 3, chunks="auto",
                                   num_stages="auto", schedule="auto", backward=True)
    plan = pipe.plan
    assert plan.record.chosen.predicted_s <= plan.record.unpipelined_s
    assert pipe.chunks == plan.record.chosen.config.chunks
    assert len(pipe.stages) == plan.record.chosen.config.num_stages
    configs = {(c.config.num_stages, c.config.chunks, c.config.schedule) for c in plan.record.considered}
    assert {1, 2, 3} <= {stages for stages, _, _ in configs}
    assert {"gpipe", "1f1b"} <= {s for _, _, s in configs} if training else True
    assert "configurations considered" in str(plan) and f"chosen: {plan.record.reason}" in str(plan)


def test_fixed_stages_with_auto_chunks_use_every_device_and_keep_the_result():
    torch.manual_seed(0)
    model, x = Residual().eval(), torch.randn(16, 16)
    pipe = assert_pipeline_matches(model, (x,), devices=["cpu"] * 2, chunks="auto")
    assert len(pipe.stages) == 2
    assert {c.config.chunks for c in pipe.plan.record.considered} == {1, 2, 4, 8}


class BatchMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).mean()        # reduces over the batch


def test_auto_chunks_keep_the_batch_whole_where_micro_batches_would_change_the_result():
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    model = BatchMean().eval()
    pipe = fxpipe.compile(model, ["cpu"], (x,), chunks="auto")
    assert pipe.chunks == 1
    assert_same_up_to_rounding(pipe(x), model(x))
    with pytest.raises(fxpipe.BatchError, match="reduces over the batch"):
        fxpipe.compile(model, ["cpu"], (x,), chunks=2)
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    pipe = fxpipe.compile(bn, ["cpu", "cpu"], (x,), chunks="auto")
    assert pipe.chunks == 1      # BatchNorm in training normalises the batch it is given


def test_bad_auto_options_are_named():
    model, x = Residual(), torch.randn(4, 16)
    with pytest.raises(fxpipe.BatchError, match="'auto'"):
        fxpipe.compile(model, ["cpu"], (x,), chunks="many")
    with pytest.raises(fxpipe.FxpipeError, match="'auto'"):
        fxpipe.compile(model, ["cpu"], (x,), schedule="fast")


def test_one_device_with_auto_stages_is_the_model_as_is():
    torch.manual_seed(0)
    model, x = Residual().eval(), torch.randn(16, 16)
    # With the caller's threads, one stage is the model as is, not a configuration to time
    # against it (with other threads the two race, and either may win on a busy machine).
    pipe = fxpipe.compile(model, ["cpu"], (x,), num_stages="auto",
                          threads_per_stage=torch.get_num_threads())
    assert pipe.plan.runs_as_is and len(pipe.stages) == 1 and pipe.chunks == 1
    assert_same_up_to_rounding(pipe(x), model(x))


def test_a_gpu_stage_keeps_a_core_for_the_thread_that_launches_its_kernels():
    """In a mixed plan the CPU stages share the cores left once each GPU stage's launching
    thread has one, and the prediction counts that thread among the cores asked for."""
    devices = [CPU, CPU, DeviceSpec("cuda:0")]
    assert search.stage_threads(devices, 3, cores=8, fixed=None) == 3
    assert search.stage_threads(devices, 2, cores=8, fixed=None) == 4
    assert prediction.cpu_demand([DeviceSpec("cpu", threads=3), DeviceSpec("cuda:0")]) == [3, 1]


def test_auto_never_weighs_two_stages_on_one_gpu_and_a_fixed_count_is_kept():
    gpu0, gpu1 = DeviceSpec("cuda:0"), DeviceSpec("cuda:1")
    assert search.stage_counts([gpu0, gpu0], "auto") == [1]
    assert search.stage_counts([gpu0, CPU, gpu1, gpu0], "auto") == [1, 2, 3]
    assert search.stage_counts([CPU] * 3, "auto") == [1, 2, 3]
    assert search.stage_counts([gpu0, gpu0], 2) == [2]
    assert search.stage_counts([gpu0, gpu0], None) == [2]


def test_stages_on_one_gpu_are_one_pool_and_a_gpu_alone_none():
    devices = [DeviceSpec("cuda:0"), CPU, DeviceSpec("cuda:1"), DeviceSpec("cuda:0")]
    assert prediction.gpu_pools(devices) == [(1.0, [1, 0, 0, 1])]
    assert prediction.gpu_pools([DeviceSpec("cuda:0"), DeviceSpec("cuda:1"), CPU]) == []
