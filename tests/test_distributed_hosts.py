"""Two torchrun invocations as two "hosts" on 127.0.0.1 (`--nnodes 2`) run one plan."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding, grads_of
from test_distributed import WORKER, Branchy

ROOT = Path(__file__).resolve().parents[1]


def test_two_hosts_train_one_step_as_the_model(tmp_path):
    torch.manual_seed(0)
    model, x, target = Branchy(), torch.randn(6, 8), torch.randn(6, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, training=True)
    pipe.plan.save(tmp_path / "plan")
    torch.save({"x": x, "target": target}, tmp_path / "data.pt")
    out = tmp_path / "out"
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hosts = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
         str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
         str(port), str(WORKER), str(tmp_path / "plan"), str(tmp_path / "data.pt"), str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True) for node in (0, 1)]
    try:
        texts = [host.communicate(timeout=60)[0] for host in hosts]
    except subprocess.TimeoutExpired:
        for host in hosts:
            os.killpg(host.pid, signal.SIGKILL)
            host.communicate()
        pytest.fail("the two torchrun hosts did not finish within 60 s")
    for host, text in zip(hosts, texts):
        assert host.returncode == 0, text.decode(errors="replace")[-3000:]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert_same_up_to_rounding(ranks[1]["loss"], pipe.train_step(x, target, F.mse_loss))
    model.zero_grad()
    F.mse_loss(model(x), target).backward()
    got = {name: g for r in ranks for name, g in r["grads"].items()}
    assert_same_up_to_rounding(got, grads_of(model), what="gradient")
