"""A plan captured by torch.export keeps the model's autocast and no_grad blocks as regions
(higher-order ops on a submodule); saved and loaded, or given weights (`with_weights`), its
stages still run those blocks in their precision and grad mode, in inference and training."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.passes.capture.regions import Region, regions_as_modules
from fxpipe.testing import assert_same_up_to_rounding, grads_of
from fxpipe.weights import save_weights


class Regions(nn.Module):
    """An autocast block (bf16 on the CPU), a no_grad block, and one inside the other."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.a(x)
            with torch.autocast("cpu", enabled=False):
                y = y.float() * 2
        with torch.no_grad():
            z = self.b(x)
        h = torch.relu(self.c(y.float() + z))
        return self.d(h)


BF16 = 4 * 2 ** 16      # 4 epsilons of bfloat16, in float32's (2^-7 against 2^-23)


@pytest.fixture(scope="module")
def planned():
    torch.manual_seed(0)
    model, x = Regions().train(), torch.randn(16, 32)
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), num_stages=2, chunks=2, capture="export",
                       training=True, repeats=1)
    return model, x, plan


def train_once(module, x):
    for p in module.parameters():
        p.grad = None
    if isinstance(module, fxpipe.Pipeline):
        loss = module.train_step(x, torch.zeros(16, 32), F.mse_loss)
    else:
        loss = F.mse_loss(module(x), torch.zeros(16, 32))
        loss.backward()
    return loss.detach(), grads_of(module)


def test_the_stages_hold_the_regions_and_the_copy_as_modules_runs_them_alike(planned):
    model, x, plan = planned
    kept = [s for s in plan.stages if regions_as_modules(s.module) is not s.module]
    assert kept, "export keeps the blocks as regions"
    for stage in kept:
        code = stage.module.code
        as_modules = regions_as_modules(stage.module)
        assert stage.module.code == code       # the plan's own is left as it is
        assert any(isinstance(m, Region) for m in as_modules.modules())
        assert "wrap_with" not in as_modules.code
    assert all(regions_as_modules(s.module) is s.module for s in plan.stages if s not in kept)


@pytest.mark.parametrize("how", ["saved", "with_weights"])
def test_a_reloaded_plan_runs_the_blocks_in_their_precision_and_grad_mode(planned, how,
                                                                          tmp_path):
    model, x, plan = planned
    if how == "saved":
        loaded = fxpipe.load_plan(plan.save(tmp_path / "plan"))
    else:
        save_weights(model.state_dict(), tmp_path / "weights.safetensors")
        loaded = plan.with_weights(tmp_path / "weights.safetensors")
    # The plan as planned runs the same micro-batches: a bf16 block's gradients, summed over
    # micro-batches, round otherwise than the whole batch's, so the model is compared in
    # bf16's epsilons, the plan as planned in float32's.
    with fxpipe.Pipeline(plan) as planned_pipe, fxpipe.Pipeline(loaded) as pipe:
        with torch.no_grad():
            out = pipe(x)
            assert_same_up_to_rounding(out, planned_pipe(x))
            assert_same_up_to_rounding(out, model(x), epsilons=BF16)
        step = train_once(pipe, x)
        assert_same_up_to_rounding(step, train_once(planned_pipe, x))
        assert_same_up_to_rounding(step, train_once(copy.deepcopy(model), x), epsilons=BF16)
        # the no_grad block's Linear gets no gradient, as in the model
        assert dict(pipe.named_parameters())["b.weight"].grad is None
