"""Pipelined training: gradients, losses, buffers and names equal the model's."""

import copy
import functools

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn
from torch.nn import functional as F

import fxpipe
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding
import fxpipe.api
from fxpipe import timeline
from fxpipe.testing import models
from fxpipe.passes.codegen import split_stages


class Net(nn.Module):
    def __init__(self, width=16, classes=5):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.norm = nn.BatchNorm1d(width)
        self.left = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.right = nn.Linear(width, width)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x):
        h = torch.relu(self.norm(self.embed(x)))
        return self.head(torch.cat([self.left(h) + h, self.right(h)], dim=1))


class Tied(nn.Module):
    """An embedding reused as the output layer, and a block called twice."""

    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.Linear(width, width)
        self.mid = nn.Linear(width, width)

    def forward(self, ids):
        h = self.embed(ids)
        h = torch.tanh(self.block(h))
        h = self.mid(h)
        h = torch.tanh(self.block(h))
        return h @ self.embed.weight.t()


def reference_step(model, x, target, loss_fn, chunks):
    """The model itself on the same micro-batches (BatchNorm sees micro-batches, as in GPipe)."""
    rows = x.shape[0]
    loss = sum(loss_fn(model(xc), tc) * len(xc) / rows
               for xc, tc in zip(x.tensor_split(chunks), target.tensor_split(chunks)))
    loss.backward()
    return loss


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, chunks", [(2, 4), (4, 3), (3, 7)])
def test_gradients_and_loss_equal_the_models(schedule, stages, chunks):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    x, target = torch.randn(14, 8), torch.randint(0, 5, (14,))
    pipe = fxpipe.compile(model, ["cpu"] * stages, (x,), chunks=chunks, schedule=schedule)
    loss = pipe.train_step(x, target, F.cross_entropy)
    expected = reference_step(reference, x, target, F.cross_entropy, chunks)
    assert_same_training(model, reference, loss=(loss, expected))
    # BatchNorm statistics were updated once per micro-batch, as in the reference
    assert_same_up_to_rounding(model.norm.running_mean, reference.norm.running_mean)
    assert model.norm.num_batches_tracked.item() == chunks


def test_without_batchnorm_the_gradients_equal_the_whole_batchs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))
    reference = copy.deepcopy(model)
    x, target = torch.randn(10, 6), torch.randn(10, 3)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=4, schedule="1f1b")
    loss = pipe.train_step(x, target, F.mse_loss)
    expected = F.mse_loss(reference(x), target)
    expected.backward()
    assert_same_training(model, reference, loss=(loss, expected))


def test_sum_reduction_adds_micro_batch_losses():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    x, target = torch.randn(9, 4), torch.randn(9, 2)
    loss_fn = lambda out, t: F.mse_loss(out, t, reduction="sum")
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=3)
    loss = pipe.train_step(x, target, loss_fn, reduction="sum")
    expected = loss_fn(reference(x), target)
    expected.backward()
    assert_same_training(model, reference, loss=(loss, expected))


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_tied_and_reused_parameters_get_every_gradient(stages):
    torch.manual_seed(0)
    model = Tied()
    reference = copy.deepcopy(model)
    ids, target = torch.randint(0, 11, (6,)), torch.randint(0, 11, (6,))
    pipe = fxpipe.compile(model, ["cpu"] * stages, (ids,), chunks=2, schedule="1f1b")
    users = {pipe.plan.partition.stage_of[n] for n in ("embed", "matmul")}
    pipe.train_step(ids, target, F.cross_entropy)
    reference_step(reference, ids, target, F.cross_entropy, 2)
    assert_same_training(model, reference)
    assert [name for name, _ in pipe.named_parameters()] == [n for n, _ in model.named_parameters()]
    if stages == 4:
        assert len(users) == 2       # the tied weight really is used by two stages


def test_plain_autograd_through_the_pipeline_fills_the_same_gradients():
    torch.manual_seed(0)
    model = Net().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=4)
    pipe(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    assert_same_training(model, reference)


def test_an_optimizer_trains_the_pipeline_and_the_weights_load_into_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(64, 4)
    target = x.sum(dim=1, keepdim=True)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, schedule="1f1b")
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    first = pipe.train_step(x, target, F.mse_loss).item()
    for _ in range(60):
        opt.zero_grad()
        last = pipe.train_step(x, target, F.mse_loss).item()
        opt.step()
    assert last < first / 4
    fresh = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    fresh.load_state_dict(pipe.state_dict())
    torch.testing.assert_close(fresh(x), model(x))


class Explodes(nn.Module):
    def forward(self, x):
        return ExplodingGrad.apply(x)


class ExplodingGrad(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ExplodingGrad.armed:
            raise RuntimeError("backward refused")
        return grad


def test_a_failing_backward_names_the_stage_and_the_pipeline_stays_usable():
    model = nn.Sequential(nn.Linear(4, 4), Explodes(), nn.Linear(4, 4), nn.Linear(4, 1))
    x, target = torch.randn(8, 4), torch.randn(8, 1)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=2, schedule="1f1b",
                          leaf_modules=[Explodes])
    stage = pipe.plan.partition.stage_of["_1"]
    ExplodingGrad.armed = True
    try:
        with pytest.raises(fxpipe.StageError, match=rf"stage {stage} .*backward[\s\S]*backward refused"):
            pipe.train_step(x, target, F.mse_loss)
    finally:
        ExplodingGrad.armed = False
    model.eval()
    assert_same_up_to_rounding(pipe(x), model(x))


def test_a_loss_that_is_not_a_scalar_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = fxpipe.compile(model, ["cpu"] * 2, (torch.randn(4, 4),), chunks=2)
    with pytest.raises(fxpipe.StageError, match="0-d tensor"):
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), lambda out, t: out - t)


def test_the_run_is_recorded_and_predicted_and_drawn(tmp_path):
    model = Net()
    x, target = torch.randn(12, 8), torch.randint(0, 5, (12,))
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=4, schedule="1f1b")
    pipe.train_step(x, target, F.cross_entropy)
    ran = pipe.last_run.slots
    assert sorted(str(s.action) for s in ran) == sorted(
        f"{s}{p}{m}" for s in range(3) for p in "FB" for m in range(4))
    for stage in range(3):       # each stage ran its actions in the timetable's order, one at a time
        own = [s for s in ran if s.action.stage == stage]
        assert [str(s.action) for s in own] == [str(a) for a in fxpipe.runtime.schedules.one_f_one_b(3, 4)[stage]]
        assert all(a.end_s <= b.start_s for a, b in zip(own, own[1:]))
    predicted = pipe.predict(training=True)
    assert sorted(str(s.action) for s in predicted) == sorted(str(s.action) for s in ran)
    assert max(s.end_s for s in predicted) > 0
    trace = timeline.chrome_trace(ran)
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} == {str(s.action) for s in ran}
    picture = timeline.write_svg(ran, tmp_path / "run.svg").read_text()
    assert picture.startswith("<svg") and picture.count("<rect") == len(ran) + 1


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_parameter_sent_between_stages_gets_every_gradient(monkeypatch, schedule):
    """How stages on different devices share a tied weight: its home stage sends it like a value
    and the gradients come back; forced here on one device, where it is otherwise copied."""
    monkeypatch.setattr(fxpipe.planning.prepare, "split_stages",
                        functools.partial(split_stages, send_parameters=True))
    torch.manual_seed(0)
    model = Tied()
    reference = copy.deepcopy(model)
    ids, target = torch.randint(0, 11, (6,)), torch.randint(0, 11, (6,))
    pipe = fxpipe.compile(model, ["cpu"] * 4, (ids,), chunks=2, schedule=schedule)
    home, reader = (pipe.plan.partition.stage_of[n] for n in ("embed", "matmul"))
    assert home < reader
    assert "embed_weight" in pipe.stage_info[reader].inputs     # received, not held
    assert not any(True for _ in pipe.stages[reader].parameters())
    pipe.train_step(ids, target, F.cross_entropy)
    reference_step(reference, ids, target, F.cross_entropy, 2)
    assert_same_training(model, reference)
    model.zero_grad(), reference.zero_grad()
    pipe(ids).sum().backward()                                   # and through plain autograd
    reference(ids).sum().backward()
    assert_same_training(model, reference)


def sum_of_outputs(output, target):
    leaves = torch.utils._pytree.tree_leaves(output)
    return sum(((t - target[:, :1]) ** 2).mean() for t in leaves if isinstance(t, torch.Tensor))


@given(models(max_nodes=12, batch=(2, 6)), st.integers(1, 4), st.integers(1, 3),
       st.sampled_from(["gpipe", "1f1b"]))
def test_generated_models_train_with_the_models_gradients(case, num_stages, chunks, schedule):
    model, inputs = case
    rows = inputs[0].shape[0]
    chunks = min(chunks, rows)
    reference = copy.deepcopy(model)
    target = torch.randn(rows, 1)
    computing = [n for n in torch.fx.symbolic_trace(model).graph.nodes
                 if n.op not in ("placeholder", "output", "get_attr")]
    pipe = fxpipe.compile(model, ["cpu"] * min(num_stages, len(computing)), inputs,
                          chunks=chunks, schedule=schedule)
    loss = pipe.train_step(inputs, target, sum_of_outputs)
    expected = sum(sum_of_outputs(reference(*part), t) * t.shape[0] / rows
                   for *part, t in zip(*(i.tensor_split(chunks) for i in inputs),
                                       target.tensor_split(chunks)))
    if expected.requires_grad:          # a model without parameters has nothing to train
        expected.backward()
    assert_same_up_to_rounding(loss, expected.detach(), what="loss")
    got, want = {}, {}
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            got[name], want[name] = p.grad, q.grad
    # Stages may use other intra-op thread counts: other summation orders, each gradient off
    # by epsilons of the largest (a generated model's values reach 1e12).
    assert_same_up_to_rounding(got, want, what="gradient")


def test_each_microbatchs_target_goes_to_the_last_stages_device(monkeypatch):
    """The loss runs on the last stage, so each micro-batch's target is moved to that stage's
    device (on a CPU the move changes nothing; a CPU target with GPU stages: tests/gpu)."""
    import fxpipe.runtime.microbatch
    torch.manual_seed(0)
    model, x, target = Net(), torch.randn(16, 8), torch.randn(16, 5)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=4)
    moved = []
    on_device = fxpipe.runtime.microbatch.on_device
    monkeypatch.setattr(fxpipe.runtime.microbatch, "on_device", lambda value, device: moved.append(
        (value, device)) or on_device(value, device))
    pipe.train_step(x, target, F.mse_loss)
    assert [device for _, device in moved] == [pipe.stage_info[-1].device] * 4
    assert all(torch.equal(value, part) for (value, _), part in zip(moved, target.chunk(4)))
