"""The comparison rule (`assert_same_up_to_rounding`) against bugs injected into real models'
gradients: each parameter's gradient in turn zeroed, negated, doubled, or missing one of two
micro-batches, in a tiny Inception, ResNet-50 and Llama. Every injection that moves a tensor by
more than 4x its allowance fails, whatever the magnitude of the tensor beside the set's."""

from __future__ import annotations

import pytest
import torch

from examples.zoo import build
from examples.zoo.hf import build_hf
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.testing._rounding import allowance

MODELS = ["inception", "resnet50", "llama"]
BUGS = {
    "zeroed": lambda whole, first: torch.zeros_like(whole),
    "negated": lambda whole, first: -whole,
    "doubled": lambda whole, first: 2 * whole,
    "a micro-batch lost": lambda whole, first: first,
}


def _model_and_batch(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    if name == "llama":
        return build_hf("llama", size="tiny", batch=4, seed=0)
    case = build(name, size="tiny", batch=4, seed=0)
    return case.model, {"x": case.example_inputs[0]}


def _gradients(model: torch.nn.Module, batch: dict[str, torch.Tensor],
               weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the outputs weighted by `weights` and summed: a loss that
    sums over samples, so the whole batch's gradient is the sum of its micro-batches'."""
    model.zero_grad()
    out = model(**batch) if "input_ids" in batch else model(batch["x"])
    out = out.logits if hasattr(out, "logits") else out
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


_cache: dict[str, tuple] = {}


def whole_and_first(name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """The whole batch's gradients, those of its first half alone (the second micro-batch
    lost), and the set's largest magnitude."""
    if name not in _cache:
        model, batch = _model_and_batch(name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            with torch.no_grad():
                out = model(**batch) if "input_ids" in batch else model(batch["x"])
            weights = torch.randn_like(out.logits if hasattr(out, "logits") else out)
        whole = _gradients(model, batch, weights)
        first = _gradients(model, {k: v[:2] for k, v in batch.items()}, weights[:2])
        scale = max(g.abs().max().item() for g in whole.values())
        _cache[name] = whole, first, scale
    return _cache[name]


@pytest.mark.parametrize("name", MODELS)
def test_every_injected_bug_that_moves_a_gradient_past_rounding_fails(name):
    whole, first, scale = whole_and_first(name)
    caught, hidden = 0, []
    for parameter, expected in whole.items():
        for bug, inject in BUGS.items():
            wrong = inject(expected, first[parameter])
            moved = (wrong - expected).abs().max().item()
            own = max(wrong.abs().max().item(), expected.abs().max().item())
            if moved <= 4 * allowance(expected.dtype, own, scale):
                hidden.append((bug, parameter, moved / scale))
                continue
            # Only the perturbed tensor, against the whole set's scale: what comparing the
            # whole set does for that tensor.
            with pytest.raises(AssertionError, match="differs by"):
                assert_same_up_to_rounding(wrong, expected, scale=scale,
                                           what=f"{bug} {parameter}")
            caught += 1
    # What the rule cannot tell from rounding moves a tensor by under 1.5e-5 of the set's
    # largest magnitude (4x its floor): gradients zero in exact arithmetic, never a real one.
    assert all(share < 1e-4 for _, _, share in hidden), hidden
    assert caught >= 0.95 * len(BUGS) * len(whole), (caught, hidden)


def test_a_wrong_tensor_beside_one_ten_thousand_times_larger_fails():
    big, small = torch.full((8,), 100.0), torch.full((4,), 1e-2)
    for wrong in (torch.zeros(4), -small, 2 * small, 0.5 * small):
        with pytest.raises(AssertionError, match="'small' differs by"):
            assert_same_up_to_rounding({"big": big, "small": wrong},
                                       {"big": big, "small": small})
    assert_same_up_to_rounding({"big": big, "small": small * (1 + 8 * 2 ** -23)},
                               {"big": big, "small": small})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_tensor_is_held_to_its_own_magnitude_not_64_of_its_epsilons(dtype):
    logits = torch.linspace(-20, 20, 64).to(dtype)
    for wrong in (logits * 1.25, logits * 0.6, logits * 1.05):
        with pytest.raises(AssertionError, match="differs by"):
            assert_same_up_to_rounding(wrong.to(dtype), logits)
    one_ulp = torch.nextafter(logits, torch.full_like(logits, 100.0))
    assert_same_up_to_rounding(one_ulp, logits)
