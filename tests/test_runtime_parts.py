"""The runtime's parts on their own: the stage executor without threads, the transport's queues and
abort, and the orchestrator parking its workers again when a stage fails."""

import threading

import pytest
import torch
import torch.fx as fx
from torch import nn

from fxpipe.runtime import Aborted, Runtime, StageExecutor, ThreadTransport
from fxpipe.runtime.workers import Workers
from fxpipe.runtime.schedules import Phase, gpipe, one_f_one_b
from fxpipe.runtime.wiring import Wiring
from fxpipe.passes.codegen import split_stages
from fxpipe.passes.errors import StageError


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 2)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


def explode(x):
    raise RuntimeError("stage exploded")


torch.fx.wrap("explode")


class Exploding(Mlp):
    def forward(self, x):
        return self.c(explode(self.b(torch.relu(self.a(x)))))


def split(model, num_stages):
    """`model` traced and cut into `num_stages` stages of consecutive nodes, all on the CPU."""
    gm = fx.symbolic_trace(model)
    nodes = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    stage_of = {name: i * num_stages // len(nodes) for i, name in enumerate(nodes)}
    return split_stages(gm, stage_of, ["cpu"] * num_stages)


def stage_threads():
    return {t for t in threading.enumerate() if t.name.startswith("fxpipe-stage")}


def test_the_executor_runs_a_forward_then_its_backward_as_autograd_does_on_the_stage():
    torch.manual_seed(0)
    first, second = split(Mlp(), 2)
    (sent,) = first.module.forward(torch.randn(3, 4))   # attached to stage 0's parameters
    (name,) = second.inputs
    executor = StageExecutor(second, from_stages=[name], backward_for=[0])
    threads = threading.active_count()

    out = executor.forward(0, {name: sent})
    (out_name,) = second.outputs
    grad = torch.randn_like(out[out_name])
    input_grads = executor.backward(0, [{out_name: [grad]}])

    assert threading.active_count() == threads
    leaf = sent.detach().requires_grad_(True)
    (expected_out,) = second.module.forward(leaf)
    params = list(second.module.parameters())
    expected = torch.autograd.grad(expected_out, [leaf, *params], grad)
    assert torch.equal(out[out_name], expected_out)
    torch.testing.assert_close(input_grads[name][0], expected[0])
    for param, expected_grad in zip(params, expected[1:]):
        torch.testing.assert_close(param.grad, expected_grad)
    # autograd was cut at the boundary: nothing reached the sender's parameters
    assert all(p.grad is None for p in first.module.parameters())


def test_the_executor_starts_the_backward_from_the_loss_on_the_stage_that_computes_it():
    torch.manual_seed(0)
    (stage,) = split(Mlp(), 1)
    x = torch.randn(5, 4)
    executor = StageExecutor(stage, backward_for=[0],
                             loss_of=lambda m, values: values[stage.outputs[0]].square().mean())

    executor.forward(0, {stage.inputs[0]: x})
    assert executor.backward(0, []) == {}

    params = list(stage.module.parameters())
    (out,) = stage.module.forward(x)
    expected = torch.autograd.grad(out.square().mean(), params)
    assert torch.equal(executor.losses[0], out.square().mean().detach())
    for param, expected_grad in zip(params, expected):
        torch.testing.assert_close(param.grad, expected_grad)


def test_without_a_backward_to_come_the_executor_leaves_values_attached():
    torch.manual_seed(0)
    first, second = split(Mlp(), 2)
    (sent,) = first.module.forward(torch.randn(3, 4))
    executor = StageExecutor(second, from_stages=second.inputs)

    (out,) = executor.forward(0, {second.inputs[0]: sent}).values()
    out.sum().backward()

    assert all(p.grad is not None for p in first.module.parameters())


def test_the_thread_transport_keeps_order_and_wakes_a_waiting_receiver_on_abort():
    stopping = threading.Event()
    transport = ThreadTransport([(Phase.FORWARD, 0, 1)], {0: None, 1: None}, stopping)
    for m in range(3):
        transport.send(Phase.FORWARD, 0, 1, m, {"x": m})
    received = [transport.receive(Phase.FORWARD, 0, 1, m) for m in range(3)]
    assert received == [{"x": m} for m in range(3)]
    raised = []

    def wait():
        try:
            transport.receive(Phase.FORWARD, 0, 1, 3)
        except Aborted as e:
            raised.append(e)

    waiting = threading.Thread(target=wait)
    waiting.start()
    stopping.set()
    transport.abort()
    waiting.join(5)
    assert not waiting.is_alive() and len(raised) == 1


@pytest.mark.parametrize("training", [False, True])
def test_the_orchestrator_parks_its_workers_when_a_stage_raises(training):
    stages = split(Exploding(), 3)
    failing = next(s.index for s in stages if "explode" in s.module.code)
    runtime = Runtime(stages, Wiring.of(stages, list(stages[-1].outputs)))
    chunks = 4
    timetable = one_f_one_b(3, chunks) if training else gpipe(3, chunks)
    inputs = [{"x": torch.randn(2, 4)} for _ in range(chunks)]
    loss_of = (lambda m, values: values[stages[-1].outputs[0]].sum()) if training else None
    before = stage_threads()

    for _ in range(2):      # the second run on the same workers, which the first left at rest
        with pytest.raises(StageError, match=rf"stage {failing} .*micro-batch 0[\s\S]*exploded") as info:
            runtime.run(timetable, inputs, loss_of=loss_of)
        assert stage_threads() - before == set(runtime.workers.threads)
        assert runtime.workers._lock.acquire(blocking=False)     # no job holds them
        runtime.workers._lock.release()
        assert info.value.stage == failing and info.value.microbatch == 0
        assert runtime.last_run.failed and "stage exploded" in runtime.last_run.error
    runtime.close()
    assert stage_threads() == before


def test_the_workers_abort_and_wait_for_their_jobs_when_the_callers_block_raises():
    stop, ran = threading.Event(), []
    workers = Workers([lambda: None] * 3)
    before = threading.enumerate()

    def work(index):
        ran.append(threading.current_thread())
        stop.wait()

    with pytest.raises(KeyError):
        with workers.run(work, lambda error: stop.set()):
            raise KeyError("the driver failed")

    assert stop.is_set() and len(ran) == 3 and set(ran) == set(workers.threads)
    assert all(t.is_alive() for t in workers.threads)       # parked, not ended
    workers.close()
    assert threading.enumerate() == before


def test_a_lanes_outputs_never_wait_behind_another_lanes_step():
    """Lane B, waiting for step 1, receives step 0's outputs on its way and hands them over at
    once: lane A has them while step 1 is still in the last stage, which holds step 1 until
    lane A has them. A receiver that kept step 0's outputs until its own came would hold it
    there until the timeout."""
    import time
    from fxpipe.runtime.lanes import LaneSteps
    mlp = Mlp()
    stages = split(mlp, 2)
    runtime = Runtime(stages, Wiring.of(stages, list(stages[-1].outputs)))
    forward, calls, a_has_its, held = stages[1].module.forward, [0], threading.Event(), []

    def last_stage(*args):
        calls[0] += 1
        if calls[0] == 2:                 # step 1
            held.append(a_has_its.wait(20))
        return forward(*args)
    stages[1].module.forward = last_stage
    x = [torch.randn(2, 4) for _ in range(2)]
    got = {}
    try:
        with LaneSteps(runtime) as steps:
            first, second = steps.feed({"x": x[0]}), steps.feed({"x": x[1]})
            lane_b = threading.Thread(target=lambda: got.update(b=steps.outputs(second)))
            lane_b.start()
            deadline = time.monotonic() + 20
            while steps._received < 1 and time.monotonic() < deadline:   # B took step 0's
                time.sleep(0.001)
            got["a"] = steps.outputs(first)
            a_has_its.set()
            lane_b.join()
    finally:
        runtime.close()
    assert held == [True]
    (out,) = stages[-1].outputs
    with torch.no_grad():
        torch.testing.assert_close(got["a"][out], mlp(x[0]))
        torch.testing.assert_close(got["b"][out], mlp(x[1]))
