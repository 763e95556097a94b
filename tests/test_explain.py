"""explain() prices a moved cut by the plan's rules: its links and its Memory."""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from fxpipe.plans.explain import explain
from fxpipe.passes.cost_model import DeviceSpec, Memory, NodeCost

MS = 1e-3


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        return self.d(self.c(self.b(self.a(x))))


def costed_chain() -> fx.GraphModule:
    """x -> a -> b -> c -> d: 1 ms forward, 2 ms backward, 1000 parameter bytes, 100 bytes out
    and 100 saved per layer."""
    gm = fx.symbolic_trace(Chain())
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["cost"] = NodeCost(out_bytes=100)
        elif n.op == "call_module":
            n.meta["cost"] = NodeCost(fwd_s=1 * MS, bwd_s=2 * MS, out_bytes=100, param_bytes=1000,
                                      saved_bytes=100)
    return gm


HALVES = {"a": 0, "b": 0, "c": 1, "d": 1}


def test_a_moved_cut_that_does_not_fit_its_device_says_so():
    # Training without optimizer state: the last two layers hold 2 * 2000 bytes of weights and
    # gradients, 200 saved, 100 received and the 100-byte output until its backward, a
    # backward's 200 passing gradient bytes and a weight's 1000-byte gradient before it is
    # added in (5.6 KB); the last three 7.7 KB, which only stage 0's device has.
    devices = [DeviceSpec("cpu", memory_bytes=8000), DeviceSpec("cpu", memory_bytes=6000)]
    text = explain(costed_chain(), HALVES, devices, training=True,
                   memory=Memory(training=True, optimizer_state=0.0))
    earlier = next(line for line in text.splitlines() if "one node earlier" in line)
    assert earlier.endswith("does not fit: stage 1 needs 7.7 KB but cpu has 6.0 KB")
    assert text.count("does not fit") == 1     # the plan and the cut one node later fit


def test_a_stage_recomputing_pays_its_forward_again_in_explain():
    # Each half: 2 x (1 + 2) ms of compute, a 30 us hand-off in and one out; recomputing adds
    # its 2 ms of forward.
    devices = [DeviceSpec("cpu")] * 2
    kept = explain(costed_chain(), HALVES, devices, training=True,
                   memory=Memory(training=True))
    recomputing = explain(costed_chain(), HALVES, devices, training=True,
                          memory=Memory(training=True, recompute="always"))
    assert kept.startswith("bottleneck 6.060 ms")
    assert recomputing.startswith("bottleneck 8.060 ms")
