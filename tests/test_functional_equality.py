"""In-place writes as the user's model spells them: the pipeline computes what the model does, or
compile refuses by name; and errors that show their numbers."""

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxpipe
from passes.functionalize import functionalize


# --- memory errors show their numbers ------------------------------------------------------------

def chain_of_linears(depth=4, width=16):
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def test_a_node_too_big_for_a_tiny_device_reads_in_bytes_it_can_show():
    devices = [fxpipe.DeviceSpec("cpu", memory_bytes=1000)] * 2
    with pytest.raises(fxpipe.PartitionError,
                       match=r"node '_0' alone needs 1\.\d KB, more than any device has "
                             r"\(at most 1\.0 KB\)"):
        fxpipe.compile(chain_of_linears(), devices, (torch.randn(8, 16),))


def test_stages_too_big_for_tiny_devices_read_in_kilobytes():
    devices = [fxpipe.DeviceSpec("cpu", memory_bytes=2000)] * 2
    with pytest.raises(fxpipe.PartitionError,
                       match=r"needs \d+\.\d KB in all \(4\.0 KB available\): stage 0 on cpu "
                             r"needs \d\.\d KB but has 2\.0 KB"):
        fxpipe.compile(chain_of_linears(), devices, (torch.randn(8, 16),))


# --- a function that edits a list it is given ('immutable_list' object does not support mutation) -

def fit_window(h, window: list):
    """Like torchvision's `shifted_window_attention_3d`: shrinks `window` to the input's size, in
    place on the list it was given."""
    for i in range(2):
        if h.shape[i + 1] <= window[i]:
            window[i] = h.shape[i + 1]
    return h * window[0] + window[1]


torch.fx.wrap("fit_window")


class WindowedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(fit_window(self.a(x), [8, 8]))


def test_a_function_that_edits_its_list_argument_is_pipelined():
    torch.manual_seed(0)
    model, x = WindowedModel(), torch.randn(6, 3, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, capture="fx")
    torch.testing.assert_close(pipe(x), model(x))
    assert len(pipe.stages) == 2


def test_functionalize_leaves_the_graphs_argument_lists_as_they_were():
    gm = fx.symbolic_trace(WindowedModel())
    functionalize(gm, (torch.randn(6, 3, 4),))
    (call,) = [n for n in gm.graph.nodes if n.target is fit_window]
    assert call.args[1] == [8, 8]
