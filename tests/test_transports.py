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
from fxpipe.runtime.schedules import Phase

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


def _gloo_side(script, me, init, results, two_groups):
    import torch.distributed as dist

    from fxpipe.distributed import DistributedTransport
    dist.init_process_group("gloo", init_method=init, rank=me, world_size=2)
    # With two groups, headers go over the default one and tensors over another (as CUDA
    # stages send theirs over NCCL): every point-to-point op is recorded with its group.
    tensors = dist.new_group(backend="gloo") if two_groups else None
    ops = []
    for name in ("isend", "irecv", "recv"):
        op = getattr(dist, name)

        def recorded(t, *args, op=op, name=name, group=None, **kwargs):
            ops.append((name, t.dtype, "tensors" if group is tensors and two_groups else
                        "headers" if group is None else "other"))
            return op(t, *args, group=group, **kwargs)
        setattr(dist, name, recorded)
    transport = DistributedTransport(me, torch.device("cpu"), timeout=30, peers=[0, 1],
                                     tensor_group=tensors)
    got = []
    try:
        script(transport, me, got)
        transport.close()       # after an abort: take the peer's news, let every send go
    finally:
        got.append(("ops", ops))
        buffer = io.BytesIO()
        torch.save(got, buffer)
        results.put((me, buffer.getvalue()))
        dist.destroy_process_group()


def on_gloo(script, tmp_path, two_groups=False, ops=None):
    """`script` run by two gloo processes, each through its `DistributedTransport` (headers
    and tensors over one group, or over two with `two_groups`); the point-to-point ops each
    posted, (op, dtype, group), added to `ops` when given."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    processes = [context.Process(target=_gloo_side,
                                 args=(script, me, f"file://{tmp_path / 'init'}", results,
                                       two_groups))
                 for me in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [process.exitcode for process in processes] == [0, 0]
    got = dict(results.get() for _ in processes)
    sides = [torch.load(io.BytesIO(got[me]), weights_only=False) for me in (1, 0)]
    if ops is not None:
        ops.extend(op for side in sides for op in side[-1][1])
    return [item for side in sides for item in side[:-1]]


@pytest.fixture(params=["threads", "gloo", "gloo, two groups"])
def run_script(request, tmp_path):
    if request.param == "threads":
        return on_threads
    return lambda script: on_gloo(script, tmp_path, two_groups="two" in request.param)


def test_headers_and_tensors_travel_over_their_own_groups(tmp_path):
    """Headers (pickled bytes) over the header group; the values' tensors over the tensor
    group, as CUDA stages send theirs over NCCL while headers stay on gloo."""
    ops = []
    on_gloo(messages_in_order, tmp_path, two_groups=True, ops=ops)
    assert {group for _, dtype, group in ops if dtype == torch.uint8} == {"headers"}
    assert {group for _, dtype, group in ops if dtype != torch.uint8} == {"tensors"}
    assert {op for op, dtype, _ in ops if dtype != torch.uint8} == {"isend", "irecv"}


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
