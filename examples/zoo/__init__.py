"""A zoo of real vision architectures for testing and benchmarking fxpipe.

fxpipe traces models (torch.fx / torch.export), cuts the graph into pipeline
stages and runs them on micro-batches.  The zoo gives it realistic graphs to
chew on, written in plain PyTorch (no torchvision, no downloads, random
weights), each stressing a different pattern:

=============  ===========================================================
``resnet50``   residual adds, projection shortcuts, BatchNorm
``inception``  wide multi-branch blocks joined by ``torch.cat``
``densenet``   dense connectivity: long-lived tensors feeding many concats
``mobilenet``  depthwise convs, squeeze-excite, hardswish, residuals
``unet``       long encoder->decoder skips, ConvTranspose up-sampling
``vit``        attention with reshape/permute, class token, pos. embedding
``swin``       window partition/reverse, ``torch.roll``, index buffers, masks
``dynamic``    a shape-dependent loop: NOT traceable by plain torch.fx
=============  ===========================================================

Every model comes in three sizes: ``"tiny"`` (real topology and depth, narrow
and small inputs; a forward pass takes milliseconds on one CPU core, for unit
tests), ``"small"`` (for quick benchmarks) and ``"full"`` (the configuration
of the paper).

Use :func:`build` (or call ``ZOO[name]`` directly, same arguments)::

    case = build("resnet50", size="tiny", batch=4, seed=0)
    out = case.model(*case.example_inputs, **case.example_kwargs)

Guarantees of every case:

* ``model`` is in **eval mode** (BatchNorm uses its running statistics and
  dropout is off), so outputs are deterministic.  Call ``.train()`` yourself
  if you need training behaviour.
* Construction is deterministic for a given ``seed`` (the model does not
  depend on ``batch``) and leaves the global RNG state untouched.
* Weights are random, but like a trained network's: BatchNorm running
  statistics are calibrated on a random batch, so activations stay
  normalised through depth and different samples give clearly different
  outputs; BatchNorm/LayerNorm affine parameters are perturbed away from
  (1, 0).  A pipeline that loses a buffer or parameter therefore changes the
  output instead of silently hitting an identity.
* The batch is dim 0 of every input and output and no operation mixes
  samples, so running micro-batches separately and concatenating gives the
  full-batch output (up to float rounding).
* ``fx_traceable`` tells whether ``torch.fx.symbolic_trace`` succeeds.  Only
  ``dynamic`` is False; see :mod:`examples.zoo.dynamic` for what to do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

import torch
from torch import nn

from . import densenet, dynamic, inception, mobilenet, resnet, swin, unet, vit

__all__ = ["SIZES", "ZOO", "ZooCase", "build"]

SIZES = ("tiny", "small", "full")


@dataclass(frozen=True, eq=False)
class ZooCase:
    """A model ready to run: ``model(*example_inputs, **example_kwargs)``."""

    model: nn.Module
    example_inputs: tuple
    example_kwargs: dict = field(default_factory=dict)
    fx_traceable: bool = True


_CALIBRATION_BATCH = 8


def _randomize_norm_affine(model: nn.Module) -> None:
    """Perturb BatchNorm/LayerNorm affine parameters away from (1, 0)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm)) and m.weight is not None:
                m.weight.uniform_(0.8, 1.2)
                m.bias.normal_(0.0, 0.1)


def _calibrate_batchnorm(model: nn.Module, sample_shape: tuple[int, ...]) -> None:
    """Set BatchNorm running statistics from one random batch.

    With freshly initialised statistics (mean 0, var 1) an eval-mode BatchNorm
    does not normalise, and with random weights the signal fades (or blows up)
    over depth until every sample gives almost the same output.  Calibrating
    the statistics on data, as training would, keeps activations normalised,
    so outputs differ clearly between samples.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    model.train()
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.eval()
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average: one batch gives exactly its statistics
    with torch.no_grad():
        model(torch.randn(_CALIBRATION_BATCH, *sample_shape))
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum


def _make_case(module: ModuleType, fx_traceable: bool, size: str = "tiny", batch: int = 4, seed: int = 0) -> ZooCase:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    if batch < 1:
        raise ValueError("batch must be >= 1")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, sample_shape = module.from_preset(size)
        _randomize_norm_affine(model)
        _calibrate_batchnorm(model, sample_shape)
        x = torch.randn(batch, *sample_shape)
    model.eval()
    return ZooCase(model=model, example_inputs=(x,), example_kwargs={}, fx_traceable=fx_traceable)


def _entry(module: ModuleType, fx_traceable: bool) -> Callable[..., ZooCase]:
    return functools.partial(_make_case, module, fx_traceable)


#: name -> ``f(size="tiny", batch=4, seed=0) -> ZooCase``
ZOO: dict[str, Callable[..., ZooCase]] = {
    "resnet50": _entry(resnet, True),
    "inception": _entry(inception, True),
    "densenet": _entry(densenet, True),
    "mobilenet": _entry(mobilenet, True),
    "unet": _entry(unet, True),
    "vit": _entry(vit, True),
    "swin": _entry(swin, True),
    "dynamic": _entry(dynamic, False),
}


def build(name: str, size: str = "tiny", batch: int = 4, seed: int = 0) -> ZooCase:
    """Build zoo model ``name`` at ``size`` with a random input batch.

    The model is returned in eval mode (deterministic BatchNorm, no dropout).
    """
    try:
        factory = ZOO[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; known: {sorted(ZOO)}") from None
    return factory(size=size, batch=batch, seed=seed)


def model(name: str, size: str = "tiny", seed: int = 0) -> nn.Module:
    """Zoo model ``name`` alone, for the command line: ``python -m fxpipe plan
    examples.zoo:model --kwargs '{"name": "resnet50"}' --input 4x3x32x32`` (``input_shape``
    gives the input's shape after the batch)."""
    return build(name, size=size, batch=1, seed=seed).model


def input_shape(name: str, size: str = "tiny") -> tuple[int, ...]:
    """The shape of one sample of zoo model ``name``'s input."""
    return tuple(build(name, size=size, batch=1).example_inputs[0].shape[1:])
