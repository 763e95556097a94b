"""Inputs, hooks and side effects: the pipeline equals the model, or compile or the call says why.

Issue 14's items 3 (export-captured non-tensor inputs) and 11 (hooks and Python side effects in
forward), and `batch_dims` with torch.export.
"""

import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fxpipe
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding
from fxpipe.passes.capture import trace


# ---- item 3: non-tensor inputs of an exported graph --------------------------------------

class Options(nn.Module):
    """A forward whose Python-level options change what it computes."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.body = nn.Linear(8, 8)

    def forward(self, x, flag: bool, steps: int = 2, temperature: float = 1.0):
        h = self.inp(x)
        if flag:
            h = h.relu()
        for _ in range(steps):
            h = self.body(h).tanh()
        return h / temperature


@pytest.fixture(scope="module")
def options_pipe():
    torch.manual_seed(0)
    model = Options().eval()
    pipe = fxpipe.compile(model, ["cpu"] * 2, example_inputs=(torch.randn(8, 8), True),
                          example_kwargs={"steps": 3, "temperature": 0.5}, capture="export",
                          chunks=2)
    return model, pipe


def test_export_runs_the_captured_values(options_pipe):
    model, pipe = options_pipe
    x = torch.randn(8, 8)
    assert_same_up_to_rounding(pipe(x, True, steps=3, temperature=0.5),
                               model(x, True, steps=3, temperature=0.5))


@pytest.mark.parametrize("args, kwargs, name, shown", [
    ((False,), {"steps": 3, "temperature": 0.5}, "flag", "False"),
    ((1,), {"steps": 3, "temperature": 0.5}, "flag", "1"),
    ((True,), {"steps": 1, "temperature": 0.5}, "steps", "1"),
    ((True,), {"steps": 3, "temperature": 2.0}, "temperature", "2.0"),
    ((torch.tensor(True),), {"steps": 3, "temperature": 0.5}, "flag", "a tensor of shape ()"),
])
def test_export_refuses_another_non_tensor_input(options_pipe, args, kwargs, name, shown):
    _, pipe = options_pipe
    captured = {"flag": True, "steps": 3, "temperature": 0.5}[name]
    with pytest.raises(fxpipe.InputError,
                       match=rf"input '{name}' is {re.escape(shown)}; the graph was exported with "
                             rf"{captured!r}\n.*\({name}={captured!r}\)[\s\S]*one pipeline per "
                             rf"value"):
        pipe(torch.randn(8, 8), *args, **kwargs)


# ---- batch_dims with torch.export --------------------------------------------------------

class TimeFirst(nn.Module):
    """Inputs shaped (time, batch, features): a running sum over time, batch along dimension 1."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.inp(x).tanh().cumsum(0))


def test_export_frees_the_batch_dimension_given():
    torch.manual_seed(0)
    model = TimeFirst().eval()
    x = torch.randn(5, 8, 6)
    pipe = fxpipe.compile(model, ["cpu"] * 2, example_inputs=(x,), capture="export",
                          batch_dims=1, chunks=4)
    assert_same_up_to_rounding(pipe(x), model(x))
    y = torch.randn(5, 12, 6)           # another batch size, split along dimension 1 too
    assert_same_up_to_rounding(pipe(y), model(y))


# ---- item 11: hooks and Python side effects ----------------------------------------------

class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(self.up(x).relu())


class Tower(nn.Module):
    def __init__(self, width=8, depth=4):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


def test_forward_hook_on_a_composite_module_fires_per_microbatch():
    torch.manual_seed(0)
    model = Tower().eval()
    calls = []

    def scale(module, inputs, output):
        calls.append(inputs[0].shape[0])
        return output * 0.5

    model.blocks[1].register_forward_hook(scale)
    x = torch.randn(16, 8)
    expected = model(x)
    pipe = fxpipe.compile(model, ["cpu"] * 2, example_inputs=(x,), chunks=4)
    assert "blocks.1" in pipe.plan.capture.leaves
    calls.clear()
    assert_same_up_to_rounding(pipe(x), expected)
    assert calls == [4, 4, 4, 4]


def test_backward_hook_on_a_composite_module_fires_per_microbatch():
    torch.manual_seed(0)
    model = Tower()
    seen = []
    model.blocks[2].register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(1))
    x = torch.randn(16, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 2, example_inputs=(x,), chunks=4)
    reference = Tower()
    reference.load_state_dict(model.state_dict())
    reference(x).square().sum().backward()
    seen.clear()
    pipe(x).square().sum().backward()
    assert len(seen) == 4
    assert_same_training(model, reference)


def test_export_refuses_hooked_modules():
    model = Tower().eval()
    model.blocks[1].register_forward_pre_hook(lambda m, inputs: None)
    with pytest.raises(fxpipe.TraceError,
                       match=r"module 'blocks.1' has a forward pre-hook\n.*Fix: capture with fx"):
        fxpipe.compile(model, ["cpu"] * 2, example_inputs=(torch.randn(8, 8),),
                       capture="export")


def test_hook_on_the_model_itself_is_refused():
    model = Tower().eval()
    model.register_forward_hook(lambda m, inputs, output: output * 2)
    with pytest.raises(fxpipe.TraceError, match=r"Tower\) has a forward hook[\s\S]*"
                                                r"pipe.register_forward_hook"):
        fxpipe.compile(model, ["cpu"] * 2, example_inputs=(torch.randn(8, 8),))


def test_global_module_hooks_do_not_break_compile():
    torch.manual_seed(0)
    model = Tower().eval()
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, inputs, output: calls.append(type(m).__name__))
    try:
        x = torch.randn(16, 8)
        pipe = fxpipe.compile(model, ["cpu"] * 2, example_inputs=(x,), chunks=4)
        assert_same_up_to_rounding(pipe(x), model(x))
    finally:
        handle.remove()
    assert "Linear" in calls


# ---- hooks registered after compile -----------------------------------------------------

def register(module, kind, calls):
    """A hook of `kind` on `module` that records each call (the rows it saw, for forward ones)."""
    if kind == "forward hook":
        return module.register_forward_hook(lambda m, inputs, out: calls.append(len(inputs[0])))
    if kind == "forward pre-hook":
        return module.register_forward_pre_hook(lambda m, inputs: calls.append(len(inputs[0])))
    if kind == "backward hook":
        return module.register_full_backward_hook(lambda m, gin, gout: calls.append(len(gout[0])))
    return module.register_full_backward_pre_hook(lambda m, gout: calls.append(len(gout[0])))


HOOK_KINDS = ["forward hook", "forward pre-hook", "backward hook", "backward pre-hook"]
CALLS = {
    "call": lambda pipe, x: pipe(x).square().sum().backward(),
    "train_step": lambda pipe, x: pipe.train_step(x, torch.randn(len(x), 2), F.mse_loss),
    "stream": lambda pipe, x: list(pipe.stream(x.split(4))),
}


@pytest.fixture(scope="module")
def tower_pipe():
    torch.manual_seed(0)
    model = Tower()
    return model, fxpipe.compile(model, ["cpu"] * 2, example_inputs=(torch.randn(16, 8),),
                                 chunks=4)


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("kind", HOOK_KINDS)
def test_a_hook_added_after_compile_to_a_module_traced_through_is_refused(tower_pipe, kind, call):
    model, pipe = tower_pipe
    assert "blocks.2" not in pipe.plan.capture.leaves        # fx traced through it
    calls = []
    handle = register(model.blocks[2], kind, calls)
    try:
        with pytest.raises(fxpipe.ModelChangedError,
                           match=rf"module 'blocks.2' \(Block\) got a {kind} after compile\n.*"
                                 rf"never fire. Compile the model again"):
            CALLS[call](pipe, torch.randn(16, 8))
    finally:
        handle.remove()
    assert calls == []
    CALLS[call](pipe, torch.randn(16, 8))        # without the hook it runs again


@pytest.mark.parametrize("kind", HOOK_KINDS)
def test_compiled_again_a_hook_added_after_compile_fires_per_microbatch(kind):
    torch.manual_seed(0)
    model, x = Tower(), torch.randn(16, 8)
    calls = []
    register(model.blocks[2], kind, calls)
    pipe = fxpipe.compile(model, ["cpu"] * 2, example_inputs=(x,), chunks=4)
    calls.clear()
    pipe.train_step(x, torch.randn(16, 2), F.mse_loss)
    assert calls == [4, 4, 4, 4]


@pytest.mark.parametrize("kind", HOOK_KINDS)
def test_a_hook_added_after_compile_to_a_leaf_module_fires_per_microbatch(tower_pipe, kind):
    model, pipe = tower_pipe
    calls = []
    handle = register(model.blocks[2].up, kind, calls)    # a call_module node of a stage
    try:
        pipe(torch.randn(16, 8)).square().sum().backward()
        assert calls == [4, 4, 4, 4]
        calls.clear()
        list(pipe.stream(torch.randn(16, 8).split(8)))
        assert calls == ([8, 8] if kind.startswith("forward") else [])
    finally:
        handle.remove()


def test_a_hook_added_after_compile_to_the_model_itself_is_refused(tower_pipe):
    model, pipe = tower_pipe
    handle = model.register_forward_hook(lambda m, inputs, output: output * 2)
    try:
        with pytest.raises(fxpipe.ModelChangedError, match=r"the model \(Tower\) got a forward "
                                                           r"hook after compile\n.*on the pipeline"):
            pipe.train_step(torch.randn(16, 8), torch.randn(16, 2), F.mse_loss)
    finally:
        handle.remove()


def test_a_hook_added_after_compile_to_an_exported_models_module_is_refused():
    model, x = Tower().eval(), torch.randn(16, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 2, example_inputs=(x,), chunks=4, capture="export")
    model.head.register_forward_hook(lambda m, inputs, output: output * 2)
    with pytest.raises(fxpipe.ModelChangedError, match=r"module 'head' \(Linear\) got a forward"):
        pipe(x)


def test_a_global_module_hook_added_after_compile_sees_the_modules_the_stages_call(tower_pipe):
    model, pipe = tower_pipe
    x, seen = torch.randn(16, 8), []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, inputs, output: seen.append(m))
    try:
        out = pipe(x)
    finally:
        handle.remove()
    assert_same_up_to_rounding(out, model(x))
    leaves = [m for m in model.modules() if not list(m.children())]   # each micro-batch's
    assert sorted(map(id, seen)) == sorted([id(pipe)] + [id(m) for m in leaves for _ in range(4)])


class Recorder(nn.Module):
    """Keeps every input it sees: a Python side effect in forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen = []

    def forward(self, x):
        self.seen.append(x)
        return self.lin(x)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


@pytest.mark.filterwarnings("ignore:The tensor attribute")   # export's, about the append
@pytest.mark.parametrize("capture", ["auto", "fx", "export"])
def test_a_list_appended_in_forward_is_refused_and_left_as_it_was(capture):
    model = nn.Sequential(nn.Linear(8, 8), Recorder())
    with pytest.raises(fxpipe.TraceError,
                       match=r"module '1' \(Recorder\)'s attribute 'seen'.*\n.*\n.*"
                             r"self\.seen\.append\(x\)\n.*Fix: move it out of forward"):
        fxpipe.compile(model, ["cpu"] * 2, example_inputs=(torch.randn(8, 8),), capture=capture)
    assert model[1].seen == []


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_counter_incremented_in_forward_is_refused_and_left_as_it_was(capture):
    model = Counter()
    with pytest.raises(fxpipe.TraceError, match=r"Counter's attribute 'calls'[\s\S]*"
                                                r"self\.calls \+= 1"):
        fxpipe.compile(model, ["cpu"] * 2, example_inputs=(torch.randn(8, 8),), capture=capture)
    assert model.calls == 0
    assert "calls" in vars(model) and set(vars(model)) == set(vars(Counter()))


class LazySetting(nn.Module):
    """Caches a setting on its first call, whatever the input: not refused, and undone."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if not hasattr(self, "kernel"):
            self.kernel = "default"
        return self.lin(x)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_setting_cached_in_forward_is_undone_after_capture(capture):
    torch.manual_seed(0)
    model = LazySetting().eval()
    x = torch.randn(8, 8)
    gm = trace(model, (x,), capture=capture)
    assert "kernel" not in vars(model)
    torch.testing.assert_close(gm(x), model(x))
