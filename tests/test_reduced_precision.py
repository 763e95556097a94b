"""The checks' tolerance is the model's own rounding, measured against float64, so rounding
passes and a model mixing samples does not: on a CPU, where another CPU's kernels (another
order of sums) round a model with a large dynamic range by more than a fixed bound allows, and
on a GPU that runs float32 in reduced precision (TF32); a bf16 model's, measured against
float32, as its micro-batches round otherwise than its whole batch. The plan states it.

A CPU has no TF32: `Rounds` stands in for it, rounding its float32 results by an amount that
depends on the batch size (as a GPU's kernels do for other micro-batch sizes) and computing
float64 exactly, and the checks are told float32 is reduced (`_reduced_float32`), the CPU
standing for the GPU.
"""

import math

import pytest
import torch
from torch import nn

import fxpipe
import fxpipe.planning.checks.rounding
from fxpipe.planning.checks import measured_tolerance, rounding_tolerance
from fxpipe.passes.compare import difference


class Rounds(nn.Module):
    """Float32 results off by 2**-10 times (batch size mod 5) of themselves; float64 exact."""

    def forward(self, y):
        if y.dtype != torch.float32:
            return y
        return y + y.detach() * 2.0 ** -10 * (y.shape[0] % 5)


class Net(nn.Module):
    def __init__(self, mixes=False):
        super().__init__()
        self.first, self.rounds, self.last = nn.Linear(16, 32), Rounds(), nn.Linear(32, 8)
        self.mixes = mixes

    def forward(self, x):
        y = self.rounds(torch.tanh(self.first(x)))
        if self.mixes:
            y = y - 0.5 * y.mean(0)        # every sample reads the others
        return self.last(y)


@pytest.fixture
def reduced(monkeypatch):
    monkeypatch.setattr(fxpipe.planning.checks.rounding, "_reduced_float32", lambda tensors, gpu: True)


def test_the_tolerance_is_four_times_the_models_rounding_against_float64(reduced):
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(12, 16)
    tolerance = rounding_tolerance(model, (x,), {})
    exact = model.double()(x.double())
    model.float()
    error = ((model(x).double() - exact).abs().max() / exact.abs().max()).item()
    assert 2 * 2 ** -10 * 0.5 < error < 2 * 2 ** -10 * 1.5       # 12 % 5 = 2
    assert tolerance == pytest.approx(4 * error, rel=1e-6)


def test_on_a_cpu_a_model_computing_other_values_in_float64_has_no_measured_tolerance():
    """`Rounds` is off by 2e-3 in float32: not a CPU's float32 rounding (at most 2**-10 of the
    outputs), so nothing is measured and the default applies."""
    model, x = Net().eval(), torch.randn(12, 16)
    assert rounding_tolerance(model, (x,), {}) is None


def test_rounding_alone_passes_the_checks_and_the_pipeline_equals_the_model(reduced):
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(12, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4)
    assert "checked against the model: yes" in str(pipe.plan)
    expected = torch.cat([model(part) for part in x.chunk(4)])
    torch.testing.assert_close(pipe(x), expected)


def test_without_the_measure_the_same_rounding_is_refused():
    """On a CPU the measure is float32's own rounding, which `Rounds` is not."""
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(12, 16)
    with pytest.raises(fxpipe.BatchError, match="mixes samples across the batch"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4)


def test_a_model_mixing_samples_is_still_refused_where_float32_is_reduced(reduced):
    torch.manual_seed(0)
    model, x = Net(mixes=True).eval(), torch.randn(12, 16)
    with pytest.raises(fxpipe.BatchError, match="mixes samples across the batch"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4)


# ---- on a CPU: the model's own rounding, measured against float64 ----------------------------

class AnotherCPU(nn.Module):
    """Its float32 input as another CPU's kernels may round it, one float32 step (ulp) higher,
    where the intra-op thread count differs from the one it was made on (the stages run on 2
    threads, the caller on 1); the same elsewhere. A leaf module: it runs at call time."""

    def __init__(self):
        super().__init__()
        self.home = torch.get_num_threads()

    def forward(self, h):
        if h.dtype != torch.float32 or torch.get_num_threads() == self.home:
            return h
        return torch.nextafter(h, torch.full_like(h, math.inf))


class Offset(nn.Module):
    """A large dynamic range: outputs of a few units computed from values near 1e3, which float32
    keeps to 6e-5 (its step there), some 1e-5 of the outputs, where 16 epsilons are 2e-6.
    `mixes`: each sample's values read the batch's mean."""

    def __init__(self, mixes=False):
        super().__init__()
        self.first, self.other, self.last = nn.Linear(16, 32), AnotherCPU(), nn.Linear(32, 8)
        self.mixes = mixes

    def forward(self, x):
        h = self.other(self.first(x) + 1000.0) - 1000.0
        if self.mixes:
            h = h - 0.5 * h.mean(0)
        return self.last(torch.tanh(h))


def offset(mixes=False):
    torch.manual_seed(0)
    return Offset(mixes).eval(), torch.randn(12, 16)


def test_on_a_cpu_the_tolerance_is_four_times_the_models_rounding_against_float64():
    model, x = offset()
    with torch.no_grad():
        rounded = model(x)
        exact = model.double()(x.double())
    model.float()
    error = ((rounded.double() - exact).abs().max() / exact.abs().max()).item()
    tolerance = rounding_tolerance(model, (x,), {}, rounded=rounded)
    assert tolerance == pytest.approx(4 * error, rel=1e-6)
    assert tolerance > 16 * torch.finfo(torch.float32).eps       # the old fixed bound
    # Without `rounded`, the same measure from two runs in eval mode.
    assert rounding_tolerance(model, (x,), {}) == pytest.approx(tolerance, rel=1e-6)
    # Another CPU's rounding, one float32 step, is within it and beyond the fixed bound.
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            elsewhere = model(x)
    finally:
        torch.set_num_threads(model.other.home)
    assert difference(elsewhere, rounded, None)
    assert not difference(elsewhere, rounded, tolerance)


def test_on_a_cpu_another_cpus_rounding_passes_the_checks():
    model, x = offset()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, threads_per_stage=2,
                          leaf_modules=[AnotherCPU], repeats=1)
    assert "checked against the model: yes" in str(pipe.plan)
    with pytest.raises(fxpipe.VerificationError, match="differs by up to"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, threads_per_stage=2,
                       leaf_modules=[AnotherCPU], repeats=1,
                       verify_tolerance=16 * torch.finfo(torch.float32).eps)


def test_on_a_cpu_a_model_mixing_samples_is_still_refused():
    model, x = offset(mixes=True)
    with pytest.raises(fxpipe.BatchError, match="mixes samples across the batch"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4, leaf_modules=[AnotherCPU])


class BatchStatistics(nn.Module):
    """Normalised by the batch's own statistics in either mode (a BatchNorm in training mode
    inside a model in eval mode)."""

    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.last(torch.nn.functional.batch_norm(self.first(x), None, None,
                                                        training=True))


def test_on_a_cpu_batch_statistics_are_still_refused():
    torch.manual_seed(0)
    model, x = BatchStatistics().eval(), torch.randn(12, 16)
    assert rounding_tolerance(model, (x,), {}) < 1e-5
    with pytest.raises(fxpipe.BatchError, match="mixes samples across the batch"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4)


def test_a_model_drawing_random_numbers_is_measured_in_eval_mode():
    """Float64 may draw other numbers than float32 from the same seed: its runs are made
    without dropout, and the model's mode is left as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 8)).train()
    tolerance = rounding_tolerance(model, (torch.randn(12, 16),), {})
    assert tolerance is not None and tolerance < 1e-5
    assert all(m.training for m in model.modules())


# ---- a bf16 model: its own rounding, measured against float32 --------------------------------

class GPUKernels(nn.Module):
    """Its bf16 input as a GPU's kernels may round it for another batch size (a CPU's do not):
    one bf16 step (2**-8 of itself) higher times (batch size mod 5)."""

    def forward(self, h):
        if h.dtype != torch.bfloat16:
            return h
        return h + h.detach() * 2.0 ** -8 * (h.shape[0] % 5)


class Deep(nn.Module):
    """Residual tanh layers, the output cast to float32 as language models cast their logits.
    `mixes`: each sample's values read the batch's mean."""

    def __init__(self, mixes=False):
        super().__init__()
        self.first, self.last = nn.Linear(16, 128), nn.Linear(128, 8)
        self.layers = nn.ModuleList(nn.Linear(128, 128) for _ in range(6))
        self.kernels = GPUKernels()
        self.mixes = mixes

    def forward(self, x):
        h = self.first(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        h = self.kernels(h)
        if self.mixes:
            h = h - h.mean(0)
        return self.last(h).float()


def bf16(mixes=False):
    torch.manual_seed(0)
    return Deep(mixes).eval().to(torch.bfloat16), torch.randn(12, 16, dtype=torch.bfloat16)


BF16_LEAST = torch.finfo(torch.bfloat16).eps     # measured, bf16's own rounding stands down to it


@pytest.mark.parametrize("chunks", [2, 4])
def test_a_bf16_model_compiles_on_micro_batches_and_the_plan_states_its_tolerance(chunks):
    model, x = bf16()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=chunks, repeats=1)
    plan = pipe.plan
    assert plan.record.verify_tolerance == rounding_tolerance(model, (x,), {}) >= BF16_LEAST
    assert plan.record.verify_tolerance_source in (
        "the model's own bf16 rounding x4, measured against float32",
        f"one bf16 epsilon, the least for a bf16 model; its own rounding x4, measured against "
        f"float32, is {plan.record.verify_tolerance:.2g}") or plan.record.verify_tolerance_source.startswith(
        "one bf16 epsilon, the least for a bf16 model; its own rounding x4, measured against")
    assert str(plan).splitlines()[-1] == (
        f"outputs checked against the model: yes, within {plan.record.verify_tolerance:.2g} of each "
        f"output's largest magnitude ({plan.record.verify_tolerance_source})")
    expected = torch.cat([model(part) for part in x.chunk(chunks)])
    assert not difference(pipe(x), expected, plan.record.verify_tolerance)
    # Float32's 16 epsilons, the default for its float32 output, took the rounding of bf16
    # micro-batches on a GPU for a model mixing samples.
    with pytest.raises(fxpipe.BatchError, match="mixes samples across the batch"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=chunks, repeats=1,
                       verify_tolerance=16 * torch.finfo(torch.float32).eps)


class CoarseBf16(nn.Module):
    """Bf16 results off by 2**-5 times (batch size mod 5) of themselves; float32 exact."""

    def forward(self, y):
        if y.dtype == torch.float32:
            return y
        return y + y.detach() * 2.0 ** -5 * (y.shape[0] % 5)


def test_a_bf16_models_tolerance_is_four_times_its_error_against_float32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), CoarseBf16(), nn.Linear(32, 8))
    model, x = model.eval().to(torch.bfloat16), torch.randn(12, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        rounded = model(x)
        exact = torch.func.functional_call(
            model, {n: t.float() for n, t in model.state_dict().items()}, (x.float(),))
    error = ((rounded.double() - exact.double()).abs().max() / exact.abs().max()).item()
    assert 2 * 2 ** -5 * 0.5 < error < 2 * 2 ** -5 * 1.5          # 12 % 5 = 2
    tolerance, source = measured_tolerance(model, (x,), {}, rounded=rounded)
    assert tolerance == pytest.approx(4 * error, rel=1e-6) and tolerance > BF16_LEAST
    assert source == "the model's own bf16 rounding x4, measured against float32"
    # Without `rounded`, the same from two runs in eval mode.
    assert rounding_tolerance(model, (x,), {}) == pytest.approx(tolerance, rel=1e-6)
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=4, repeats=1)
    assert plan.record.verify_tolerance == pytest.approx(tolerance, rel=1e-6)
    assert f"within {tolerance:.2g} of each output's largest magnitude (the model's own bf16 " \
           f"rounding x4, measured against float32)" in str(plan)


def test_a_bf16_model_mixing_samples_is_still_refused():
    model, x = bf16(mixes=True)
    for chunks in (2, 4):
        with pytest.raises(fxpipe.BatchError, match="mixes samples across the batch"):
            fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=chunks, repeats=1)


def test_a_float32_models_plan_states_its_measured_tolerance_and_an_asked_one():
    model, x = offset()
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2, repeats=1, leaf_modules=[AnotherCPU])
    assert plan.record.verify_tolerance_source == "the model's own float32 rounding x4, measured " \
                                           "against float64"
    assert plan.record.verify_tolerance > 16 * torch.finfo(torch.float32).eps
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2, repeats=1, leaf_modules=[AnotherCPU],
                       verify_tolerance=1e-3)
    assert str(plan).endswith("within 0.001 of each output's largest magnitude (as asked: "
                              "verify_tolerance=)")
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2, repeats=1, leaf_modules=[AnotherCPU],
                       verify=False)
    assert str(plan).endswith("outputs checked against the model: skipped (verify=False)")
