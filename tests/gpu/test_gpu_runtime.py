"""The runtime on GPUs: streams ordered against the caller's, no host waits in a step, copies
between GPUs, recomputation with dropout, targets on another device. Skipped without CUDA (the
two-GPU tests without two GPUs)."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fxpipe
from fxpipe.testing import assert_same_training
from fxpipe.passes.recompute import Recomputed, checkpoint_regions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

ONE_GPU = ["cuda:0", "cuda:0"]
TWO_GPUS = pytest.param(["cuda:0", "cuda:1"], marks=two_gpus)


def mlp(width=1024):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, width), nn.GELU(), nn.Linear(width, 16))


def cpu(value):
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


# Equal but for summation order: GPU kernels are chosen per shape, so a micro-batch's matmul
# may add up in another order than the whole batch's.
SUMMATION_ORDER = dict(rtol=1e-4, atol=1e-5)


def close(actual, expected, **kwargs):
    """Equal but for summation order (`SUMMATION_ORDER`)."""
    torch.testing.assert_close(cpu(actual), cpu(expected), **SUMMATION_ORDER, **kwargs)


def per_microbatch(model, x, chunks):
    """The reference a pipeline equals: the model run once per micro-batch."""
    with torch.no_grad():
        return torch.cat([model(part) for part in x.tensor_split(chunks)])


def reference_step(model, x, target, chunks):
    """The model's mean-squared-error step on the same micro-batches; its loss."""
    rows = x.shape[0]
    loss = sum(F.mse_loss(model(xc), tc.to(xc.device)) * len(xc) / rows
               for xc, tc in zip(x.tensor_split(chunks), target.tensor_split(chunks)))
    loss.backward()
    return loss


@pytest.mark.parametrize("devices", [ONE_GPU, TWO_GPUS])
def test_a_stream_reads_each_item_after_the_callers_stream_made_it(devices):
    """Items made on the caller's current stream (a side stream, each written only after a
    long sleep, over NaNs): every output equals the model's, so no stage read an item early."""
    model = mlp().cuda()
    reference = copy.deepcopy(model)
    sources = [torch.randn(64, 1024, device="cuda:0") for _ in range(6)]
    pipe = fxpipe.compile(model, devices, (sources[0],))

    def items():
        for source in sources:
            x = torch.full_like(source, float("nan"))
            torch.cuda._sleep(100_000_000)           # ~0.1 s of GPU time before x is written
            x.copy_(source)
            yield x

    side = torch.cuda.Stream("cuda:0")
    side.wait_stream(torch.cuda.current_stream("cuda:0"))
    with torch.cuda.stream(side):
        outputs = [out.clone() for out in pipe.stream(items())]   # used on the caller's stream
    torch.cuda.synchronize()
    for source, out in zip(sources, outputs):
        close(out, per_microbatch(reference, source, 1))


@pytest.mark.parametrize("devices", [ONE_GPU, TWO_GPUS])
def test_no_host_wait_per_microbatch_in_a_call_or_a_step(devices, monkeypatch):
    """Copies between GPUs and outputs handed back are ordered by streams and events: the host
    synchronises no stream, event or device per micro-batch (a call or a train_step of 8
    micro-batches waits on the host as often as one of 2), and the results are the model's."""
    model = mlp().cuda()
    reference = copy.deepcopy(model)
    x, target = torch.randn(64, 1024, device="cuda:0"), torch.randn(64, 16, device="cuda:0")
    waits = []
    for owner, name in ((torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize"),
                        (torch.cuda, "synchronize")):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _o=original, _n=name: waits.append(_n) or
                            _o(*a))
    counted = {}
    for chunks in (2, 8):
        pipe = fxpipe.compile(model, devices, (x,), chunks=chunks)
        waits.clear()
        out = pipe(x)
        pipe.train_step(x, target, F.mse_loss)
        counted[chunks] = list(waits)
        close(out, per_microbatch(reference, x, chunks))
    assert counted[8] == counted[2]


@pytest.mark.parametrize("devices", [ONE_GPU, TWO_GPUS])
def test_outputs_of_many_microbatches_across_gpus_equal_the_models(devices):
    """Many large micro-batches in flight: the senders run ahead of the copies, whose sources
    must stay alive and unwritten until copied."""
    model = mlp(2048).cuda()
    reference = copy.deepcopy(model)
    x = torch.randn(512, 2048, device="cuda:0")
    pipe = fxpipe.compile(model, devices, (x,), chunks=16)
    for _ in range(3):
        out = pipe(x)
    close(out, per_microbatch(reference, x, 16))


class DropoutFirst(nn.Module):
    """A stage whose first node draws: the recomputed run starts from the micro-batch seed."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 8)

    def forward(self, x):
        return self.b(F.dropout(torch.tanh(self.a(self.drop(x))), 0.3, self.training))


def drawing_runs(stage):
    """Every node of the stage but its Linears: the dropouts and tanh, recomputed."""
    return {n.name for n in stage.module.graph.nodes
            if n.op not in ("placeholder", "output", "get_attr") and not n.is_impure()
            and not (n.op == "call_module"
                     and isinstance(stage.module.get_submodule(n.target), nn.Linear))}


@pytest.mark.parametrize("recompute", ["runs", "always"])
def test_recomputing_with_dropout_first_gives_the_same_gradients_on_a_gpu(recompute):
    """Autograd recomputes a GPU's checkpointed run on its own thread for the device: the run
    carries its micro-batch seed there, so the dropout masks, and the gradients, are those
    drawn in the forward."""
    model = DropoutFirst().cuda().train()
    twin = copy.deepcopy(model)
    x, target = torch.randn(64, 256, device="cuda"), torch.randn(64, 8, device="cuda")
    plain = fxpipe.compile(model, ONE_GPU, (x,), chunks=4)
    pipe = fxpipe.compile(twin, ONE_GPU, (x,), chunks=4,
                          recompute="always" if recompute == "always" else "never")
    if recompute == "runs":
        for stage in pipe.plan.stages:
            checkpoint_regions(stage.module, drawing_runs(stage))
        assert any(isinstance(m, Recomputed) for s in pipe.stages for m in s.modules())
    losses = []
    for p in (plain, pipe):
        torch.manual_seed(1)
        losses.append(p.train_step(x, target, F.mse_loss))
    assert_same_training(twin, model, loss=(losses[1], losses[0]), **SUMMATION_ORDER)


@pytest.mark.parametrize("devices", [ONE_GPU, TWO_GPUS])
def test_train_step_with_a_cpu_target_on_gpu_stages_equals_the_model(devices):
    """The target stays where the caller made it (the CPU); the loss runs on the last stage's
    GPU with the target moved there; loss and gradients are the model's."""
    model = mlp(256).cuda()
    reference = copy.deepcopy(model)
    x, target = torch.randn(32, 256, device="cuda:0"), torch.randn(32, 16)
    pipe = fxpipe.compile(model, devices, (x,), chunks=4)
    loss = pipe.train_step(x, target, F.mse_loss)
    assert target.device.type == "cpu"
    assert_same_training(pipe, reference, loss=(loss, reference_step(reference, x, target, 4)),
                         **SUMMATION_ORDER)


@pytest.mark.parametrize("devices", [ONE_GPU, TWO_GPUS])
def test_a_mean_loss_not_over_rows_is_refused_on_gpus_with_grad_kept(devices):
    """The first step's check runs where the last stage's outputs are: a plain mean over the
    positive targets is refused, and `.grad` on every GPU is what it was."""
    model = mlp(256).cuda()
    x, target = torch.randn(32, 256, device="cuda:0"), torch.randn(32, 16)

    def positive_mean(out, t):
        kept = t > 0
        return F.mse_loss(out[kept], t[kept])
    pipe = fxpipe.compile(model, devices, (x,), chunks=4)
    for p in pipe.parameters():
        p.grad = torch.full_like(p, 0.5)
    with pytest.raises(fxpipe.LossReductionError, match=r"\(loss_sum, count\)"):
        pipe.train_step(x, target, positive_mean)
    for p in pipe.parameters():
        assert torch.equal(p.grad, torch.full_like(p, 0.5))


@pytest.mark.parametrize("devices", [ONE_GPU, TWO_GPUS])
def test_sum_and_count_losses_on_gpus_give_the_whole_batchs_mean(devices):
    """Counts kept on the last stage's GPU, summed there, the gradients scaled on their own
    GPUs: the whole batch's mean over the positive targets, as the model gives."""
    model = mlp(256).cuda()
    reference = copy.deepcopy(model)
    x, target = torch.randn(32, 256, device="cuda:0"), torch.randn(32, 16)

    def positive_mse(out, t):
        kept = t > 0
        return F.mse_loss(out[kept], t[kept], reduction="sum"), kept.sum()
    pipe = fxpipe.compile(model, devices, (x,), chunks=4)
    loss = pipe.train_step(x, target, positive_mse)
    kept = target.to("cuda:0") > 0
    expected = F.mse_loss(reference(x)[kept], target.to("cuda:0")[kept])
    expected.backward()
    assert_same_training(pipe, reference, loss=(loss, expected), **SUMMATION_ORDER)


@two_gpus
def test_a_pipeline_on_the_second_gpu_starts_no_context_on_the_first():
    """A stage's thread leaves its stream context without making GPU 0 current (which would
    start a context there, taking its memory): run in a fresh process."""
    script = textwrap.dedent("""
        import torch
        from torch import nn
        import fxpipe
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to("cuda:1")
        x = torch.randn(16, 64, device="cuda:1")
        pipe = fxpipe.compile(model, ["cuda:1", "cuda:1"], (x,), chunks=2)
        pipe(x)
        list(pipe.stream([x, x]))
        torch.cuda.synchronize("cuda:1")
        print(torch._C._cuda_hasPrimaryContext(0))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "False"
