"""One suite for every `Transport`: `ThreadTransport` (two threads of this process) and
`DistributedTransport` (two gloo processes). Participant 0 and participant 1 each run one side
of a script; what the receiving side got is compared with what was sent.
"""

import io
import queue
import threading

import pytest
import torch
import torch.multiprocessing as mp

from fxpipe.runtime import Aborted, ThreadTransport
from fxpipe.schedules import Phase

MICROBATCHES = 3


def messages_in_order(transport, me, got):
    """Two steps: 0 sends each micro-batch forward, 1 sends gradients back in reverse; each
    side receives in the order its link delivers them. The step's end readies the next."""
    for step in range(2):
        for m in range(MICROBATCHES):
            if me == 0:
                transport.send(Phase.FORWARD, 0, 1, m, {"x": torch.full((2,), 10.0 * step + m),
                                                        "pair": [torch.ones(1) * m, None]})
            else:
                got.append(("forward", step, m, transport.receive(Phase.FORWARD, 0, 1, m)))
        for m in reversed(range(MICROBATCHES)):
            if me == 1:
                transport.send(Phase.BACKWARD, 1, 0, m, {"g": torch.tensor([-1.0 * m])})
            else:
                got.append(("backward", step, m, transport.receive(Phase.BACKWARD, 1, 0, m)))
        transport.finish_step()


def an_abort_names_its_reason(transport, me, got):
    """0 sends one message, then aborts with a reason; 1 takes the message, and its next
    receive raises `Aborted` carrying the reason (1 then aborts in turn)."""
    if me == 0:
        transport.send(Phase.FORWARD, 0, 1, 0, {"x": torch.ones(2)})
        transport.abort("stage 0 failed: on purpose")
    else:
        got.append(("forward", 0, 0, transport.receive(Phase.FORWARD, 0, 1, 0)))
        with pytest.raises(Aborted) as raised:
            transport.receive(Phase.FORWARD, 0, 1, 1)
        got.append(("aborted", str(raised.value)))
        transport.abort(str(raised.value))      # as a runtime does: every peer is told


def on_threads(script):
    """`script` run by two threads through one `ThreadTransport`; what participant 1 and then
    participant 0 got."""
    stopping = threading.Event()
    transport = ThreadTransport([(Phase.FORWARD, 0, 1), (Phase.BACKWARD, 1, 0)],
                                {0: torch.device("cpu"), 1: torch.device("cpu")}, stopping)
    got = {0: [], 1: []}
    failures = []

    def side(me):
        try:
            script(transport, me, got[me])
        except BaseException as e:      # reported by the test's thread
            failures.append(e)
            stopping.set()
    threads = [threading.Thread(target=side, args=(me,)) for me in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads) and not failures, failures
    return got[1] + got[0]


def _gloo_side(script, me, init, results):
    import torch.distributed as dist

    from fxpipe.distributed import DistributedTransport
    dist.init_process_group("gloo", init_method=init, rank=me, world_size=2)
    transport = DistributedTransport(me, torch.device("cpu"), timeout=30, peers=[0, 1])
    got = []
    try:
        script(transport, me, got)
        transport.close()       # after an abort: take the peer's news, let every send go
    finally:
        buffer = io.BytesIO()
        torch.save(got, buffer)
        results.put((me, buffer.getvalue()))
        dist.destroy_process_group()


def on_gloo(script, tmp_path):
    """`script` run by two gloo processes, each through its `DistributedTransport`."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    processes = [context.Process(target=_gloo_side,
                                 args=(script, me, f"file://{tmp_path / 'init'}", results))
                 for me in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [process.exitcode for process in processes] == [0, 0]
    got = dict(results.get() for _ in processes)
    return [*torch.load(io.BytesIO(got[1]), weights_only=False),
            *torch.load(io.BytesIO(got[0]), weights_only=False)]


@pytest.fixture(params=["threads", "gloo"])
def run_script(request, tmp_path):
    if request.param == "threads":
        return on_threads
    return lambda script: on_gloo(script, tmp_path)


def test_messages_arrive_in_order_per_link_across_two_steps(run_script):
    got = run_script(messages_in_order)
    forwards = [(step, m, values) for kind, step, m, values in got if kind == "forward"]
    backwards = [(step, m, values) for kind, step, m, values in got if kind == "backward"]
    assert [(step, m) for step, m, _ in forwards] == [(s, m) for s in range(2)
                                                      for m in range(MICROBATCHES)]
    assert [(step, m) for step, m, _ in backwards] == [(s, m) for s in range(2)
                                                       for m in reversed(range(MICROBATCHES))]
    for step, m, values in forwards:
        torch.testing.assert_close(values, {"x": torch.full((2,), 10.0 * step + m),
                                            "pair": [torch.ones(1) * m, None]})
    for step, m, values in backwards:
        torch.testing.assert_close(values, {"g": torch.tensor([-1.0 * m])})


def test_an_abort_reaches_the_receiver_with_its_reason(run_script):
    got = run_script(an_abort_names_its_reason)
    torch.testing.assert_close(got[0][3], {"x": torch.ones(2)})
    assert got[1][0] == "aborted" and "stage 0 failed: on purpose" in got[1][1]
