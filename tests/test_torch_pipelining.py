"""A chain plan run by torch.distributed.pipelining's own schedules equals the model."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding, grads_of
from fxpipe.torch_pipelining import NotAChainError, check_chain

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("pipelining_worker.py")


def chain():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)]).eval()


def launch(args: list[str], processes: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(processes), "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(WORKER), *args]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the torchrun launch did not end within 60 s")
    assert proc.returncode == 0, text.decode(errors="replace")[-3000:]


@pytest.mark.parametrize("schedule, stages, processes", [
    ("ScheduleGPipe", 2, 2), ("Schedule1F1B", 2, 2),
    ("ScheduleInterleaved1F1B", 4, 2), ("ScheduleInterleavedZeroBubble", 4, 2)])
def test_torch_schedules_train_a_chain_plan_as_the_model(schedule, stages, processes, tmp_path):
    model = chain()
    x, target = torch.randn(8, 16), torch.randn(8, 16)
    fxpipe.plan(model, ["cpu"] * stages, (x,), chunks=4).save(tmp_path / "plan")
    torch.save({"x": x, "target": target}, tmp_path / "data.pt")
    out = tmp_path / "out"
    out.mkdir()
    launch([str(tmp_path / "plan"), str(tmp_path / "data.pt"), str(out), schedule], processes)
    results = [torch.load(out / f"rank{r}.pt") for r in range(processes)]
    expected = F.mse_loss(model(x), target)
    expected.backward()
    losses = next(r["losses"] for r in results if r["losses"] is not None)
    assert_same_up_to_rounding(torch.stack(losses).mean(), expected)   # equal micro-batches
    grads = {name: g for r in results for name, g in r["grads"].items()}
    assert set(grads) == {name for name, _ in model.named_parameters()}
    assert_same_up_to_rounding(grads, grads_of(model), what="gradient")


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        h = self.a(x)
        return self.d(self.c(torch.tanh(self.b(h)))) + h


def test_a_plan_with_a_skip_is_refused_naming_it():
    torch.manual_seed(0)
    plan = fxpipe.plan(Skip().eval(), ["cpu"] * 3, (torch.randn(4, 8),))
    with pytest.raises(NotAChainError, match="fxpipe.distributed"):
        check_chain(plan)
