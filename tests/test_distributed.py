"""A saved plan run by torchrun, one process per stage, equals the model and the pipeline.

Each test launches `python -m torch.distributed.run` on 127.0.0.1 (gloo) with
`distributed_worker.py`, which saves what every rank got; the launch has a timeout, after which
everything it started is killed.
"""

import importlib
import importlib.util
import io
import json
import os
import re
import signal
import time
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding, grads_of
import fxpipe.distributed

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("distributed_worker.py")
EXAMPLE = ROOT / "examples" / "torchrun_train.py"
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


def torchrun(arguments: list[str], processes: int, env: dict[str, str] | None = None, *,
             cwd: Path = ROOT, timeout_s: float = LAUNCH_TIMEOUT_S) -> tuple[int, str]:
    """Run `python -m torch.distributed.run` on 127.0.0.1 with `processes` ranks and the script
    and arguments given, in `cwd`; its exit status and output. Fails the test (killing
    everything it started) past `timeout_s`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(processes), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               *arguments]
    proc = subprocess.Popen(command, cwd=cwd, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        pytest.fail(f"torchrun {' '.join(arguments)} did not finish in {timeout_s} s:\n"
                    f"{text.decode(errors='replace')[-3000:]}")
    return proc.returncode, text.decode(errors="replace")


def launch(plan: Path, data: Path, out: Path, processes: int, mode: str = "run", *,
           timeout: float = 30, ok: bool = True) -> str:
    """Run the worker on `processes` ranks in `mode`, each waiting `timeout` s for the others;
    fail (killing them all) past LAUNCH_TIMEOUT_S. With `ok`, torchrun must exit 0. Returns
    torchrun's output."""
    out.mkdir()
    code, text = torchrun([str(WORKER), str(plan), str(data), str(out), mode], processes,
                          {"FXPIPE_TIMEOUT": str(timeout)})
    if ok:
        assert code == 0, text[-3000:]
    else:
        assert code != 0, text[-3000:]
    return text


class Tied(nn.Module):
    """An embedding whose weight the output layer reads again (tied weights): the first and
    the last stage hold it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, ids):
        h = self.b(torch.relu(self.a(self.emb(ids))))
        return F.linear(h, self.emb.weight)


def planned(tmp_path: Path, stages: int, schedule: str = "gpipe", *, model=None, x=None,
            target=None, recompute="never", edit=None):
    """Plan the model (Branchy unless given, with its batch) in `stages` stages and save it
    with a batch (`edit(pipe)` first, when given); the model, the batch and the single-process
    pipeline."""
    torch.manual_seed(0)
    if model is None:
        model, x, target = Branchy(), torch.randn(8, 8), torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu"] * stages, (x,), chunks=2, training=True,
                          schedule=schedule, recompute=recompute)
    assert len(pipe.stages) == stages
    if edit is not None:
        edit(pipe)
    pipe.plan.save(tmp_path / "plan")
    torch.save({"x": x, "target": target}, tmp_path / "data.pt")
    return model, x, target, pipe


def ran(tmp_path: Path, processes: int, stages: int, schedule: str = "gpipe", *,
        mode: str = "run", **batch):
    """Plan the model in `stages` stages, save it, run it on `processes` ranks in the worker's
    `mode`; the model, the batch, the single-process pipeline and the folder holding each
    rank's results. `batch`: another model and batch for `planned`."""
    model, x, target, pipe = planned(tmp_path, stages, schedule, **batch)
    output = launch(tmp_path / "plan", tmp_path / "data.pt", tmp_path / "out", processes, mode)
    (tmp_path / "out" / "torchrun.txt").write_text(output)
    return model, x, target, pipe, tmp_path / "out"


def errors(out: Path, processes: int) -> list[str | None]:
    """What each rank wrote to rank<r>.err (`Type: message`), None where it wrote nothing."""
    files = [out / f"rank{r}.err" for r in range(processes)]
    return [f.read_text() if f.exists() else None for f in files]


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
        assert_same_up_to_rounding(last["output"], model(x))


def test_a_plan_priced_for_threads_is_run_with_a_warning_saying_how_to_price_it(two_ranks):
    """The test's plans price values as hand-offs between threads (the default link): rank 0,
    alone, warns that a run under torchrun should be planned with link='gloo'."""
    output = (two_ranks[4] / "torchrun.txt").read_text()
    assert output.count("plan with fxpipe.plan(..., link='gloo') for a run under torchrun") == 1
    assert "hand-offs between threads of one process (link='default')" in output


def assert_trains_as_the_model(model, x, target, pipe, out, processes):
    """The last rank's loss is the pipeline's and the model's; every parameter's gradient, from
    the rank holding it, is the model's."""
    ranks = results(out, processes)
    assert all(r["loss"] is None for r in ranks[:-1])
    expected = pipe.train_step(x, target, F.mse_loss)
    assert_same_up_to_rounding(ranks[-1]["loss"], expected)
    model.zero_grad()
    F.mse_loss(model(x), target).backward()
    got = {name: g for r in ranks for name, g in r["grads"].items()}
    assert set(got) == {name for name, _ in model.named_parameters()}
    assert_same_up_to_rounding(got, grads_of(model), what="gradient")


def test_a_gpipe_train_step_equals_the_pipeline_and_the_model(two_ranks):
    assert_trains_as_the_model(*two_ranks[:4], two_ranks[4], 2)


def test_each_rank_records_its_row_of_the_timetable_with_its_times(two_ranks):
    from fxpipe.runtime.schedules import timetable_for
    *_, out = two_ranks
    timetable = timetable_for("gpipe", 2, 2, backward=True)     # the last step, a train_step
    for rank, got in enumerate(results(out, 2)):
        slots, wall_s, error = got["run"]
        assert [(s, m, phase) for s, m, phase, _, _ in slots] == \
            [(a.stage, a.microbatch, a.phase.name) for a in timetable[rank]]
        assert all(0 <= start <= end <= wall_s for *_, start, end in slots) and error is None
        ends = [end for *_, end in slots]
        assert ends == sorted(ends)        # one row, in order


def test_a_batch_of_fewer_rows_than_chunks_runs_on_ranks_as_in_process(tmp_path):
    """One front for both (`runtime.front`): a batch of 3 rows on a plan of 4 chunks runs as 3
    micro-batches of one row on the ranks as in process (not a BatchError), the output, loss
    and gradients the pipeline's and the model's, each rank's row the timetable of 3."""
    from fxpipe.runtime.schedules import timetable_for
    torch.manual_seed(0)
    model, x, target = Branchy(), torch.randn(8, 8), torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, training=True)
    pipe.plan.save(tmp_path / "plan")
    x, target = x[:3], target[:3]
    torch.save({"x": x, "target": target}, tmp_path / "data.pt")
    launch(tmp_path / "plan", tmp_path / "data.pt", tmp_path / "out", 2)
    assert errors(tmp_path / "out", 2) == [None, None]
    ranks = results(tmp_path / "out", 2)
    with torch.no_grad():
        expected = pipe(x)
        assert pipe.last_run.microbatches == 3
        assert_same_up_to_rounding(ranks[-1]["output"], expected)
        assert_same_up_to_rounding(ranks[-1]["output"], model(x))
    assert_trains_as_the_model(model, x, target, pipe, tmp_path / "out", 2)
    timetable = timetable_for("gpipe", 2, 3, backward=True)
    for rank, got in enumerate(ranks):
        assert [(s, m, phase) for s, m, phase, *_ in got["run"][0]] == \
            [(a.stage, a.microbatch, a.phase.name) for a in timetable[rank]]


def recompute_relus(pipe):
    """Every stage recomputes its ReLUs, as runs under torch.utils.checkpoint."""
    from fxpipe.passes.recompute import checkpoint_regions
    for stage in pipe.plan.stages:
        checkpoint_regions(stage.module, {n.name for n in stage.module.graph.nodes
                                          if "relu" in n.name})


@pytest.mark.parametrize("recompute", [dict(recompute="always"), dict(edit=recompute_relus)])
def test_recomputing_stages_train_as_the_model(tmp_path, recompute):
    model, x, target, pipe, out = ran(tmp_path, 2, 2, "1f1b", **recompute)
    assert any(pipe.plan.stage_recompute) or "recomputed_0" in pipe.plan.stages[0].module.code \
        + pipe.plan.stages[1].module.code
    assert_trains_as_the_model(model, x, target, pipe, out, 2)


@pytest.mark.parametrize("stages", [3, 4])
def test_three_and_four_ranks_with_1f1b_equal_the_model(tmp_path, stages):
    model, x, target, pipe, out = ran(tmp_path, stages, stages, schedule="1f1b")
    assert pipe.schedule == "1f1b"
    with torch.no_grad():
        assert_same_up_to_rounding(results(out, stages)[-1]["output"], model(x))
    assert_trains_as_the_model(model, x, target, pipe, out, stages)
    # some stage reads from one not just before it (the driver is -1): a value skips stages
    reads = pipe.plan.wiring.training.reads
    assert any(src != dst - 1 for dst, senders in reads.items() for src in senders)


def test_a_world_size_unlike_the_plan_is_refused_on_every_rank(tmp_path):
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(6, 8)
    fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=2).plan.save(tmp_path / "plan")
    torch.save({"x": x, "target": x}, tmp_path / "data.pt")
    launch(tmp_path / "plan", tmp_path / "data.pt", tmp_path / "out", 2)
    for rank in range(2):
        message = (tmp_path / "out" / f"rank{rank}.err").read_text()
        assert message.startswith("WorldSizeError")
        assert "3 stages; 2 processes run it" in message
        assert "torchrun --nproc-per-node 3" in message


def test_without_torchrun_load_says_how_to_start(tmp_path, monkeypatch):
    import fxpipe.distributed
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(fxpipe.distributed.DistributedError, match="torchrun --nproc-per-node"):
        fxpipe.distributed.load(tmp_path)


def threads() -> dict[int, str]:
    """This process's threads, by id, with their names, read from /proc: gloo's are C++
    threads, which `threading.enumerate()` does not list."""
    found = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            found[int(task.name)] = (task / "comm").read_text().strip()
        except OSError:     # a thread that ended meanwhile
            continue
    return found


def gloo_threads() -> set[int]:
    """The ids of this process's gloo threads: each gloo group's workers and its loop."""
    return {tid for tid, name in threads().items() if name in ("pt_gloo_runloop", "gloo_tcp_loop")}


def settles(condition) -> bool:
    """Whether `condition()` holds within 30 s: a thread names itself once it runs, and a
    joined one may still be listed for a moment after the join returns."""
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def started_gloo_threads(earlier: set[int]) -> set[int]:
    """The gloo threads started since `earlier` (thread ids), once each has named itself."""
    assert settles(lambda: all(name != "python" for tid, name in threads().items()
                               if tid not in earlier))
    return gloo_threads() - earlier


def one_process_stage(tmp_path: Path):
    """A one-stage plan (world size 1) trained one step in this process; (plan path, batch)."""
    torch.manual_seed(0)
    model, x, target = Branchy(), torch.randn(4, 8), torch.randn(4, 4)
    fxpipe.compile(model, ["cpu"], (x,), chunks=2, training=True).plan.save(tmp_path / "plan")
    return tmp_path / "plan", x, target


needs_proc = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                reason="reads this process's threads from /proc")


@needs_proc
def test_a_closed_stage_leaves_no_process_group_or_gloo_thread_of_its_own(tmp_path, monkeypatch):
    """`load` started the default group (torchrun's environment, world size 1, in this
    process): after `close`, no process group is left and every gloo thread ended, so none
    can free a tensor while the interpreter exits (a SIGABRT at exit); closing again does
    nothing, and the closed stage refuses to run."""
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised")
    plan, x, target = one_process_stage(tmp_path)
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                            WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    before, python_threads = gloo_threads(), set(threading.enumerate())
    stage = fxpipe.distributed.load(plan)
    try:
        assert settles(lambda: gloo_threads() - before)     # the group's threads run
        stage.train_step(x, target, F.mse_loss)
    finally:
        stage.close()
    assert not torch.distributed.is_initialized()
    assert not torch.distributed.distributed_c10d._world.pg_map
    assert settles(lambda: gloo_threads() == before), threads()
    assert set(threading.enumerate()) <= python_threads
    stage.close()
    with pytest.raises(fxpipe.distributed.DistributedError, match="stage is closed"):
        stage.train_step(x, target, F.mse_loss)


def _gloo_under_another_name(store, rank, size, timeout):
    return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)


@needs_proc
@pytest.mark.parametrize("backend", ["gloo", "fxpipe_test"])
def test_closing_destroys_the_groups_load_made_and_leaves_the_callers(tmp_path, backend):
    """The caller started the default group (world size 1, a FileStore), as the docs' scripts
    do. Over gloo, `load` makes no group; over another backend ("fxpipe_test", gloo under
    another name, as NCCL would be) it makes a gloo group of its own for its messages. After
    `close`, the caller's group alone is left, still usable, and only its gloo threads run:
    destroying it then ends every gloo thread, though the stage object is still held."""
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised")
    dist = torch.distributed
    dist.Backend.register_backend("fxpipe_test", _gloo_under_another_name, devices=["cpu"])
    plan, x, target = one_process_stage(tmp_path)
    before, earlier = gloo_threads(), set(threads())
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        callers = before | started_gloo_threads(earlier)
        stage = fxpipe.distributed.load(plan)
        try:
            made = len(dist.distributed_c10d._world.pg_map) - 1
            assert made == (backend != "gloo")
            stage.train_step(x, target, F.mse_loss)
        finally:
            stage.close()
        assert list(dist.distributed_c10d._world.pg_map) == [dist.group.WORLD]
        assert settles(lambda: gloo_threads() == callers), threads()
        total = torch.ones(2)
        dist.all_reduce(total)
        assert total.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
    assert settles(lambda: gloo_threads() == before), threads()
    assert stage.closed


@needs_proc
@pytest.mark.parametrize("whose", ["load's", "the caller's"])
def test_a_group_torch_held_in_defaults_ends_with_the_stage_or_its_caller(tmp_path, monkeypatch,
                                                                         whose):
    """`torch.distributed.nn.functional` binds the default group into its functions' default
    arguments when first imported, and `torch.utils.checkpoint`'s first call imports it (through
    `torch._dynamo`): a recomputing stage's first backward, or the caller's own imports after
    it started its group. The group then outlived `destroy_process_group` and its gloo threads
    ran into the interpreter's exit, where a rank aborted (the recomputing 1F1B case under
    torchrun: `python -m benchmarks.torchrun_exit --case regions`). Here that import happens
    again (`reload`) while the group lives: during the recomputing step for the group `load`
    started, before `load` for the caller's. After `close` (and the caller's own destroy),
    every gloo thread has ended."""
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised")
    import torch.distributed.nn.functional as functional
    dist = torch.distributed
    torch.manual_seed(0)
    model, x, target = Branchy(), torch.randn(4, 8), torch.randn(4, 4)
    pipe = fxpipe.compile(model, ["cpu"], (x,), chunks=2, training=True)
    recompute_relus(pipe)
    pipe.plan.save(tmp_path / "plan")
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                            WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    before = gloo_threads()
    try:
        if whose == "the caller's":
            dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                                    world_size=1)
            importlib.reload(functional)
            assert dist.group.WORLD in functional.all_reduce.__defaults__
        with fxpipe.distributed.load(tmp_path / "plan") as stage:
            if whose == "load's":
                importlib.reload(functional)
                assert dist.group.WORLD in functional.all_reduce.__defaults__
            stage.train_step(x, target, F.mse_loss)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert settles(lambda: gloo_threads() == before), threads()


def test_two_replicas_of_two_stages_add_up_to_the_whole_batch(tmp_path):
    """Ranks 0, 1 are replica 0 (stages 0, 1), ranks 2, 3 replica 1, on 4 and 3 of the 7
    rows; after the step, both last stages return the whole batch's loss, every rank holds the
    model's gradients on the whole batch (mean loss: each shard weighted by its rows), and the
    inputs given with requires_grad on each stage 0 (rank 0 and 2) get their rows' gradients,
    from both stages reading them."""
    torch.manual_seed(0)
    batch = dict(model=Branchy(), x=torch.randn(7, 8), target=torch.randn(7, 4))
    model, x, target, pipe, out = ran(tmp_path, 4, 2, mode="inputgrad", **batch)
    ranks = results(out, 4)
    shards = [(x[:4], target[:4]), (x[4:], target[4:])]
    with torch.no_grad():
        for replica, (xs, _) in enumerate(shards):
            assert ranks[2 * replica]["output"] is None
            assert_same_up_to_rounding(ranks[2 * replica + 1]["output"], model(xs))
    whole = pipe.train_step(x, target, F.mse_loss)
    assert_same_up_to_rounding(whole, F.mse_loss(model(x), target))
    for replica in range(2):
        assert ranks[2 * replica]["loss"] is None
        assert_same_up_to_rounding(ranks[2 * replica + 1]["loss"], whole)
    model.zero_grad()
    x = x.clone().requires_grad_()
    F.mse_loss(model(x), target).backward()
    assert_same_up_to_rounding(torch.cat([ranks[0]["x_grad"], ranks[2]["x_grad"]]), x.grad)
    assert all(got["grads"] for got in ranks), [list(got["grads"]) for got in ranks]
    expected = assert_each_ranks_gradients(ranks, model)
    assert set(ranks[0]["grads"]) | set(ranks[1]["grads"]) == set(expected)
    assert ranks[0]["grads"].keys() == ranks[2]["grads"].keys()


def test_an_input_with_requires_grad_gets_its_gradient_from_every_stage_reading_it(tmp_path):
    """Branchy's input is read by stage 0 and by the last stage (and maybe stage 1): on 3 ranks
    with 1F1B, the input given to rank 0 with requires_grad gets the model's gradient, the
    other ranks' parts sent back to it."""
    model, x, target, _, out = ran(tmp_path, 3, 3, "1f1b", mode="inputgrad")
    ranks = results(out, 3)
    x = x.clone().requires_grad_()
    F.mse_loss(model(x), target).backward()
    assert_same_up_to_rounding(ranks[0]["x_grad"], x.grad)
    assert ranks[1]["x_grad"] is None and ranks[2]["x_grad"] is None


def tied_batch() -> dict:
    torch.manual_seed(0)
    return dict(model=Tied(), x=torch.randint(0, 20, (8, 5)), target=torch.randn(8, 5, 20))


def held_by(plan: Path, name: str) -> list[int]:
    """The stages of the saved plan holding the tensor `name` (first held by stage 0)."""
    return [0] + [stage for stage, refs in enumerate(json.loads(
        (plan / "plan.json").read_text())["shared"]) if refs.get(name) == [0, name]]


def assert_each_ranks_gradients(ranks, model, times=1):
    """Each rank's gradients, of the parameters it holds, are `times` the model's (each rank's
    set compared together); returns the model's parameters by name."""
    expected = dict(model.named_parameters())
    for rank, got in enumerate(ranks):
        assert_same_up_to_rounding(got["grads"],
                                   {name: times * expected[name].grad for name in got["grads"]},
                                   what=f"rank {rank}: gradient")
    return expected


def assert_every_rank_has_the_whole_gradients(model, x, target, pipe, ranks):
    """Every rank's gradient of each parameter it holds (a tied weight: on each rank holding
    it) is the threaded pipeline's and the model's, on the whole batch."""
    pipe.zero_grad()
    pipe.train_step(x, target, F.mse_loss)
    piped = {name: p.grad.clone() for name, p in pipe.named_parameters()}
    model.zero_grad()
    F.mse_loss(model(x), target).backward()
    assert_same_up_to_rounding(piped, grads_of(model), what="gradient")
    assert all(got["grads"] for got in ranks), [list(got["grads"]) for got in ranks]
    expected = assert_each_ranks_gradients(ranks, model)
    assert {name for r in ranks for name in r["grads"]} == set(expected)


@pytest.mark.parametrize("stages", [2, 3])
def test_a_weight_tied_across_the_first_and_last_stage_gets_its_whole_gradient(tmp_path, stages):
    """The embedding's weight is held by stage 0 and the last: each of those ranks ends the
    step with the sum of both stages' parts, the model's gradient."""
    model, x, target, pipe, out = ran(tmp_path, stages, stages, **tied_batch())
    assert held_by(tmp_path / "plan", "emb.weight") == [0, stages - 1]
    ranks = results(out, stages)
    assert_same_up_to_rounding(ranks[-1]["loss"], F.mse_loss(model(x), target))
    assert "emb.weight" in ranks[0]["grads"] and "emb.weight" in ranks[-1]["grads"]
    assert_every_rank_has_the_whole_gradients(model, x, target, pipe, ranks)


def test_two_replicas_of_a_tied_weight_get_the_whole_batch_gradient(tmp_path):
    """2 stages x 2 replicas: the tied weight's parts are added up within each replica (ranks
    0 and 1, ranks 2 and 3), and the replicas' sums averaged: every rank holds the model's."""
    model, x, target, pipe, out = ran(tmp_path, 4, 2, **tied_batch())
    assert held_by(tmp_path / "plan", "emb.weight") == [0, 1]
    ranks = results(out, 4)
    for last in (ranks[1], ranks[3]):
        assert_same_up_to_rounding(last["loss"], F.mse_loss(model(x), target))
    assert_every_rank_has_the_whole_gradients(model, x, target, pipe, ranks)


def test_replicas_of_a_summed_loss_add_up_to_the_whole_batch_sum(tmp_path):
    """With `reduction="sum"` (shards of 4 and 3 rows), both last stages return the sum over
    the whole batch and every rank holds its gradients: the replicas' are added, not averaged."""
    torch.manual_seed(0)
    batch = dict(model=Branchy(), x=torch.randn(7, 8), target=torch.randn(7, 4))
    model, x, target, pipe, out = ran(tmp_path, 4, 2, mode="sum", **batch)
    ranks = results(out, 4)

    def summed(output, target):
        return F.mse_loss(output, target, reduction="sum")
    whole = pipe.train_step(x, target, summed, reduction="sum")
    assert_same_up_to_rounding(whole, summed(model(x), target))
    for last in (ranks[1], ranks[3]):
        assert_same_up_to_rounding(last["loss"], whole)
    model.zero_grad()
    summed(model(x), target).backward()
    expected = assert_each_ranks_gradients(ranks, model)
    assert {name for r in ranks for name in r["grads"]} == set(expected)


def test_losses_as_sum_and_count_give_the_whole_batch_mean_on_every_replica(tmp_path):
    """A loss averaged over the positive targets, returned as (loss_sum, count), on 2 stages x
    2 replicas with shards of 4 and 3 rows: the loss, every gradient and the input's gradient
    are those of the whole batch's mean over its positive targets."""
    torch.manual_seed(0)
    batch = dict(model=Branchy(), x=torch.randn(7, 8), target=torch.randn(7, 4))
    model, x, target, _, out = ran(tmp_path, 4, 2, mode="count", **batch)
    ranks = results(out, 4)
    x = x.clone().requires_grad_()
    kept = target > 0
    expected_loss = F.mse_loss(model(x)[kept], target[kept])
    model.zero_grad()
    expected_loss.backward()
    for last in (ranks[1], ranks[3]):
        assert_same_up_to_rounding(last["loss"], expected_loss.detach())
    assert_each_ranks_gradients(ranks, model)
    assert_same_up_to_rounding(torch.cat([ranks[0]["x_grad"], ranks[2]["x_grad"]]), x.grad)


def test_gradients_of_two_steps_accumulate_with_tied_weights_and_replicas(tmp_path):
    """Two steps without zeroing, 2 stages x 2 replicas of the tied model: only each step's
    gradients are added up across ranks, so every rank holds twice the model's."""
    model, x, target, _, out = ran(tmp_path, 4, 2, mode="twice", **tied_batch())
    ranks = results(out, 4)
    assert_same_up_to_rounding(ranks[3]["loss"], F.mse_loss(model(x), target))
    model.zero_grad()
    F.mse_loss(model(x), target).backward()
    expected = assert_each_ranks_gradients(ranks, model, times=2)
    assert {name for r in ranks for name in r["grads"]} == set(expected)


def test_a_world_size_not_a_multiple_of_the_stages_is_refused(tmp_path):
    planned(tmp_path, 2)
    launch(tmp_path / "plan", tmp_path / "data.pt", tmp_path / "out", 3)
    for message in errors(tmp_path / "out", 3):
        assert message.startswith("WorldSizeError")
        assert "2 stages; 3 processes run it" in message
        assert "torchrun --nproc-per-node 2 (or 4 for two replicas)" in message


def test_a_failing_stage_ends_every_rank_at_once_naming_it(tmp_path):
    """Rank 1 of 3 raises in its first forward: it raises a StageError naming its rank and
    stage; rank 0 (finishing its step) and rank 2 (waiting for rank 1) are told by a message,
    not by their 10 s timeout."""
    planned(tmp_path, 3)
    start = time.monotonic()
    launch(tmp_path / "plan", tmp_path / "data.pt", tmp_path / "out", 3, "raise1", timeout=10)
    first, failed, last = errors(tmp_path / "out", 3)
    assert failed.startswith("StageError: rank 1: stage 1 failed on micro-batch 0 (forward)")
    assert "the test's stage fails here" in failed
    for message in (first, last):
        assert message.startswith("PeerFailedError: rank 1 failed: rank 1: stage 1"), message
        assert "went silent" not in message
    assert issubclass(fxpipe.distributed.PeerFailedError, fxpipe.distributed.DistributedError)
    # Closing, each rank reads the others' news instead of waiting for its 10 s timeout; the
    # bound catches a rank that waits for it anyway (three startups take about 4 s here).
    assert time.monotonic() - start < 40


def test_a_rank_killed_mid_step_ends_the_others_naming_it(tmp_path):
    """Rank 1 exits while computing its loss. torchrun then exits non-zero (and would end
    rank 0, which the worker has ignore SIGTERM here, so that what rank 0 met is written):
    rank 0 ends on its own within its timeout, with a DistributedError naming rank 1."""
    planned(tmp_path, 2)
    output = launch(tmp_path / "plan", tmp_path / "data.pt", tmp_path / "out", 2, "kill1",
                    timeout=10, ok=False)
    first, killed = errors(tmp_path / "out", 2)
    assert killed is None and not (tmp_path / "out" / "rank1.pt").exists()
    assert first.startswith("DistributedError: rank 0 waited for rank 1 and lost it"), first
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: 1", output), output
    # torchrun's summary of the failure


@pytest.mark.parametrize("change", ["edit stage_0.py", "remove stage_1.py"])
def test_a_plan_whose_files_changed_is_refused_on_every_rank(tmp_path, change):
    planned(tmp_path, 2)
    action, name = change.split()
    if action == "edit":
        with open(tmp_path / "plan" / name, "a") as f:
            f.write("# edited\n")
    else:
        (tmp_path / "plan" / name).unlink()
    launch(tmp_path / "plan", tmp_path / "data.pt", tmp_path / "out", 2)
    for message in errors(tmp_path / "out", 2):
        assert message.startswith("PlanFileError"), message
        assert name in message and "save the plan again" in message


def test_a_rank_that_cannot_load_its_stage_stops_every_rank(tmp_path):
    """Only rank 1 reads stage_1.pt: without it rank 1 raises the PlanFileError and rank 0 a
    DistributedError naming rank 1, rather than waiting for a stage that never starts."""
    planned(tmp_path, 2)
    (tmp_path / "plan" / "stage_1.pt").unlink()
    launch(tmp_path / "plan", tmp_path / "data.pt", tmp_path / "out", 2, timeout=10)
    first, second = errors(tmp_path / "out", 2)
    assert second.startswith("PlanFileError") and "stage_1.pt" in second
    assert first.startswith("DistributedError: rank 1 could not load its stage, so rank 0 stops "
                            "too\nPlanFileError")


def test_the_torchrun_example_trains_as_the_model(tmp_path):
    """examples/torchrun_train.py: plan (in this process), then 3 steps on 2 ranks under
    torchrun; the losses it prints (6 decimals) are those of the model trained alone with the
    same optimizer, its tied weight included (a wrong gradient changes the later steps)."""
    spec = importlib.util.spec_from_file_location("torchrun_train", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.make_plan(str(tmp_path / "plan"), 2)
    assert held_by(tmp_path / "plan", "embed.weight") == [0, 1]
    code, text = torchrun([str(EXAMPLE), "train", str(tmp_path / "plan"), "--steps", "3",
                           "--lr", "0.5"], 2)
    assert code == 0, text[-3000:]
    assert "link='gloo') for a run under torchrun" not in text    # planned with link="gloo"
    printed = [float(v) for v in re.findall(r"^step \d loss (\S+)$", text, re.MULTILINE)]
    torch.manual_seed(0)
    model = example.TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = []
    for tokens, targets in example.batches(3):
        optimizer.zero_grad()
        loss = example.loss_fn(model(tokens), targets)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    assert len(printed) == 3, text[-3000:]
    torch.testing.assert_close(torch.tensor(printed), torch.tensor(expected),
                               rtol=1e-5, atol=2e-6)


def test_a_measured_gloo_link_prices_messages_as_they_travel(tmp_path):
    link = fxpipe.distributed.measure_link(repeats=3)
    assert 0 < link.latency_s < 1 and 1e6 < link.bytes_per_s < float("inf")
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(8, 8)
    plain = fxpipe.plan(model, ["cpu"] * 2, (x,), verify=False)
    priced = fxpipe.plan(model, ["cpu"] * 2, (x,), verify=False, costs=plain,
                         link=lambda src, dst: link)
    # Every stage sends or receives at least one message, each now at gloo's latency.
    for cost in priced.partition.stages:
        assert cost.comm_s >= link.latency_s
    assert min(c.comm_s for c in priced.partition.stages) > \
        max(c.comm_s for c in plain.partition.stages)
    # link="gloo" measures it once, and the plan (and its file) says what it priced with.
    gloo = fxpipe.plan(model, ["cpu"] * 2, (x,), verify=False, costs=plain, link="gloo")
    assert (plain.link, priced.link, gloo.link) == ("default", "yours", "gloo")
    assert "values priced as messages between processes over gloo" in str(gloo)
    for cost in gloo.partition.stages:
        assert cost.comm_s > max(c.comm_s for c in plain.partition.stages)
    gloo.save(tmp_path / "plan")
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["link"] == "gloo"
    assert fxpipe.load_plan(tmp_path / "plan").link == "gloo"


MESSAGES = [{"h": torch.arange(6.0).reshape(2, 3)},                      # a short header
            {"t": [torch.ones(4), None, 2.5], "long": list(range(2000))},    # a long one
            {"empty": torch.zeros(0, 3), "i": torch.tensor([7], dtype=torch.int64)}]


def _exchange(rank, init, results, held):
    """Rank 0 sends MESSAGES in two steps and then fails; rank 1 asks for them last first,
    answers in the second step, then waits for more: the failure must reach it. Rank 0 puts in
    `held` how many messages it holds before and after the answer (which acks all three)."""
    import torch.distributed as dist
    from fxpipe.distributed import DistributedTransport, PeerFailedError
    from fxpipe.runtime.schedules import Phase
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    transport = DistributedTransport(rank, torch.device("cpu"), timeout=30, peers=[0, 1])
    try:
        for step in range(2):
            for m, values in enumerate(MESSAGES):
                if rank == 0:
                    transport.send(Phase.FORWARD, 0, 1, m, values)
                else:
                    values = transport.receive(Phase.FORWARD, 0, 1, len(MESSAGES) - 1 - m)
                    results.put(_saved(values))
            if step == 0:
                transport.finish_step()
        if rank == 0:
            held.put(len(transport.posted[1]))
            transport.receive(Phase.BACKWARD, 1, 0, 0)
            held.put(len(transport.posted[1]))
            transport.abort("rank 0 failed: on purpose")
        else:
            transport.send(Phase.BACKWARD, 1, 0, 0, {"answer": torch.ones(2)})
            try:
                transport.receive(Phase.FORWARD, 0, 1, len(MESSAGES))
            except PeerFailedError as e:
                results.put(str(e))
        transport.close()
    finally:
        dist.destroy_process_group()


def _saved(values):
    """`values` as bytes: tensors put in a queue by a process that exits are lost."""
    buffer = io.BytesIO()
    torch.save(values, buffer)
    return buffer.getvalue()


def test_messages_arrive_as_sent_in_any_order_asked_then_a_failure(tmp_path):
    """Messages through `DistributedTransport` between two gloo processes, whatever the length
    of their headers (one send, or two past `HEADER_BYTES`) and however the receiver orders its
    asks; the sender holds its messages until a header from the receiver acks them; in a
    second step the sender fails, and the receiver hears it behind the messages."""
    import torch.multiprocessing as mp
    context = mp.get_context("spawn")
    results, held = context.SimpleQueue(), context.SimpleQueue()
    processes = [context.Process(target=_exchange,
                                 args=(rank, f"file://{tmp_path / 'init'}", results, held))
                 for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [process.exitcode for process in processes] == [0, 0]
    for _ in range(2):
        received = [torch.load(io.BytesIO(results.get()), weights_only=False) for _ in MESSAGES]
        torch.testing.assert_close(received[::-1], MESSAGES)
    told = results.get()
    assert told.startswith("rank 0 failed: on purpose") and "told by rank 0" in told
    # the sender held the second step's three messages until the answer acked them
    assert [held.get(), held.get()] == [len(MESSAGES), 0]
