"""pipe.stream: each item through the stages as it comes, outputs in order, no thread left."""

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.runtime.workers import working
from fxpipe.testing import models


def ours() -> list:
    """The stage workers still running a job: none once a stream ended (they park, at rest)."""
    return sorted(working(), key=id)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, scale: float = 1.0):
        h = torch.relu(self.a(x))
        return {"out": self.c(torch.tanh(self.b(h)) + h) * scale, "skip": h}


def compiled(stages: int):
    torch.manual_seed(0)
    model = Branchy().eval()
    return model, fxpipe.compile(model, ["cpu"] * stages, (torch.randn(1, 8),))


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_stream_equals_the_model_item_by_item_in_order(stages):
    model, pipe = compiled(stages)
    items = [torch.randn(1, 8) for _ in range(25)]
    with torch.no_grad():
        outputs = list(pipe.stream(items, max_in_flight=3))
        assert len(outputs) == len(items)
        for out, x in zip(outputs, items):
            assert_same_up_to_rounding(out, model(x))
    assert not ours()


def test_items_may_be_tuples_or_dicts_of_the_models_inputs():
    model, pipe = compiled(2)
    x = torch.randn(1, 8)
    with torch.no_grad():
        tuple_out, dict_out = pipe.stream([(x,), {"x": x}])
        assert_same_up_to_rounding(tuple_out, model(x))
        assert_same_up_to_rounding(dict_out, model(x))


def test_an_empty_stream_yields_nothing():
    _, pipe = compiled(2)
    assert list(pipe.stream([])) == []
    assert not ours()


def test_an_iterable_that_raises_stops_the_stream_and_its_workers():
    _, pipe = compiled(3)

    def frames():
        for _ in range(4):
            yield torch.randn(1, 8)
        raise OSError("camera unplugged")

    seen = []
    with pytest.raises(OSError, match="camera unplugged"):
        for out in pipe.stream(frames()):
            seen.append(out)
    assert len(seen) <= 4 and not ours()


def test_a_consumer_that_stops_early_leaves_no_worker():
    _, pipe = compiled(3)
    endless = (torch.randn(1, 8) for _ in iter(int, 1))
    for i, _ in enumerate(pipe.stream(endless)):
        if i == 5:
            break
    assert not ours()


def test_a_failing_item_names_its_stage_and_index():
    _, pipe = compiled(2)
    items = [torch.randn(1, 8), torch.randn(1, 8), torch.randn(1, 3), torch.randn(1, 8)]
    with pytest.raises(fxpipe.StageError, match=r"stage 0 .*on item 2") as info:
        list(pipe.stream(items))
    assert info.value.microbatch == 2 and not ours()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models(max_nodes=12, batch=(1, 1)))
def test_generated_models_stream_as_they_run(case):
    model, example = case
    try:
        pipe = fxpipe.compile(model, ["cpu"] * 2, example)
    except fxpipe.PartitionError:
        return       # too few nodes for two stages
    items = [tuple(torch.randn_like(t) for t in example) for _ in range(6)]
    with torch.no_grad():
        outputs = list(pipe.stream(items))
        assert len(outputs) == len(items)
        for out, x in zip(outputs, items):
            assert_same_up_to_rounding(out, model(*x))
    assert not ours()


def test_the_plan_predicts_a_streams_rate_and_latency():
    _, pipe = compiled(3)
    rate, latency = pipe.plan.stream_prediction
    stages = pipe.plan.partition.stages
    assert rate == pytest.approx(1 / max(c.forward_step_s for c in stages))
    # One item alone goes through every stage, those not reading each other side by side.
    times = [c.forward_step_s for c in stages]
    assert max(times) * (1 - 1e-9) <= latency <= sum(times) * (1 + 1e-9)


def test_an_exception_in_the_consumers_loop_leaves_no_worker():
    _, pipe = compiled(3)
    endless = (torch.randn(1, 8) for _ in iter(int, 1))
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(pipe.stream(endless)):
            if i == 3:
                raise KeyboardInterrupt     # as Ctrl-C would, in the consumer's code
    assert not ours()


def test_a_stream_orders_against_the_callers_streams_as_a_call_does(monkeypatch):
    """Each stage waits for the caller's queued work before the first item, and the caller's
    later work waits for every stage when the stream ends, both on the caller's thread (on a
    CPU these do nothing; on a GPU they order the streams: tests/gpu)."""
    from fxpipe.runtime.executor import StageExecutor
    _, pipe = compiled(2)
    calls = []
    for name in ("wait_for_caller", "make_caller_wait"):
        monkeypatch.setattr(StageExecutor, name, lambda self, _name=name: calls.append(
            (_name, self.stage.index, threading.current_thread() is threading.main_thread())))
    flowing = pipe.stream(torch.randn(1, 8) for _ in range(3))
    next(flowing)
    assert calls == [("wait_for_caller", 0, True), ("wait_for_caller", 1, True)]
    list(flowing)
    assert calls[2:] == [("make_caller_wait", 0, True), ("make_caller_wait", 1, True)]


class Noisy(nn.Module):
    """Dropout in training mode throughout: every stage draws for every item."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return x


def test_item_seeds_drawn_while_stages_draw_are_the_callers_own():
    """Each item's seed is drawn from the caller's generator as it is fed, while stages draw
    with their own states installed in that generator: the seeds (and so every item's draws)
    are those the caller's generator gives, in order."""
    torch.manual_seed(0)
    model = Noisy().train()
    pipe = fxpipe.compile(model, ["cpu"] * 3, (torch.randn(4, 32),), progress=False)
    items = [torch.randn(4, 32) for _ in range(120)]
    torch.manual_seed(1)
    with torch.no_grad():
        outputs = list(pipe.stream(items, max_in_flight=6))
    torch.manual_seed(1)
    seeds = [fxpipe.passes.randomness.microbatch_seeds(1)[0] for _ in items]
    with torch.no_grad():
        for out, x, seed in zip(outputs, items, seeds):
            torch.manual_seed(seed)
            assert_same_up_to_rounding(out, model(x))
