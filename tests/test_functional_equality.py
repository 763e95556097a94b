"""In-place writes as the user's model spells them: the pipeline computes what the model does, or
compile refuses by name; and errors that show their numbers."""

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding, grads_of
from fxpipe.passes.functionalize import functionalize


# --- memory errors show their numbers ------------------------------------------------------------

def chain_of_linears(depth=4, width=16):
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def test_a_node_too_big_for_a_tiny_device_reads_in_bytes_it_can_show():
    devices = [fxpipe.DeviceSpec("cpu", memory_bytes=2000)] * 2     # 1000 bytes per stage
    with pytest.raises(fxpipe.PartitionError,
                       match=r"node '_0' alone needs \d\.\d KB; no device has more than "
                             r"1\.0 KB"):
        fxpipe.compile(chain_of_linears().eval(), devices, (torch.randn(8, 16),))


def test_stages_too_big_for_tiny_devices_read_in_kilobytes():
    devices = [fxpipe.DeviceSpec("cpu", memory_bytes=5000)] * 2     # 2500 bytes per stage
    with pytest.raises(fxpipe.PartitionError,
                       match=r"stage \d on cpu needs \d\.\d KB but has 2\.5 KB.*; with "
                             r"\d\.\d KB on each of the 2 devices a partition fits"):
        fxpipe.compile(chain_of_linears().eval(), devices, (torch.randn(8, 16),))


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
    assert_same_up_to_rounding(pipe(x), model(x))
    assert len(pipe.stages) == 2


def test_functionalize_leaves_the_graphs_argument_lists_as_they_were():
    gm = fx.symbolic_trace(WindowedModel())
    functionalize(gm, (torch.randn(6, 3, 4),))
    (call,) = [n for n in gm.graph.nodes if n.target is fit_window]
    assert call.args[1] == [8, 8]


# --- item 5: in-place writes to an input are refused by name --------------------------------------

class DoublesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


def fx_graph(model):
    tracer = fx.Tracer()
    tracer.record_stack_traces = True
    return fx.GraphModule(model, tracer.trace(model))


def export_graph(model, x):
    return torch.export.export(model, (x.clone(),), strict=False).module()


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_functionalize_refuses_a_write_on_an_input_naming_it_its_line_and_the_fix(front_end):
    x = torch.randn(8, 4)
    given = x.clone()
    model = DoublesItsInput()
    gm = fx_graph(model) if front_end == "fx" else export_graph(model, x)
    with pytest.raises(fxpipe.TraceError,
                       match=r"forward writes in place on its input 'x'(.|\n)*"
                             r"test_functional_equality\.py\", line \d+, in forward\n"
                             r"\s+x\.mul_\(2\)(.|\n)*"
                             r"`x = x\.mul\(\.\.\.\)` instead of `x\.mul_\(\.\.\.\)`"):
        functionalize(gm, (x,))
    torch.testing.assert_close(x, given, rtol=0, atol=0)


class ClampsItsInput(nn.Module):
    """Writes its input in place, and gives the same output when run twice on the same tensor."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x.clamp_(-1, 1)
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_compile_refuses_a_write_on_an_input_and_leaves_the_callers_tensor(capture):
    x = 3 * torch.randn(8, 4)
    given = x.clone()
    with pytest.raises(fxpipe.TraceError, match=r"forward writes in place on its input 'x'(.|\n)*"
                                                r"`x = x\.clamp\(\.\.\.\)` instead of"):
        fxpipe.compile(ClampsItsInput(), ["cpu"] * 2, (x,), chunks=2, capture=capture)
    torch.testing.assert_close(x, given, rtol=0, atol=0)


def test_an_in_place_relu_on_the_input_is_refused_with_the_fix():
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(8, 4)
    given = x.clone()
    with pytest.raises(fxpipe.TraceError, match=r"its input 'input'(.|\n)*pass inplace=False"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, capture="fx")
    torch.testing.assert_close(x, given, rtol=0, atol=0)


def test_compile_leaves_the_callers_random_state_as_it_found_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4)).train()
    x = torch.randn(8, 4)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    torch.testing.assert_close(torch.rand(3), expected)


# --- slice assignment into a fresh tensor (swin3d's attention mask under torch.export) ------------

class ShiftedWindowMask(nn.Module):
    """Builds a mask region by region, as swin3d does (`attn_mask[d, h, w] = count` after
    `new_zeros`), and writes a batch-shaped tensor through views (`g[:, 1, 2:4] = ...`,
    `g[..., 0] += 1`)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        h = self.a(x)
        mask = h.new_zeros(4, 6)
        count = 0
        for rows in ((0, 2), (2, 3), (3, None)):
            for cols in ((0, -3), (-3, -1), (-1, None)):
                mask[rows[0]:rows[1], cols[0]:cols[1]] = count
                count += 1
        g = torch.zeros_like(h)
        g[:, 1, 2:4] = h[:, 0, :2]
        g[..., 0] += 1
        return self.b(h + mask + g)


def test_slice_assignment_into_a_fresh_tensor_is_pipelined_with_export():
    torch.manual_seed(0)
    model, x = ShiftedWindowMask(), torch.randn(8, 4, 6)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, capture="export")
    assert len(pipe.stages) == 2
    expected = model(x)
    expected.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    out = pipe(x)
    assert_same_up_to_rounding(out, expected)
    out.square().sum().backward()
    assert_same_up_to_rounding(grads_of(model), grads, what="gradient")


class WritesThroughViews(nn.Module):
    def forward(self, x):
        g = x * 1
        row = g[:, 0]
        before = row * 1
        row.copy_(x[:, 1])                 # also writes g
        change = row - before
        g.select(1, 2).mul_(3)             # and again, through other views
        g.transpose(0, 1)[1].add_(2)
        g.permute(1, 0)[:, 3].sub_(1)
        g.unsqueeze(0).div_(2)
        return g + 1, change


@pytest.mark.parametrize("examples", [True, False], ids=["storage", "name"])
def test_a_write_through_a_view_reaches_every_later_reader_of_the_viewed_tensor(examples):
    x = torch.randn(5, 4)
    gm = torch.export.export(WritesThroughViews(), (x.clone(),), strict=False).module()
    functionalize(gm, (x,) if examples else None)
    assert not [n for n in gm.graph.nodes if "_." in str(n.target)]     # e.g. aten.mul_.Tensor
    torch.testing.assert_close(gm(x), WritesThroughViews()(x))
