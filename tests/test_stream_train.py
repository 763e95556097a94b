"""pipe.stream_train: learning on a stream, window by window, equal to the model trained on the
same windows; stopping and failures leave no thread and write nothing afterwards."""

import copy
import signal
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn
from torch.nn import functional as F

import fxpipe
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding
from fxpipe.runtime.workers import working
from fxpipe.passes.randomness import microbatch_seeds


class Drifting(nn.Module):
    """BatchNorm in training mode (running statistics, a batch counter) and dropout: what an
    item's buffers and seed change."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16)
        self.mid = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        h = torch.relu(self.norm(self.embed(x)))
        return self.head(self.drop(torch.tanh(self.mid(h))) + h)


def ours() -> list:
    """The stage workers still running a job: none once a stream ended (they park, at rest)."""
    return sorted(working(), key=id)


def stream_of(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` items of 2 rows (BatchNorm trains on 2 rows), targets rotating slowly."""
    g = torch.Generator().manual_seed(1)
    items = []
    for i in range(count):
        x = torch.randn(2, 6, generator=g)
        angle = torch.tensor(0.1 * i)
        items.append((x, x[:, :2] @ torch.stack([angle.cos(), angle.sin()]).diag()))
    return items


def compiled(stages: int, schedule: str = "gpipe"):
    """The model, an untouched copy of it, the pipeline and both optimizers (with momentum:
    optimizer state)."""
    torch.manual_seed(0)
    model = Drifting()
    reference = copy.deepcopy(model)
    pipe = fxpipe.compile(model, ["cpu"] * stages, (torch.randn(2, 6),), schedule=schedule)
    return (pipe, reference, torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9),
            torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))


def trained_on_windows(model, optimizer, windows, seed=0):
    """The reference: the model trained on each window in turn, each item run from its seed
    (one per item, drawn per window as a train step draws them), the window's loss the mean
    over its rows; its state after each window."""
    torch.manual_seed(seed)
    states = []
    for window in windows:
        seeds = microbatch_seeds(len(window))
        rows = sum(len(x) for x, _ in window)
        optimizer.zero_grad()
        loss = 0
        for (x, target), s in zip(window, seeds):
            with torch.random.fork_rng():
                torch.manual_seed(s)
                loss = loss + F.mse_loss(model(x), target) * len(x) / rows
        loss.backward()
        optimizer.step()
        states.append((loss.detach(), state_of(model)))
    return states


def state_of(module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (running statistics, the batch counter), copied."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def windows_of(items, window, partial):
    cut = [items[i:i + window] for i in range(0, len(items), window)]
    return cut if partial == "train" else [w for w in cut if len(w) == window]


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("window, partial", [(1, "train"), (3, "train"), (3, "drop")])
def test_each_window_equals_the_model_trained_on_the_same_windows(stages, window, partial):
    pipe, reference, opt, ref_opt = compiled(stages)
    items = stream_of(7)
    torch.manual_seed(0)
    states = [(loss, state_of(pipe))
              for loss in pipe.stream_train(items, F.mse_loss, opt, window=window,
                                            partial=partial)]
    expected = trained_on_windows(reference, ref_opt, windows_of(items, window, partial))
    assert len(states) == len(expected) == (7 if window == 1 else 3 if partial == "train" else 2)
    for (loss, state), (ref_loss, ref_state) in zip(states, expected):
        assert_same_up_to_rounding(loss, ref_loss)
        assert_same_up_to_rounding(state, ref_state)
    assert_same_training(pipe, reference)
    assert not ours()


@pytest.fixture(scope="module")
def two_stages():
    return compiled(2)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(count=st.integers(0, 8), window=st.integers(1, 4),
       partial=st.sampled_from(["train", "drop"]))
def test_any_stream_cut_into_windows_equals_the_model_trained_on_them(two_stages, count, window,
                                                                     partial):
    pipe, untrained, _, _ = two_stages
    pipe.load_state_dict(untrained.state_dict())
    reference = copy.deepcopy(untrained)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    items = stream_of(count)
    torch.manual_seed(0)
    states = [(loss, state_of(pipe))
              for loss in pipe.stream_train(items, F.mse_loss, opt, window=window,
                                            partial=partial)]
    assert_same_up_to_rounding(
        states, trained_on_windows(reference, ref_opt, windows_of(items, window, partial)))


def test_1f1b_windows_equal_the_model_trained_on_the_same_windows():
    pipe, reference, opt, ref_opt = compiled(2, schedule="1f1b")
    items = stream_of(8)
    torch.manual_seed(0)
    states = [state_of(pipe) for _ in pipe.stream_train(items, F.mse_loss, opt, window=4)]
    expected = trained_on_windows(reference, ref_opt, windows_of(items, 4, "train"))
    assert_same_up_to_rounding(states, [state for _, state in expected])


def test_items_may_be_tuples_or_dicts_of_the_models_inputs():
    pipe, reference, opt, ref_opt = compiled(2)
    (x, t), (y, u) = stream_of(2)
    torch.manual_seed(0)
    losses = list(pipe.stream_train([((x,), t), ({"x": y}, u)], F.mse_loss, opt, window=2))
    (expected, _), = trained_on_windows(reference, ref_opt, [[(x, t), (y, u)]])
    assert_same_up_to_rounding(losses, [expected])


def test_an_empty_stream_trains_nothing():
    pipe, _, opt, _ = compiled(2)
    before = state_of(pipe)
    assert list(pipe.stream_train([], F.mse_loss, opt, window=3)) == []
    assert_same_up_to_rounding(state_of(pipe), before)


def grads_and_optimizer_state(pipe, opt):
    return ([None if p.grad is None else p.grad.clone() for p in pipe.parameters()],
            {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()})


def assert_nothing_written_after(pipe, opt, caught):
    time.sleep(0.3)
    torch.testing.assert_close(grads_and_optimizer_state(pipe, opt), caught, rtol=0, atol=0)


def test_leaving_the_loop_stops_after_the_window_yielded():
    pipe, reference, opt, ref_opt = compiled(3)
    items = stream_of(9)
    torch.manual_seed(0)
    for loss in pipe.stream_train(iter(items), F.mse_loss, opt, window=3):
        break
    caught = grads_and_optimizer_state(pipe, opt)
    assert not ours()
    [(_, expected)] = trained_on_windows(reference, ref_opt, [items[:3]])
    assert_same_up_to_rounding(state_of(pipe), expected)
    assert_nothing_written_after(pipe, opt, caught)


def test_a_source_that_raises_trains_only_the_windows_it_completed():
    pipe, reference, opt, ref_opt = compiled(2)
    items = stream_of(4)

    def source():
        yield from items
        raise OSError("sensor unplugged")

    torch.manual_seed(0)
    losses = []
    with pytest.raises(OSError, match="sensor unplugged"):
        for loss in pipe.stream_train(source(), F.mse_loss, opt, window=3):
            losses.append(loss)
    assert len(losses) == 1 and not ours()
    [(_, expected)] = trained_on_windows(reference, ref_opt, [items[:3]])
    assert_same_up_to_rounding(state_of(pipe), expected)


def test_an_exception_in_the_consumers_loop_leaves_no_worker_and_writes_nothing():
    pipe, _, opt, _ = compiled(3)
    endless = (item for _ in iter(int, 1) for item in stream_of(3))
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(pipe.stream_train(endless, F.mse_loss, opt, window=2)):
            if i == 2:
                caught = grads_and_optimizer_state(pipe, opt)
                raise KeyboardInterrupt     # as Ctrl-C would, in the consumer's code
    assert not ours()
    assert_nothing_written_after(pipe, opt, caught)


def test_a_failing_item_names_its_stage_and_index_and_its_window_leaves_no_gradient():
    pipe, reference, opt, ref_opt = compiled(2)
    items = stream_of(6)
    items[4] = (torch.randn(2, 3), items[4][1])       # 3 features where the model takes 6
    torch.manual_seed(0)
    with pytest.raises(fxpipe.StageError, match=r"stage 0 .*on item 4 \(forward\)") as info:
        list(pipe.stream_train(items, F.mse_loss, opt, window=3))
    assert info.value.microbatch == 4 and info.value.stage == 0 and not ours()
    assert all(p.grad is None for p in pipe.parameters())
    [(_, expected)] = trained_on_windows(reference, ref_opt, [items[:3]])
    assert_weights_of_the_windows_yielded(pipe, expected)


def assert_weights_of_the_windows_yielded(pipe, expected):
    """The parameters are those after the windows yielded; buffers hold the forwards that ran
    in the failed window too (as after a failed train_step)."""
    assert_same_up_to_rounding(dict(pipe.named_parameters()),
                               {name: expected[name] for name, _ in pipe.named_parameters()})


class PressesCtrlC:
    """A forward hook that, on its `on`-th call, sends SIGINT to the caller's thread, then keeps
    its stage busy a while longer than the caller takes to notice."""

    def __init__(self, on: int):
        self.on = on
        self.calls = 0

    def __call__(self, module, inputs, output):
        self.calls += 1
        if self.calls == self.on:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.5)


@pytest.fixture
def ctrl_c():
    """Ctrl-C raises KeyboardInterrupt even where SIGINT is ignored (a shell's background job)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_inside_a_window_joins_every_worker_and_writes_nothing_afterwards(ctrl_c):
    pipe, reference, opt, ref_opt = compiled(2)
    items = stream_of(6)
    pipe.module.mid.register_forward_hook(PressesCtrlC(on=5))     # item 4, in window 2
    torch.manual_seed(0)
    losses = []
    try:
        for loss in pipe.stream_train(items, F.mse_loss, opt, window=3):
            losses.append(loss)
    except KeyboardInterrupt:
        alive, caught = ours(), grads_and_optimizer_state(pipe, opt)
    else:
        pytest.fail("Ctrl-C did not reach the caller")
    assert alive == [] and len(losses) == 1
    assert all(g is None for g in caught[0])           # the window's gradients are gone
    assert_nothing_written_after(pipe, opt, caught)
    [(_, expected)] = trained_on_windows(reference, ref_opt, [items[:3]])
    assert_weights_of_the_windows_yielded(pipe, expected)


def test_bad_arguments_are_refused_when_called():
    pipe, _, opt, _ = compiled(2)
    with pytest.raises(fxpipe.BatchError, match="window=0"):
        pipe.stream_train([], F.mse_loss, opt, window=0)
    with pytest.raises(fxpipe.BatchError, match="'train'.*'drop'"):
        pipe.stream_train([], F.mse_loss, opt, partial="keep")
    with pytest.raises(fxpipe.InputError, match=r"pipe.parameters\(\)"):
        pipe.stream_train([], F.mse_loss, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1))
    with pytest.raises(fxpipe.InputError, match=r"item 1 of the stream[\s\S]*pairs"):
        list(pipe.stream_train([stream_of(1)[0], torch.randn(2, 6)], F.mse_loss, opt, window=2))
    x, t = stream_of(1)[0]
    with pytest.raises(fxpipe.BatchError, match="item 0 of the stream.*3 rows.*2"):
        list(pipe.stream_train([(x, torch.randn(3, 2))], F.mse_loss, opt))
