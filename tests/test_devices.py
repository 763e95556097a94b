import math

import pytest
import torch

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.runtime.devices import measure_links, parse_devices
from fxpipe.passes.cost_model import DeviceSpec


def test_device_lists_parse_to_one_spec_per_stage():
    specs = parse_devices(["cpu", torch.device("cpu"), DeviceSpec("cpu", speed=2.0)])
    assert [(d.name, d.speed) for d in specs] == [("cpu", 1.0), ("cpu", 1.0), ("cpu", 2.0)]
    assert parse_devices("cpu") == [DeviceSpec("cpu")]


def test_a_hand_off_between_cpu_stages_is_measured():
    link = measure_links([DeviceSpec("cpu")] * 2, repeats=10)(DeviceSpec("cpu"), DeviceSpec("cpu"))
    assert 0 < link.latency_s < 0.01 and math.isinf(link.bytes_per_s)


def test_compile_can_measure_links_or_take_them_given():
    model, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).eval(), torch.randn(4, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, link="measure")
    assert_same_up_to_rounding(pipe(x), model(x))
    slow = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2,
                          link=lambda src, dst: fxpipe.Link(latency_s=1.0))
    assert slow.plan.partition.bottleneck_s > 1.0          # each stage sends or receives once
    with pytest.raises(fxpipe.FxpipeError, match="link='fast'"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), link="fast")


def test_a_device_spec_naming_no_device_is_refused():
    with pytest.raises(fxpipe.DeviceError, match="'gpu0' is not a device"):
        parse_devices([DeviceSpec("gpu0")])
