"""Repeated blocks and estimates measured on a GPU: repeats take their first block's GPU times,
a node without a CUDA kernel or over the byte limit is estimated, its stand-in on the GPU.

Skipped without CUDA. The model is built on the CPU and measured on a copy placed on the GPU.
"""

import pytest
import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.annotate_costs import annotate_costs
from fxpipe.passes.blocks import block_of
from fxpipe.passes.capture import trace

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Stack(nn.Module):
    def __init__(self, hiddens=(256, 256, 256)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, h), nn.GELU(), nn.Linear(h, 64))
                                    for h in hiddens)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_repeats_take_the_first_blocks_gpu_times_and_the_model_stays(capture):
    model, x = Stack(), torch.randn(32, 64)
    gm = annotate_costs(trace(model, (x,), capture=capture), (x,), device="cuda:0",
                        repeats=3, backward=True)
    nodes = {n.name: n for n in gm.graph.nodes}
    reused = [n for n in gm.graph.nodes if "cost" in n.meta and n.meta["cost"].source == "reused"]
    assert {block_of(n) for n in reused} == {"layers.1", "layers.2"}
    for n in reused:
        first = nodes[n.meta["cost"].reused_from].meta["cost"]
        assert (n.meta["cost"].fwd_s, n.meta["cost"].bwd_s) == (first.fwd_s, first.bwd_s)
    assert all(t.device.type == "cpu" for t in model.parameters())


@torch.library.custom_op("fxpipe_test::cpu_only", mutates_args=(), device_types="cpu")
def cpu_only(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@cpu_only.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_node_without_a_cuda_kernel_is_estimated_and_its_readers_run_on_the_gpu():
    def f(x):
        return torch.relu(cpu_only(x @ x.T))
    gm = annotate_costs(fx.symbolic_trace(f), (torch.randn(64, 64),), device="cuda:0",
                        repeats=2)
    costs = {n.name: n.meta["cost"] for n in gm.graph.nodes if n.op != "output"}
    assert costs["cpu_only_default"].source == "estimated" and costs["cpu_only_default"].fwd_s > 0
    assert costs["relu"].source == costs["matmul"].source == "measured"


def test_a_weight_over_the_limit_is_estimated_on_the_gpu():
    model, x = Stack(hiddens=(64, 1024, 64)), torch.randn(32, 64)
    gm = annotate_costs(trace(model, (x,), capture="fx"), (x,), device="cuda:0", repeats=2,
                        max_node_bytes=64 * 512 * 4)
    estimated = {n.name for n in gm.graph.nodes
                 if "cost" in n.meta and n.meta["cost"].source == "estimated"}
    assert estimated == {"layers_1_0", "layers_1_2"}
