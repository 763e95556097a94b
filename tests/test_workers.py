"""Stage workers kept for the pipeline's life: the same thread runs a stage's work in every call,
step and stream; close(), a with block and garbage collection end them; a failure or a nested
run leaves them usable; a closed pipeline is refused; a forked child gets workers of its own."""

import gc
import os
import threading
import time

import pytest
import torch
import torch.fx
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.runtime.workers import working

SEEN: list[tuple[int, threading.Thread]] = []


def mark(x, tag: int):
    """Records which thread ran the stage holding this point of the model."""
    SEEN.append((tag, threading.current_thread()))
    return x


torch.fx.wrap("mark")


class Marked(nn.Module):
    def __init__(self, width: int = 16, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for tag, layer in enumerate(self.layers):
            x = mark(torch.tanh(layer(x)), tag)
        return x


def compiled(stages: int = 3, chunks: int = 4, training: bool = False):
    torch.manual_seed(0)
    model, x = Marked().train(training), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * stages, (x,), chunks=chunks)
    SEEN.clear()
    return model, x, pipe


def stage_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("fxpipe-stage")}


def test_each_stage_runs_on_one_worker_across_calls_steps_and_streams():
    model, x, pipe = compiled(training=True)
    loss_fn = nn.functional.mse_loss
    target = torch.randn(8, 16)
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    with pipe:
        for _ in range(2):
            pipe(x)
            pipe.train_step(x, target, loss_fn)
        list(pipe.stream([x[:2], x[2:4]]))
        items = [(x[i:i + 2], target[i:i + 2]) for i in range(0, 8, 2)]
        list(pipe.stream_train(items, loss_fn, opt))
        list(pipe.stream_train(items, loss_fn, opt, mode="async"))
        workers = set(pipe._runtime.workers.threads)
        by_tag = {tag: {t for tg, t in SEEN if tg == tag} for tag, _ in SEEN}
    assert set(by_tag) == {0, 1, 2, 3}
    assert all(len(threads) == 1 for threads in by_tag.values()), by_tag
    assert set().union(*by_tag.values()) <= workers and len(workers) == 3


@pytest.mark.parametrize("how", ["close", "with", "garbage"])
def test_close_a_with_block_and_garbage_collection_end_every_worker(how):
    before = stage_threads()
    model, x, pipe = compiled()
    if how == "with":
        with pipe as same:
            assert_same_up_to_rounding(same(x), model(x))
            threads = set(pipe._runtime.workers.threads)
    else:
        assert_same_up_to_rounding(pipe(x), model(x))
        threads = set(pipe._runtime.workers.threads)
        if how == "close":
            pipe.close()
        else:
            del pipe
            gc.collect()
    assert len(threads) == 3 and all(t.name.startswith("fxpipe-stage") for t in threads)
    for t in threads:       # each worker's own end, waited for (the bound only stops a hang)
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker outlived close"
    assert stage_threads() <= before      # (earlier tests' pipelines may be collected meanwhile)


def test_a_closed_pipeline_is_refused_by_name_in_every_way_of_running():
    model, x, pipe = compiled(training=True)
    pipe.close()
    target, loss_fn = torch.randn(8, 16), nn.functional.mse_loss
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    with pytest.raises(fxpipe.PipelineClosedError, match="closed"):
        pipe(x)
    with pytest.raises(fxpipe.PipelineClosedError):
        pipe.train_step(x, target, loss_fn)
    with pytest.raises(fxpipe.PipelineClosedError):
        next(iter(pipe.stream([x])))
    with pytest.raises(fxpipe.PipelineClosedError):
        pipe.stream_train([(x, target)], loss_fn, opt)
    pipe.close()     # closing twice is harmless


def test_a_call_inside_an_open_stream_runs_on_threads_of_its_own_and_equals_the_model():
    model, x, pipe = compiled()
    with pipe, torch.no_grad():
        for item, out in zip([x[:2], x[2:5]], pipe.stream([x[:2], x[2:5]])):
            assert_same_up_to_rounding(out, model(item))
            assert_same_up_to_rounding(pipe(x), model(x))     # the workers are the stream's
        assert not working()
        kept = pipe._runtime.workers.threads
        assert_same_up_to_rounding(pipe(x), model(x))
        assert pipe._runtime.workers.threads == kept


def test_a_failure_leaves_the_same_workers_usable():
    model, x, pipe = compiled()
    with pipe:
        pipe(x)
        kept = pipe._runtime.workers.threads
        with pytest.raises(fxpipe.StageError, match=r"stage \d .*micro-batch 0"):
            pipe(torch.randn(8, 3))
        assert not working() and all(t.is_alive() for t in kept)
        assert_same_up_to_rounding(pipe(x), model(x))
        assert pipe._runtime.workers.threads == kept


def test_one_stage_runs_on_the_callers_thread_and_starts_no_worker():
    model, x, pipe = compiled(stages=1)
    with pipe:
        assert_same_up_to_rounding(pipe(x), model(x))
        assert pipe._runtime.workers.threads == []
        assert {t for _, t in SEEN} <= {threading.current_thread()}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_runs_the_pipeline_on_workers_of_its_own():
    model, x, pipe = compiled()
    with pipe, torch.no_grad():
        expected = model(x)
        assert_same_up_to_rounding(pipe(x), expected)      # the parent's workers are started
        parent_workers = pipe._runtime.workers.threads
        read, write = os.pipe()
        child = os.fork()
        if child == 0:           # the child: no test machinery, only an exit status
            code = 1
            try:
                torch.set_num_threads(1)
                same = bool(((pipe(x) - expected).abs() <= 1e-5 * expected.abs().max()).all())
                own = not set(pipe._runtime.workers.threads) & set(parent_workers)
                code = 0 if same and own else 3
            finally:
                os.write(write, bytes([code]))
                os._exit(code)
        os.close(write)
        deadline = time.monotonic() + 120
        while os.waitpid(child, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(child, 9)
                pytest.fail("the forked child hung running the pipeline")
            time.sleep(0.05)
        status = os.read(read, 1)
        os.close(read)
        assert status == bytes([0]), f"child status {status!r}"
        assert_same_up_to_rounding(pipe(x), expected)      # the parent's still work
