"""`measure_link`: what one message between two gloo ranks on this host costs, measured as
`DistributedTransport` sends it: the link a plan for torchrun is priced with (`link="gloo"`).
The links between devices of one process are `fxpipe.runtime.devices.measure_links`'.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from fxpipe.passes.cost_model import Link

from ..runtime.devices import fitted_link


def measure_link(*, repeats: int = 20, timeout: float = 60.0) -> Link:
    """What one message between two ranks on this host costs, sent as `fxpipe.distributed`
    sends it (a `DistributedTransport`'s message: its header, then its tensor, over gloo): latency
    and bandwidth from ping-pongs of 64 KB and 16 MB messages between two processes started
    here (a few seconds). Plan with it so the plan prices values as they will travel:

        link = fxpipe.distributed.measure_link()
        fxpipe.plan(model, ["cpu"] * 4, (x,), link=lambda src, dst: link).save("plan/")
    """
    import tempfile

    import torch.multiprocessing as mp

    from .transport import DistributedError
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{os.path.join(folder, 'rendezvous')}"
        processes = [context.Process(target=_ping_pong, args=(rank, init, repeats, timeout,
                                                               results), daemon=True)
                     for rank in range(2)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout + 30)
        codes = [process.exitcode for process in processes]
        if codes != [0, 0] or results.empty():
            for process in processes:
                process.kill()
            raise DistributedError(f"measuring a gloo link between two processes failed (exit "
                                   f"codes {codes})\nits two processes are spawned, so they "
                                   f"import the caller's script: run the code that plans under "
                                   f"`if __name__ == \"__main__\":`, and check that this host "
                                   f"allows local gloo")
    return fitted_link(results.get())


def _ping_pong(rank: int, init: str, repeats: int, timeout: float, results: Any) -> None:
    """One of `measure_link`'s two processes: the median one-way time of a message, by size,
    each going from one stage to the other through a `DistributedTransport`."""
    import datetime

    import torch.distributed as dist

    from .transport import DistributedTransport
    from ..runtime.schedules import Phase
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout))
    transport = DistributedTransport(rank, torch.device("cpu"), timeout=timeout, peers=[0, 1])
    try:
        one_way = {}
        for nbytes in (64 << 10, 16 << 20):
            x = torch.zeros(nbytes // 4)
            times = []
            for m in range(repeats + 1):        # the first one warms up
                start = time.perf_counter()
                for phase, sender in ((Phase.FORWARD, 0), (Phase.BACKWARD, 1)):
                    if rank == sender:
                        transport.send(phase, sender, 1 - sender, m, {"x": x})
                    else:
                        transport.receive(phase, sender, 1 - sender, m)
                times.append((time.perf_counter() - start) / 2)
            transport.finish_step()
            one_way[nbytes] = statistics.median(times[1:])
        if rank == 0:
            results.put(one_way)
    finally:
        dist.destroy_process_group()
