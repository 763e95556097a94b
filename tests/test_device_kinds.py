"""A device kind is one file: this one adds a fake kind to `fxpipe.passes.device`'s registry,
and a pipeline plans and runs on it as on the model, through the kind's streams and events.

Torch makes no tensor on a device type it does not know, so the fake kind's devices ("fake:0",
"fake:1") hold CPU tensors: its devices are `cpu:100`, `cpu:101`, which it claims, so that every
decision on them is the fake kind's answer, not the CPU's. Its streams and events do nothing but
count their calls (the CPU's work is done when a call returns)."""

import collections
import contextlib
import time

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe import DeviceError
from fxpipe.passes import device as seam
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding

FIRST = 100     # fake:N is cpu:(FIRST + N); torch keeps a CPU index under 128


class FakeEvent:
    def __init__(self, calls):
        self.calls, self.at = calls, time.perf_counter()

    def synchronize(self):
        self.calls["event.synchronize"] += 1

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


class FakeStream:
    def __init__(self, device, calls):
        self.device, self.calls = device, calls

    def record_event(self, event=None):
        self.calls["stream.record_event"] += 1
        return event or FakeEvent(self.calls)


class Fake(seam.DeviceKind):
    """Two CPU-backed accelerators with streams: what a new kind (XPU, MPS) writes, in full."""

    name, streams = "fake", True

    def __init__(self):
        self.calls = collections.Counter()
        self.defaults = {}

    def claims(self, device):
        return device.type == "cpu" and device.index is not None and device.index >= FIRST

    def torch_device(self, name):
        _, _, index = name.partition(":")
        return torch.device("cpu", FIRST + int(index or 0))

    def count(self):
        return 2

    def number(self, device):
        return device.index - FIRST

    def started(self):
        return True

    def started_devices(self):
        return [torch.device("cpu", FIRST + i) for i in range(self.count())]

    def new_stream(self, device):
        self.calls["new_stream"] += 1
        return FakeStream(device, self.calls)

    def current_stream(self, device):
        self.calls["current_stream"] += 1
        return self.defaults.setdefault(device, FakeStream(device, self.calls))

    @contextlib.contextmanager
    def use_stream(self, stream):
        self.calls["use_stream"] += 1
        yield

    def wait_stream(self, waiting, waited):
        self.calls["wait_stream"] += 1

    def record_event(self, device):
        self.calls["record_event"] += 1
        return FakeEvent(self.calls)

    def timing_event(self, stream):
        self.calls["timing_event"] += 1
        return stream.record_event(FakeEvent(self.calls))

    def wait_event(self, device, event):
        self.calls["wait_event"] += 1

    def set_device(self, device):
        self.calls["set_device"] += 1

    def synchronize(self, device):
        self.calls["synchronize"] += 1

    def free_memory_bytes(self, device):
        return 1 << 40


@pytest.fixture
def fake():
    kind = seam.register(Fake())
    try:
        yield kind
    finally:
        seam.unregister("fake")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                                    nn.Linear(16, 4))

    def forward(self, x):
        return self.layers(x)


def test_the_fake_kind_answers_every_question_on_its_devices(fake):
    assert seam.kind_of("fake:1") is fake and seam.kind_of(torch.device("cpu", 101)) is fake
    assert seam.to_torch("fake:1") == torch.device("cpu", 101)
    assert seam.is_gpu("fake:0") and not seam.is_cpu("fake:0")
    assert seam.kind_of("cpu:1").host and not seam.same_memory("fake:0", "cpu")
    assert isinstance(seam.stream_for(seam.to_torch("fake:0")), FakeStream)
    assert seam.exists("fake:1") and not seam.exists("fake:2")


def test_a_pipeline_runs_on_the_fake_kind_as_the_model(fake):
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(16, 8)
    with torch.no_grad():
        expected = model(x)
    pipe = fxpipe.compile(model, ["fake:0", "fake:1"], example_inputs=(x,), chunks=4)
    assert [s.device for s in pipe.plan.stages] == [torch.device("cpu", 100),
                                                    torch.device("cpu", 101)]
    fake.calls.clear()
    with torch.no_grad():
        assert_same_up_to_rounding(pipe(x), expected)
    # each stage ran on its own stream, its work timed and handed on by the kind's events
    assert fake.calls["use_stream"] >= 2 and fake.calls["timing_event"] >= 2 * 4
    assert fake.calls["record_event"] >= 4 and fake.calls["wait_event"] >= 4
    assert fake.calls["wait_stream"] >= 2


def test_a_pipeline_trains_on_the_fake_kind_as_the_model(fake):
    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    x, target = torch.randn(16, 8), torch.randn(16, 4)
    mse = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    pipe = fxpipe.compile(model, ["fake:0", "fake:1"], example_inputs=(x,), chunks=4)
    fake.calls.clear()
    loss = pipe.train_step((x,), target, mse)
    expected = mse(reference(x), target)
    expected.backward()
    assert_same_training(pipe, reference, loss=(loss, expected))
    assert fake.calls["use_stream"] >= 2 and fake.calls["wait_event"] >= 8


def test_a_fake_device_that_does_not_exist_is_refused(fake):
    with pytest.raises(DeviceError, match="'fake:2' does not exist on this machine "
                                          r"\(2 FAKE devices: fake:0..fake:1\)"):
        fxpipe.compile(Net(), ["fake:0", "fake:2"], example_inputs=(torch.randn(4, 8),))


def test_without_the_kind_a_fake_device_is_no_device():
    with pytest.raises(DeviceError, match="'fake:0' is not a device"):
        fxpipe.compile(Net(), ["fake:0"], example_inputs=(torch.randn(4, 8),))
