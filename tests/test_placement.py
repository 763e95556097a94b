"""Placement: compile runs the model only before placing anything, never moves its tensors,
synchronises and times the device it measures, and shares a device's memory among its stages.

No GPU here: a second device is "meta" where only placement is looked at, and CUDA calls are
patched where what matters is which device they name.
"""

import copy
import math

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding
from fxpipe.runtime.devices import parse_devices, shared_memory, synchronize
from fxpipe.passes import codegen
from fxpipe.passes.annotate_costs import annotate_costs, start_timer
from fxpipe.passes.codegen import held_by_stages, place, split_stages
from fxpipe.passes.capture import trace
from fxpipe.passes.device import kind_of
from nets import NormDrop


class Tied(nn.Module):
    """A linear, then two linears sharing one weight."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(torch.tanh(self.first(self.pre(x))))


def state(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.device]]:
    """Each parameter and buffer: the tensor itself, a copy of its value, its device."""
    return {name: (t, t.detach().clone(), t.device)
            for name, t in [*model.named_parameters(), *model.named_buffers()]}


def assert_untouched(model: nn.Module, before: dict) -> None:
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert after.keys() == before.keys()
    for name, (tensor, value, device) in before.items():
        assert after[name] is tensor, name
        assert after[name].device == device, name
        torch.testing.assert_close(after[name].detach(), value, rtol=0, atol=0)


@pytest.mark.parametrize("training", [True, False])
def test_compile_runs_the_model_only_before_placing_its_stages(monkeypatch, training):
    placed = []

    class Watched(NormDrop):
        def forward(self, x):
            assert not placed, "the model ran after a stage was placed"
            return super().forward(x)

    def noting_place(gm, device, copies=None):
        placed.append(device)
        return place(gm, device, copies)
    monkeypatch.setattr(codegen, "place", noting_place)
    torch.manual_seed(0)
    model, x = Watched(features=16, p=0.1).train(training), torch.randn(8, 16)
    before = state(model)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2)
    assert placed
    placed.clear()
    assert_untouched(model, before)
    # On the CPU the stages hold the model's own tensors: the pipeline's are the model's.
    assert all(p is q for p, q in zip(pipe.parameters(), model.parameters()))
    model.eval(), pipe.eval()
    assert_same_up_to_rounding(pipe(x), model(x))


def test_stages_on_another_device_hold_copies_and_the_model_keeps_its_own():
    model = Tied()
    before = state(model)
    gm = fx.symbolic_trace(model)
    stage_of = {"pre": 0, "first": 1, "tanh": 1, "second": 1}
    copies = {}
    first, second = split_stages(gm, stage_of, ["cpu", "meta"], placed=copies)
    assert_untouched(model, before)
    assert first.module.pre is model.pre                      # where it is: the model's own
    held = second.module.second
    assert held is not model.second and held.weight.device.type == "meta"
    assert isinstance(held.weight, nn.Parameter)
    assert second.module.first.weight is held.weight          # tied weights stay tied
    # Placed again (the other mode's stages), the same copies: one per tensor and device.
    (again,) = split_stages(fx.symbolic_trace(model), dict.fromkeys(stage_of, 0), ["meta"],
                            placed=copies)
    assert again.module.second.weight is held.weight
    assert again.module.pre.weight.device.type == "meta"
    # The graph holds what the stages hold, under the model's names; the model its own.
    held_by_stages(gm, [first, second])
    assert gm.get_parameter("second.weight") is held.weight
    assert gm.get_parameter("pre.weight") is model.pre.weight
    assert_untouched(model, before)


def test_a_mode_switch_computes_with_the_values_the_pipeline_holds():
    from fxpipe.planning.checks import holding
    from fxpipe.passes.codegen import carry_values

    model, x = Tied(), torch.randn(4, 8)
    held = copy.deepcopy(model)          # other tensors under the model's names, as copies are
    with torch.no_grad():
        held.first.weight.add_(1.0)      # trained since: tied, both names see it
    before = state(model)
    torch.testing.assert_close(holding(model, held)(x), held(x))   # the reference's model
    assert holding(model, model) is model
    assert_untouched(model, before)
    other_mode = copy.deepcopy(model)    # the other mode's copies, placed elsewhere
    carry_values(held, other_mode)
    torch.testing.assert_close(other_mode(x), held(x))


def test_measuring_on_another_device_measures_a_copy():
    model, x = Tied(), torch.randn(4, 8)
    before = state(model)
    gm = trace(model, (x,))
    code = gm.code
    annotate_costs(gm, (x,), device="meta", repeats=1)
    assert all("cost" in n.meta for n in gm.graph.nodes if n.op != "output")
    assert_untouched(model, before)
    assert all(t.device.type == "cpu" for t in gm.parameters()) and gm.code == code


def test_place_points_device_strings_at_the_stage_device():
    class MakesOnCpu(nn.Module):
        def forward(self, x):
            return x.to("cpu") + torch.ones(x.shape[1], device="cpu")

    gm = fx.symbolic_trace(MakesOnCpu())
    place(gm, "meta")
    assert gm(torch.randn(2, 5, device="meta")).device.type == "meta"


# ---- the device measured is the device synchronised and timed ---------------------------------

def test_no_cuda_synchronize_in_compile_leaves_the_device_out(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    model, x = Tied(), torch.randn(4, 8)
    fxpipe.compile(model, ["cpu", "cpu"], (x,), num_stages="auto")
    assert all(device is not None for device in calls)
    synchronize(torch.device("cpu"), torch.device("cuda", 1))
    assert calls[-1] == torch.device("cuda", 1)


def test_a_gpu_is_timed_by_events_on_its_own_stream(monkeypatch):
    calls = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = len(calls)

        def record(self, stream):
            calls.append(("record", stream))

        def synchronize(self):
            calls.append(("synchronize",))

        def elapsed_time(self, end):            # milliseconds, as CUDA's
            return 1000.0 * (end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    elapsed_s = start_timer(torch.device("cuda", 1))
    assert elapsed_s() == 1.0
    assert calls == [("record", "stream of cuda:1"), ("record", "stream of cuda:1"),
                     ("synchronize",)]


def test_capture_forks_the_generator_of_every_gpu_it_seeds(monkeypatch):
    forked, restored = [], []
    cuda = kind_of("cuda")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: None)
    monkeypatch.setattr(cuda, "rng_state", lambda device: forked.append(device) or device)
    monkeypatch.setattr(cuda, "set_rng_state", lambda device, state: restored.append(state))
    trace(Tied(), (torch.randn(4, 8),))
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert forked and forked == gpus * (len(forked) // 2) and restored == forked


# ---- devices: the current GPU, its free memory, shared among its stages -----------------------

def test_cuda_is_the_current_gpu_and_a_gpu_holds_what_it_has_free(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10e9, 80e9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3e9)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1e9)
    current, spec, given = parse_devices(["cuda", fxpipe.DeviceSpec("cuda:0"),
                                          fxpipe.DeviceSpec("cuda:0", memory_bytes=4e9)])
    assert current.name == "cuda:1" and spec.name == "cuda:0"
    assert current.memory_bytes == spec.memory_bytes == pytest.approx(12e9 * 0.9)
    assert given.memory_bytes == 4e9


def test_stages_on_one_device_share_its_memory():
    cuda0, cuda1 = fxpipe.DeviceSpec("cuda:0", memory_bytes=8e9), fxpipe.DeviceSpec("cuda:1")
    shared = shared_memory([cuda0, cuda1, fxpipe.DeviceSpec("cuda:0", memory_bytes=6e9)])
    assert [d.memory_bytes for d in shared] == [3e9, math.inf, 3e9]


def test_compile_keeps_stages_on_one_device_within_its_memory_together():
    torch.manual_seed(0)
    model, x = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).eval(), torch.randn(8, 64)
    free = fxpipe.compile(model, ["cpu", "cpu"], (x,)).plan.partition.stages
    budget = 1.5 * max(c.memory_bytes for c in free)       # either stage alone fits, not both
    assert sum(c.memory_bytes for c in free) > budget
    with pytest.raises(fxpipe.PartitionError):
        fxpipe.compile(model, [fxpipe.DeviceSpec("cpu", memory_bytes=budget)] * 2, (x,))
    pipe = fxpipe.compile(model, [fxpipe.DeviceSpec("cpu", memory_bytes=2.2 * budget)] * 2, (x,))
    assert sum(c.memory_bytes for c in pipe.plan.partition.stages) <= 2.2 * budget
    assert [d.memory_bytes for d in pipe.plan.partition.devices] == pytest.approx([1.1 * budget] * 2)


class TiedEnds(nn.Module):
    """An embedding, layers, and an output layer reading the embedding's weight again."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.layers(self.emb(ids))))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_stages_on_two_names_of_the_cpu_share_a_tied_weight_rather_than_send_or_copy_it(capture):
    """`cpu:0` and `cpu:1` are one memory: the output layer's stage holds the embedding's own
    Parameter, no stage receives a parameter as a value, and the gradients both
    stages leave in the one Parameter add up to the model's."""
    torch.manual_seed(0)
    model, ids, target = TiedEnds(), torch.randint(0, 50, (8, 6)), torch.randn(8, 6, 50)
    pipe = fxpipe.compile(copy.deepcopy(model), ["cpu:0", "cpu:1"], (ids,), chunks=2,
                          capture=capture, training=True)
    first, last = pipe.plan.stages
    assert [stage.device for stage in pipe.plan.stages] == [torch.device("cpu:0"),
                                                            torch.device("cpu:1")]
    held = [{id(p) for p in stage.module.parameters()} for stage in pipe.plan.stages]
    (shared,) = held[0] & held[1]
    assert [p.shape for p in first.module.parameters() if id(p) == shared] == [(50, 32)]
    parameters = {n.name for n in pipe.plan.graph.graph.nodes if n.op == "get_attr"}
    assert not parameters & set(last.inputs), last.inputs
    mse = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    loss = pipe.train_step((ids,), target, mse)
    expected = mse(model(ids), target)
    expected.backward()
    assert_same_training(pipe, model, loss=(loss, expected))
