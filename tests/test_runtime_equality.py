"""The runtime keeps the model's semantics: seeded randomness, whole-batch token losses, and runs
that end cleanly (Ctrl-C, any exception) with a record of what ran."""

import _thread
import copy
import io
import pickle
import signal
import threading
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fxpipe
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding
from fxpipe.runtime.workers import working
from fxpipe.passes.randomness import microbatch_seeds


class Noisy(nn.Module):
    """Dropout as a module and as a function, and noise drawn in any mode."""

    def __init__(self, width=8):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.c = nn.Linear(width, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(torch.relu(self.a(x)))
        h = F.dropout(torch.tanh(self.b(h)), 0.3, training=self.training)
        return self.c(h + 0.1 * torch.randn_like(h))


def per_microbatch(model, x, chunks, seed):
    """The RNG contract's reference: the model on each micro-batch, reseeded with its seed."""
    torch.manual_seed(seed)
    seeds = microbatch_seeds(chunks)
    outputs = []
    for xm, s in zip(x.tensor_split(chunks), seeds):
        torch.manual_seed(s)
        outputs.append(model(xm))
    return torch.cat(outputs)


def fxpipe_threads():
    """The stage workers still running a job: none once a run returned (they park between
    runs, at rest)."""
    return sorted(working(), key=id)


# --- item 9: one seed, one result -----------------------------------------------------------------

@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_dropout_follows_the_callers_seed_on_any_number_of_stages(capture, stages):
    model = Noisy().train()
    x = torch.randn(12, 8)
    pipe = fxpipe.compile(model, ["cpu"] * stages, (x,), chunks=4, capture=capture)
    torch.manual_seed(123)
    first = pipe(x)
    torch.manual_seed(123)
    again = pipe(x)
    torch.testing.assert_close(again, first)
    assert_same_up_to_rounding(first, per_microbatch(model, x, 4, seed=123))
    assert not torch.equal(pipe(x), first)          # the next call draws new numbers


def test_noise_in_eval_mode_follows_the_seed_and_leaves_the_caller_where_the_seeds_did():
    model = Noisy().eval()
    x = torch.randn(9, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=3, verify=False)
    torch.manual_seed(7)
    out = pipe(x)
    after_pipe = torch.rand(3)
    assert_same_up_to_rounding(out, per_microbatch(model, x, 3, seed=7))
    after_seeds = torch.rand(3)              # per_microbatch drew the seeds, then reseeded: redo
    torch.manual_seed(7)
    microbatch_seeds(3)
    torch.testing.assert_close(after_pipe, torch.rand(3))
    assert not torch.equal(after_seeds, after_pipe)


def test_dropout_modules_of_a_pipeline_compiled_in_eval_mode_follow_the_seed_after_train():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.2),
                          nn.Linear(8, 8), nn.Dropout(0.4), nn.Linear(8, 4)).eval()
    x = torch.randn(8, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 4, (x,), chunks=4)
    assert_same_up_to_rounding(pipe(x), model(x))
    pipe.train()
    model.train()
    torch.manual_seed(3)
    assert_same_up_to_rounding(pipe(x), per_microbatch(model, x, 4, seed=3))


class Jitter(nn.Module):
    """A module of the user's that fxpipe keeps whole: its code is not in the graph."""

    def forward(self, x):
        return x + torch.rand_like(x)


class Draws(nn.Module):
    """Random numbers drawn every other way: in-place, factories, inside modules."""

    def __init__(self, width=8):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.jitter = Jitter()
        self.lstm = nn.LSTM(width, width, num_layers=2, dropout=0.5, batch_first=True)

    def forward(self, x):
        h = self.a(x)
        h = h * torch.empty_like(h).uniform_(0.5, 1.5) + torch.bernoulli(torch.full_like(h, 0.7))
        h = self.jitter(h) + torch.randn(h.shape[1])
        out, _ = self.lstm(h.unsqueeze(1))
        out = out.squeeze(1)
        return self.b(torch.sigmoid(out).bernoulli() * out)


def test_every_kind_of_draw_follows_the_seed():
    model = Draws().train()
    x = torch.randn(9, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=3, capture="fx",
                          leaf_modules=[Jitter])
    torch.manual_seed(0)
    first = pipe(x)
    torch.manual_seed(0)
    torch.testing.assert_close(pipe(x), first)
    assert_same_up_to_rounding(first, per_microbatch(model, x, 3, seed=0))


class FrozenNoise(nn.Module):
    """Dropout inside a no_grad region: torch.export puts it in a higher-order op's body."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            h = F.dropout(self.a(x), 0.5, training=True)
        return self.c(F.dropout(self.b(h + x), 0.5, training=True)) + x


def test_draws_inside_an_exported_no_grad_region_follow_the_seed():
    model = FrozenNoise()
    x = torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=4, capture="export", verify=False)
    torch.manual_seed(1)
    assert_same_up_to_rounding(pipe(x), per_microbatch(model, x, 4, seed=1))


def test_the_graph_run_outside_a_pipeline_draws_as_the_model_does():
    model = Noisy().train()
    x = torch.randn(6, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    torch.manual_seed(11)
    expected = model(x)
    torch.manual_seed(11)
    torch.testing.assert_close(pipe.module(x), expected)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_train_step_with_dropout_has_the_gradients_of_the_seeded_per_microbatch_run(schedule):
    model = Noisy().train()
    reference = copy.deepcopy(model)
    x, target = torch.randn(12, 8), torch.randn(12, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=3, schedule=schedule)
    torch.manual_seed(5)
    loss = pipe.train_step(x, target, F.mse_loss)

    torch.manual_seed(5)
    seeds = microbatch_seeds(3)
    expected = 0
    for xm, tm, s in zip(x.tensor_split(3), target.tensor_split(3), seeds):
        torch.manual_seed(s)
        expected = expected + F.mse_loss(reference(xm), tm) * len(xm) / len(x)
    expected.backward()
    assert_same_training(pipe, reference, loss=(loss, expected))


def test_a_model_without_randomness_runs_unchanged():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh()).eval()
    x = torch.randn(8, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4)
    assert "seeded" not in "".join(stage.code for stage in pipe.stages)
    assert_same_up_to_rounding(pipe(x), model(x))


# --- item 7: a loss that cannot reach .grad -------------------------------------------------------

def test_a_loss_fn_that_detaches_is_refused_and_leaves_grad_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x, target = torch.randn(8, 4), torch.randn(8, 1)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    with pytest.raises(fxpipe.StageError, match=r"loss_fn returned a loss that does not require "
                                                r"grad[\s\S]*no \.detach\(\)"):
        pipe.train_step(x, target, lambda out, t: F.mse_loss(out.detach(), t))
    assert all(p.grad is None for p in pipe.parameters())


def test_a_model_without_parameters_still_trains_without_gradients():
    model = nn.Sequential(nn.ReLU(), nn.Tanh())
    x, target = torch.randn(8, 4), torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    loss = pipe.train_step(x, target, F.mse_loss)
    assert_same_up_to_rounding(loss, F.mse_loss(model(x), target))


# --- item 8: token losses -------------------------------------------------------------------------

class TinyLM(nn.Module):
    def __init__(self, vocab=13, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def padded_batch(rows=8, length=6, vocab=13):
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (rows, length))
    target = torch.randint(0, vocab, (rows, length))
    for r in range(rows):                   # ragged sequences: rows keep 1..length tokens
        target[r, 1 + (r * 5) % length:] = -100
    return ids, target


def token_loss_sum(logits, target):
    return (F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100,
                            reduction="sum"), (target != -100).sum())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_loss_fn_returning_sum_and_count_gives_the_whole_batchs_mean_and_gradients(schedule):
    model = TinyLM()
    reference = copy.deepcopy(model)
    ids, target = padded_batch()
    pipe = fxpipe.compile(model, ["cpu"] * 3, (ids,), chunks=4, schedule=schedule)
    for p in pipe.parameters():                                  # gradients accumulate on these
        p.grad = torch.ones_like(p)
    for q in reference.parameters():
        q.grad = torch.ones_like(q)
    loss = pipe.train_step(ids, target, token_loss_sum)

    expected = F.cross_entropy(reference(ids).flatten(0, 1), target.flatten(), ignore_index=-100)
    expected.backward()
    assert_same_training(pipe, reference, loss=(loss, expected))


def test_a_step_with_sum_and_count_losses_reads_no_tensor_on_the_host(host_reads):
    """Reading a count on the host (`float(count)`) would wait for the GPU once per micro-batch:
    the counts stay tensors, summed on their device, and the gradients are scaled there."""
    model = TinyLM()
    ids, target = padded_batch()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (ids,), chunks=4)
    host_reads.clear()
    loss = pipe.train_step(ids, target, token_loss_sum)
    assert host_reads == []
    expected = F.cross_entropy(model(ids).flatten(0, 1), target.flatten(), ignore_index=-100)
    assert_same_up_to_rounding(loss, expected.detach())


# --- item 12: Ctrl-C ------------------------------------------------------------------------------

class InterruptsCaller(nn.Module):
    """Presses Ctrl-C (in the caller's thread) on its first armed call, then waits until the run
    noticed, so that what runs afterwards is what the runtime lets run."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pipe = None
        self.calls = 0

    def forward(self, x):
        if self.pipe is not None:
            self.calls += 1
            if self.calls == 1:
                _thread.interrupt_main()
                deadline = time.monotonic() + 5
                while (getattr(self.pipe.last_run, "error", None) is None
                       and time.monotonic() < deadline):
                    time.sleep(0.01)
        return self.lin(x)


@pytest.fixture
def ctrl_c():
    """Ctrl-C raises KeyboardInterrupt here even where the tests were started with SIGINT
    ignored (a background job of a shell), where `_thread.interrupt_main` does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def interrupted_pipeline(schedule="gpipe"):
    model = nn.Sequential(nn.Linear(4, 4), InterruptsCaller(), nn.Linear(4, 4), nn.Linear(4, 1))
    x = torch.randn(16, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=8, schedule=schedule,
                          leaf_modules=[InterruptsCaller])
    model[1].pipe = pipe
    return pipe, model[1], x


def test_ctrl_c_during_a_call_stops_every_stage_within_a_microbatch(ctrl_c):
    pipe, interrupter, x = interrupted_pipeline()
    with pytest.raises(KeyboardInterrupt):
        pipe(x)
    assert fxpipe_threads() == []
    assert interrupter.calls == 1                               # not the 7 queued after it
    assert pipe.last_run.failed and "KeyboardInterrupt" in pipe.last_run.error


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ctrl_c_during_train_step_leaves_no_stage_writing_grad(schedule, ctrl_c):
    pipe, interrupter, x = interrupted_pipeline(schedule)
    with pytest.raises(KeyboardInterrupt):
        pipe.train_step(x, torch.randn(16, 1), F.mse_loss)
    assert fxpipe_threads() == []
    pipe.zero_grad()
    time.sleep(0.2)
    assert all(p.grad is None for p in pipe.parameters())
    assert interrupter.calls == 1
    interrupter.pipe = None                                     # and the pipeline still works
    loss = pipe.train_step(x, torch.randn(16, 1), F.mse_loss)
    assert loss.isfinite()


class PressesCtrlC:
    """A forward hook that, on its second call, presses Ctrl-C (a real SIGINT to the caller's
    thread) `presses` times, 0.3 s apart, so that a second press lands while the caller waits for
    the stages to stop; then its stage stays busy 0.5 s more, longer than any other."""

    def __init__(self, presses: int):
        self.presses = presses
        self.calls = 0

    def __call__(self, module, inputs, output):
        self.calls += 1
        if self.calls == 2:
            for press in range(self.presses):
                time.sleep(0.3 if press else 0.0)
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.5)


def slow_pipeline(presses: int = 1, schedule: str = "gpipe"):
    """Two stages of Linear layers, each layer's forward slowed by a hook sleeping 0.2 s; the
    first layer's (on stage 0, whose thread the caller waits for first) presses Ctrl-C."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    x = torch.randn(16, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, schedule=schedule)
    model[0].register_forward_hook(PressesCtrlC(presses))
    for layer in model:
        layer.register_forward_hook(lambda module, inputs, output: time.sleep(0.2))
    return pipe, x


def grad_copies(pipe):
    return [None if p.grad is None else p.grad.clone() for p in pipe.parameters()]


def assert_no_grad_written_after(pipe, caught):
    time.sleep(0.5)
    for before, after in zip(caught, grad_copies(pipe)):
        assert (before is None) == (after is None)
        if before is not None:
            torch.testing.assert_close(after, before, rtol=0, atol=0)


def assert_interrupted_after_every_stage_stopped(pipe, run) -> None:
    """`run()` raises KeyboardInterrupt only once every stage's worker is at rest, and no stage
    writes a gradient afterwards."""
    try:
        run()
    except KeyboardInterrupt:
        alive, caught = fxpipe_threads(), grad_copies(pipe)
    else:
        pytest.fail("Ctrl-C did not reach the caller")
    assert alive == []
    assert_no_grad_written_after(pipe, caught)
    assert pipe.last_run.failed and "KeyboardInterrupt" in pipe.last_run.error


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ctrl_c_during_a_slow_train_step_returns_after_every_stage_stopped(schedule, ctrl_c):
    pipe, x = slow_pipeline(schedule=schedule)
    assert_interrupted_after_every_stage_stopped(
        pipe, lambda: pipe.train_step(x, torch.randn(16, 8), F.mse_loss))


def test_ctrl_c_twice_during_a_slow_stream_returns_after_every_stage_stopped(ctrl_c):
    pipe, x = slow_pipeline(presses=2)
    assert_interrupted_after_every_stage_stopped(
        pipe, lambda: list(pipe.stream(x[i:i + 1] for i in range(16))))


# --- item 13: whatever a stage raises -------------------------------------------------------------

class Unprintable(Exception):
    def __str__(self):
        raise ValueError("no message")

    def __repr__(self):
        raise ValueError("no repr either")


class Stop(BaseException):
    pass


class Raises(nn.Module):
    error: BaseException | None = None

    def forward(self, x):
        if self.error is not None:
            raise self.error
        return x + 1


@pytest.mark.parametrize("error", [Unprintable(), Stop("stop"), SystemExit(3)])
def test_whatever_a_stage_raises_the_caller_gets_a_stage_error(error):
    raises = Raises()
    model = nn.Sequential(nn.Linear(4, 4), raises, nn.Linear(4, 4))
    x = torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=4, leaf_modules=[Raises])
    raises.error = error
    with pytest.raises(fxpipe.StageError, match=type(error).__name__):
        pipe(x)
    assert fxpipe_threads() == []
    raises.error = None
    assert_same_up_to_rounding(pipe(x), model(x))


# --- item 14: pickling ----------------------------------------------------------------------------

def test_saving_a_pipeline_whole_is_refused_pointing_to_state_dict():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = fxpipe.compile(model, ["cpu"] * 2, (torch.randn(4, 4),), chunks=2)
    with pytest.raises(fxpipe.FxpipeError, match=r"pipe\.state_dict\(\)"):
        pickle.dumps(pipe)
    with pytest.raises(fxpipe.FxpipeError, match=r"load_state_dict"):
        torch.save(pipe, io.BytesIO())
    buffer = io.BytesIO()                                           # what the message suggests
    torch.save(pipe.state_dict(), buffer)
    buffer.seek(0)
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fresh.load_state_dict(torch.load(buffer))
    x = torch.randn(4, 4)
    assert_same_up_to_rounding(fresh(x), pipe(x))


# --- item 15: a failed run is recorded ------------------------------------------------------------

def test_last_run_records_a_failed_call():
    raises = Raises()
    model = nn.Sequential(nn.Linear(4, 4), raises, nn.Linear(4, 4))
    x = torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=4, leaf_modules=[Raises])
    pipe(x)
    succeeded = pipe.last_run
    assert not succeeded.failed and len(succeeded.slots) == 3 * 4
    raises.error = RuntimeError("boom")
    with pytest.raises(fxpipe.StageError):
        pipe(x)
    failed = pipe.last_run
    assert failed is not succeeded
    assert failed.failed and "boom" in failed.error
    assert len(failed.slots) < 3 * 4


# --- errors that name the right thing -------------------------------------------------------------

class Reshapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x.view(x.shape[0], 4, 2)).flatten(1)


def test_an_error_in_generated_code_names_the_statement_and_keeps_stderr_clean(capfd):
    model = Reshapes()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (torch.randn(4, 8),), chunks=2, capture="fx")
    capfd.readouterr()
    with pytest.raises(fxpipe.StageError, match=r"at: view = x\.view\("):
        pipe(torch.randn(4, 6))
    assert capfd.readouterr().err == ""


def test_train_step_without_a_target_says_the_target_is_needed():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    with pytest.raises(fxpipe.InputError, match="needs a target") as error:
        pipe.train_step(x, None, lambda out, t: out.sum())
    assert "chunks" not in str(error.value)


class TakesADict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, batch):
        return self.lin(batch["x"] * batch["scale"])


def test_train_step_with_a_models_only_dict_input_says_how_to_pass_it():
    model = TakesADict()
    batch = {"x": torch.randn(8, 4), "scale": torch.rand(8, 1)}
    pipe = fxpipe.compile(model, ["cpu"] * 2, (batch,), chunks=2)
    target = torch.randn(8, 1)
    with pytest.raises(fxpipe.InputError, match=r"wrap it in a tuple.*\(batch,\)"):
        pipe.train_step(batch, target, F.mse_loss)
    loss = pipe.train_step((batch,), target, F.mse_loss)
    assert_same_up_to_rounding(loss, F.mse_loss(model(batch), target))
