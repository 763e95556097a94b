"""A saved plan run by torchrun, one process per stage, equals the model and the pipeline.

Each test launches `python -m torch.distributed.run` on 127.0.0.1 (gloo) with
`distributed_worker.py`, which saves what every rank got; the launch has a timeout, after which
everything it started is killed.
"""

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

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("distributed_worker.py")
LAUNCH_TIMEOUT_S = 50


class Branchy(nn.Module):
    """Two ReLU branches whose sum is read again after two more layers (a skip connection
    across stages), and the input read again at the end (a graph input a later stage reads)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 16)
        self.d, self.e = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        s = torch.relu(self.a(x)) + torch.relu(self.b(x))
        h = torch.relu(self.d(torch.relu(self.c(s))))
        return self.e(h + s) + x[:, :4]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(plan: Path, data: Path, out: Path, processes: int) -> None:
    """Run the worker on `processes` ranks; fail (killing them all) past the timeout."""
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(processes), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               str(WORKER), str(plan), str(data), str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {LAUNCH_TIMEOUT_S} s:\n{text.decode()[-3000:]}")
    assert proc.returncode == 0, text.decode()[-3000:]


def ran(tmp_path: Path, processes: int, stages: int, schedule: str = "gpipe"):
    """Plan the model in `stages` stages, save it, run it on `processes` ranks; the model, the
    batch, the single-process pipeline and the folder holding each rank's results."""
    torch.manual_seed(0)
    model, x, target = Branchy(), torch.randn(6, 8), torch.randn(6, 4)
    pipe = fxpipe.compile(model, ["cpu"] * stages, (x,), chunks=2, training=True,
                          schedule=schedule)
    assert len(pipe.stages) == stages
    pipe.plan.save(tmp_path / "plan")
    torch.save({"x": x, "target": target}, tmp_path / "data.pt")
    launch(tmp_path / "plan", tmp_path / "data.pt", tmp_path / "out", processes)
    return model, x, target, pipe, tmp_path / "out"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return ran(tmp_path_factory.mktemp("two"), 2, 2)


def results(out: Path, processes: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt") for r in range(processes)]


def test_inference_on_the_last_rank_equals_the_model(two_ranks):
    model, x, _, _, out = two_ranks
    first, last = results(out, 2)
    assert first["output"] is None
    with torch.no_grad():
        torch.testing.assert_close(last["output"], model(x))


def assert_trains_as_the_model(model, x, target, pipe, out, processes):
    """The last rank's loss is the pipeline's and the model's; every parameter's gradient, from
    the rank holding it, is the model's."""
    ranks = results(out, processes)
    assert all(r["loss"] is None for r in ranks[:-1])
    expected = pipe.train_step(x, target, F.mse_loss)
    torch.testing.assert_close(ranks[-1]["loss"], expected)
    model.zero_grad()
    F.mse_loss(model(x), target).backward()
    got = {name: g for r in ranks for name, g in r["grads"].items()}
    assert set(got) == {name for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=name)


def test_a_gpipe_train_step_equals_the_pipeline_and_the_model(two_ranks):
    assert_trains_as_the_model(*two_ranks[:4], two_ranks[4], 2)


def test_three_ranks_with_1f1b_equal_the_model(tmp_path):
    model, x, target, pipe, out = ran(tmp_path, 3, 3, schedule="1f1b")
    assert pipe.schedule == "1f1b"
    with torch.no_grad():
        torch.testing.assert_close(results(out, 3)[-1]["output"], model(x))
    assert_trains_as_the_model(model, x, target, pipe, out, 3)


def test_a_world_size_unlike_the_plan_is_refused_on_every_rank(tmp_path):
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(6, 8)
    fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=2).plan.save(tmp_path / "plan")
    torch.save({"x": x, "target": x}, tmp_path / "data.pt")
    launch(tmp_path / "plan", tmp_path / "data.pt", tmp_path / "out", 2)
    for rank in range(2):
        message = (tmp_path / "out" / f"rank{rank}.err").read_text()
        assert message.startswith("WorldSizeError")
        assert "3 stages but 2 processes" in message
        assert "torchrun --nproc-per-node 3" in message


def test_without_torchrun_load_says_how_to_start(tmp_path, monkeypatch):
    import fxpipe.distributed
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(fxpipe.distributed.DistributedError, match="torchrun --nproc-per-node"):
        fxpipe.distributed.load(tmp_path)
