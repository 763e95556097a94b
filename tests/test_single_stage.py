"""A pipeline of one stage runs on the caller's thread: it costs what the model costs."""

import threading

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding


class Where(nn.Module):
    """A leaf recording the thread it runs on and the intra-op threads in effect there."""

    seen: list = []

    def forward(self, x):
        Where.seen.append((threading.current_thread() is threading.main_thread(),
                           torch.get_num_threads()))
        return x * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.where = nn.Linear(4, 4), Where()

    def forward(self, x):
        return self.where(self.fc(x)).relu()


@pytest.mark.parametrize("training", [False, True])
def test_one_stage_runs_on_the_callers_thread_with_its_threads_and_restores_the_callers(training):
    torch.manual_seed(0)
    model, x = Net().train(training), torch.randn(8, 4)
    pipe = fxpipe.compile(model, [fxpipe.DeviceSpec("cpu", threads=2)], (x,), chunks=2,
                          leaf_modules=[Where])
    caller = torch.get_num_threads()
    Where.seen = []
    if training:
        loss = pipe.train_step(x, torch.zeros(8, 4), nn.functional.mse_loss)
        expected = nn.functional.mse_loss(model(x), torch.zeros(8, 4))
        assert_same_up_to_rounding(loss, expected)
    else:
        assert_same_up_to_rounding(pipe(x), model(x))
    assert Where.seen[:2] == [(True, 2), (True, 2)]       # both micro-batches, here, 2 threads
    assert torch.get_num_threads() == caller


class Fails(nn.Module):
    def forward(self, x):
        if x.sum() > 1e9:
            raise RuntimeError("too large")
        return x


def test_a_failure_in_the_one_stage_is_a_stage_error_and_the_thread_count_is_restored():
    model = nn.Sequential(nn.Linear(4, 4), Fails())
    pipe = fxpipe.compile(model, [fxpipe.DeviceSpec("cpu", threads=2)], (torch.randn(2, 4),),
                          leaf_modules=[Fails])
    caller = torch.get_num_threads()
    with pytest.raises(fxpipe.StageError, match=r"stage 0[\s\S]*too large"):
        pipe(torch.full((2, 4), 1e12))
    assert torch.get_num_threads() == caller and pipe.last_run.failed


class Drops(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return nn.functional.dropout(self.fc(x), 0.5, training=self.training)


def test_the_model_as_is_runs_its_own_forward_from_the_micro_batch_seed(monkeypatch):
    from fxpipe.planning import search
    from fxpipe.planning.reference import run_per_microbatch
    from fxpipe.passes.randomness import microbatch_seeds

    # The choice rests on timings: on a busy machine a one-stage graph with other threads can
    # look faster than the model. The run is what is tested here, so the model as is wins.
    monkeypatch.setattr(search, "TIE", 0.99)
    torch.manual_seed(0)
    model, x = Drops().train(), torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu"], (x,), num_stages="auto")
    assert pipe.plan.runs_as_is
    calls = []
    forward = Drops.forward
    Drops.forward = lambda self, x: calls.append(1) or forward(self, x)
    try:
        torch.manual_seed(7)
        out = pipe(x)
        after = torch.rand(3)
    finally:
        Drops.forward = forward
    assert calls == [1]                   # the model's own forward, once, on the whole batch
    torch.manual_seed(7)
    seeds = microbatch_seeds(1)
    assert_same_up_to_rounding(out, run_per_microbatch(model, (x,), {}, 1, seeds=seeds)[0])
    torch.manual_seed(7)
    microbatch_seeds(1)
    torch.testing.assert_close(after, torch.rand(3))   # the caller's generator as the graph leaves it
    assert pipe.last_run.slots and not pipe.last_run.failed


def test_a_failure_of_the_model_as_is_is_a_stage_error():
    model = nn.Sequential(Fails(), nn.Linear(4, 4))
    pipe = fxpipe.compile(model, ["cpu"], (torch.randn(2, 4),), num_stages="auto",
                          leaf_modules=[Fails])
    assert pipe.plan.runs_as_is
    with pytest.raises(fxpipe.StageError, match=r"the model as is.*\n.*too large"):
        pipe(torch.full((2, 4), 1e12))
    assert pipe.last_run.failed


@pytest.mark.parametrize("counted", [False, True], ids=["mean", "sum-and-count"])
def test_train_step_of_the_model_as_is_runs_its_own_forward_and_backward(monkeypatch, counted):
    import copy

    from fxpipe.planning import search
    from fxpipe.passes.randomness import microbatch_seeds

    monkeypatch.setattr(search, "TIE", 0.99)      # as above: the run is what is tested
    torch.manual_seed(0)
    model, x, target = Drops().train(), torch.randn(8, 4), torch.randn(8, 4)
    reference = copy.deepcopy(model)
    pipe = fxpipe.compile(model, ["cpu"], (x,), num_stages="auto", training=True)
    assert pipe.plan.runs_as_is

    def loss_fn(out, t):
        if counted:
            return (out - t).square().sum(), torch.tensor(t.numel())
        return nn.functional.mse_loss(out, t)

    calls = []
    forward = Drops.forward
    monkeypatch.setattr(Drops, "forward", lambda self, x: calls.append(1) or forward(self, x))
    torch.manual_seed(7)
    loss = pipe.train_step(x, target, loss_fn)
    monkeypatch.setattr(Drops, "forward", forward)
    assert calls == [1]                   # the model's own forward, once, on the whole batch
    torch.manual_seed(7)
    torch.manual_seed(microbatch_seeds(1)[0])
    expected = nn.functional.mse_loss(reference(x), target)
    expected.backward()
    assert_same_training(model, reference, loss=(loss, expected))
    assert pipe.last_run.microbatches == 1 and not pipe.last_run.failed
