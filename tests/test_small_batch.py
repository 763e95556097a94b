"""A batch of fewer rows than `chunks` (a single request, a dataset's last short batch) runs as
one micro-batch per row, equal to the model; an empty batch is refused by name."""

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.nn import functional as F

import fxpipe
from fxpipe.runtime import microbatch
from fxpipe.passes.randomness import microbatch_seeds
from fxpipe.planning.reference import run_per_microbatch
from fxpipe.runtime.schedules import Phase

CHUNKS = 4
ROWS = st.integers(1, CHUNKS + 3)
SEEDS = st.integers(0, 2 ** 16)


def close(actual, expected, what=""):
    """Equal up to rounding: rtol 1e-4, atol scaled to the reference's magnitude."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5 * scale,
                               msg=lambda m: f"{what}: {m}")


def mlp(dropout: float = 0.0) -> nn.Module:
    layers = [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16),
              nn.Tanh(), nn.Linear(16, 4)]
    if dropout:
        layers[2:2] = [nn.Dropout(dropout)]
        layers[-1:-1] = [nn.Dropout(dropout)]
    return nn.Sequential(*layers)


_compiled: dict = {}


def compiled(schedule: str = "gpipe", stages: int = 3, dropout: float = 0.0):
    """(model, a copy of it, its pipeline with chunks=4), compiled once per module."""
    key = (schedule, stages, dropout)
    if key not in _compiled:
        torch.manual_seed(0)
        model = mlp(dropout).train()
        reference = copy.deepcopy(model)
        pipe = fxpipe.compile(model, ["cpu"] * stages, (torch.randn(8, 6),), chunks=CHUNKS,
                              schedule=schedule)
        _compiled[key] = model, reference, pipe
    return _compiled[key]


def batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=g), torch.randint(0, 4, (rows,), generator=g)


def ran(pipe) -> set[tuple[int, int, Phase]]:
    return {(s.action.stage, s.action.microbatch, s.action.phase) for s in pipe.last_run.slots}


def test_a_pipeline_splits_a_small_batch_one_micro_batch_per_row():
    x = torch.arange(12.0).reshape(6, 2)
    assert [len(p) for p in microbatch.split_up_to(x, 4)] == [2, 2, 1, 1]
    assert [p.tolist() for p in microbatch.split_up_to(x[:3], 4)] == [[[0, 1]], [[2, 3]],
                                                                     [[4, 5]]]
    assert len(microbatch.split_up_to(x[:1], 4)) == 1
    assert len(microbatch.split_up_to(x, 1)) == 1
    with pytest.raises(fxpipe.BatchError, match=r"the batch is empty \(0 rows\)"):
        microbatch.split_up_to(x[:0], 4)
    with pytest.raises(fxpipe.BatchError, match="3 rows cannot be split into 4"):
        microbatch.split(x[:3], 4)       # compile's own split of the example stays strict


@settings(max_examples=12)
@given(rows=ROWS, seed=SEEDS)
def test_a_call_with_fewer_rows_than_chunks_equals_the_model(rows, seed):
    model, _, pipe = compiled()
    x, _ = batch(rows, seed)
    with torch.no_grad():
        close(pipe(x), model(x), "output")
    n = min(rows, CHUNKS)
    assert pipe.last_run.microbatches == n
    assert ran(pipe) == {(s, m, Phase.FORWARD) for s in range(3) for m in range(n)}


LOSSES = {   # (loss_fn, reduction, the model's loss on the whole batch)
    "mean": (F.cross_entropy, "mean", F.cross_entropy),
    "sum": (lambda o, t: F.cross_entropy(o, t, reduction="sum"), "sum",
            lambda o, t: F.cross_entropy(o, t, reduction="sum")),
    "pair": (lambda o, t: (F.cross_entropy(o, t, reduction="sum"), torch.tensor(len(t))),
             "mean", F.cross_entropy),
}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
@settings(max_examples=6)
@given(rows=ROWS, seed=SEEDS)
def test_train_step_on_fewer_rows_than_chunks_gives_the_models_loss_and_gradients(
        schedule, loss, rows, seed):
    model, reference, pipe = compiled(schedule)
    loss_fn, reduction, whole = LOSSES[loss]
    x, target = batch(rows, seed)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    for p in [*model.parameters(), *reference.parameters()]:
        p.grad = None
    got = pipe.train_step(x, target, loss_fn, reduction=reduction)
    expected = whole(reference(x_ref), target)
    expected.backward()
    close(got, expected.detach(), "loss")
    close(x.grad, x_ref.grad, "the input's gradient")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        close(p.grad, q.grad, name)
    n = min(rows, CHUNKS)
    assert pipe.last_run.microbatches == n
    # The schedule was built for the micro-batches that ran: each stage's forward and backward
    # of every one of them, once (1F1B's warm-up shortened where fewer than the stages).
    assert sorted(ran(pipe), key=str) == sorted(
        {(s, m, phase) for s in range(3) for m in range(n) for phase in Phase}, key=str)
    assert len(pipe.last_run.slots) == 2 * 3 * n


@settings(max_examples=6)
@given(rows=st.integers(1, CHUNKS - 1), seed=SEEDS)
def test_dropout_on_a_small_batch_draws_as_the_model_per_row(rows, seed):
    """Row m runs as the model on it alone after torch.manual_seed(seeds[m]), the seeds a
    call of that many micro-batches draws: calls and train steps alike."""
    model, reference, pipe = compiled("1f1b", stages=2, dropout=0.3)
    x, target = batch(rows, seed)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = pipe(x)
    torch.manual_seed(seed)
    with torch.no_grad():
        parts = run_per_microbatch(model, (x,), {}, rows, seeds=microbatch_seeds(rows))
    close(out, torch.cat(parts), "output")
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        assert not torch.equal(pipe(x), out)     # dropout draws: the seeds decide

    for p in [*model.parameters(), *reference.parameters()]:
        p.grad = None
    torch.manual_seed(seed)
    got = pipe.train_step(x, target, F.cross_entropy)
    torch.manual_seed(seed)
    seeds = microbatch_seeds(rows)
    expected = 0
    for m in range(rows):
        torch.manual_seed(seeds[m])
        expected = expected + F.cross_entropy(reference(x[m:m + 1]), target[m:m + 1]) / rows
    expected.backward()
    close(got, expected.detach(), "loss")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        close(p.grad, q.grad, name)


def test_an_empty_batch_is_refused_by_name():
    _, _, pipe = compiled()
    x, target = batch(0, 0)
    with pytest.raises(fxpipe.BatchError, match=r"the batch is empty \(0 rows\)"):
        pipe(x)
    with pytest.raises(fxpipe.BatchError, match=r"the batch is empty \(0 rows\)"):
        pipe.train_step(x, target, F.cross_entropy)


def test_an_empty_batch_is_refused_by_train_step_with_one_chunk_too():
    torch.manual_seed(0)
    model = mlp()
    pipe = fxpipe.compile(model, ["cpu"], (torch.randn(8, 6),), chunks=1)
    x, target = batch(0, 0)
    for p in model.parameters():
        p.grad = None
    with pytest.raises(fxpipe.BatchError, match=r"train_step: the batch is empty \(0 rows\)"):
        pipe.train_step(x, target, F.cross_entropy)
    assert all(p.grad is None for p in model.parameters())


def test_an_empty_item_of_stream_train_is_refused_naming_it():
    model, _, pipe = compiled()
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.0)
    with pytest.raises(fxpipe.BatchError, match=r"item 1 of the stream: .*the batch is empty"):
        list(pipe.stream_train([batch(1, 0), batch(0, 0)], F.cross_entropy, optimizer,
                               window=2))


def test_a_stream_of_single_rows_through_a_pipeline_of_four_chunks_equals_the_model():
    model, _, pipe = compiled()
    items = [batch(1, seed)[0] for seed in range(5)]
    with torch.no_grad():
        for out, x in zip(pipe.stream(items), items, strict=True):
            close(out, model(x), "output")


def test_the_model_run_as_is_reports_its_one_micro_batch(scripted_costs):
    # Scripted costs (every node 1 ms, no race): no pipeline of one device is predicted
    # faster than the model as is, whatever the machine's load.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    pipe = fxpipe.compile(model, ["cpu"], (torch.randn(8, 6),), num_stages="auto")
    assert pipe.plan.runs_as_is
    for rows in (1, 5):
        x = torch.randn(rows, 6)
        with torch.no_grad():
            close(pipe(x), model(x), "output")
        assert pipe.last_run.microbatches == 1
