"""The calling convention of fx graphs: inputs fx specialised, `*args` and `**kwargs` forwards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.passes.errors import InputError
from fxpipe.passes.signature import signature_of
from fxpipe.passes.capture import trace


class Options(nn.Module):
    """Inputs the example leaves out are traced at their defaults: fx specialises them."""

    def __init__(self, width=4):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x, mask=None, scale=1.0):
        y = self.a(x)
        if mask is not None:
            y = y + mask
        return self.b(y) * scale


class Stars(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, *xs):
        return self.b(self.a(xs[0]) + xs[1])


class FirstThenStars(Stars):
    def forward(self, x, *rest):
        return self.b(self.a(x) * rest[0] + rest[-1])


class Keywords(Stars):
    def forward(self, x, **extra):
        return self.b(self.a(x) + extra["bias"])


def _x(rows=4, width=4, seed=0):
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def options_pipe():
    model = Options().eval()
    return model, fxpipe.compile(model, ["cpu"] * 2, (_x(),), chunks=2, capture="fx")


def test_specialised_inputs_are_named_after_the_models_parameters():
    signature = signature_of(trace(Options(), (_x(),), capture="fx"))
    assert signature.names == ("x", "mask", "scale")
    assert signature.specialised == {"mask": None, "scale": 1.0}


def test_specialised_inputs_accept_the_traced_value_by_keyword(options_pipe):
    model, pipe = options_pipe
    x = _x(seed=1)
    assert_same_up_to_rounding(pipe(x, mask=None, scale=1.0), model(x))


def test_specialised_inputs_accept_the_traced_value_positionally(options_pipe):
    model, pipe = options_pipe
    x = _x(seed=2)
    assert_same_up_to_rounding(pipe(x, None, 1.0), model(x))
    assert_same_up_to_rounding(pipe(x, None, 1), model(x))     # 1 == 1.0: the same number


@pytest.mark.parametrize("args, kwargs, name, traced", [
    ((), {"scale": 2.0}, "scale", "scale=1.0"),
    ((None, 2.0), {}, "scale", "scale=1.0"),
    ((None, True), {}, "scale", "scale=1.0"),                    # a bool is not the number 1
    ((), {"mask": torch.ones(4, 4)}, "mask", "mask=None"),
    ((torch.ones(4, 4),), {}, "mask", "mask=None"),
])
def test_another_value_for_a_specialised_input_is_refused_by_name(options_pipe, args, kwargs,
                                                                   name, traced):
    _, pipe = options_pipe
    with pytest.raises(InputError, match=rf"input '{name}' .* traced with .*\n"
                                         rf"torch\.fx fixed {traced}") as error:
        pipe(_x(), *args, **kwargs)
    assert f"compile again with {name} in example_inputs or example_kwargs" in str(error.value)


def test_an_input_the_example_gives_is_not_specialised():
    model = Options().eval()
    mask = torch.zeros(4, 4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (_x(), mask), chunks=2, capture="fx")
    x, other = _x(seed=3), torch.ones(4, 4)
    assert_same_up_to_rounding(pipe(x, other), model(x, other))
    with pytest.raises(InputError, match="input 'scale'"):
        pipe(x, other, 3.0)


@pytest.mark.parametrize("model_type", [Stars, FirstThenStars])
def test_star_args_forward_takes_its_positional_inputs_as_a_tuple(model_type):
    model = model_type().eval()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (_x(), _x(seed=1)), chunks=2, capture="fx")
    assert pipe.plan.capture.method == "fx"
    x, y = _x(seed=2), _x(seed=3)
    assert_same_up_to_rounding(pipe(x, y), model(x, y))
    assert_same_up_to_rounding(pipe(x, y, x), model(x, y, x))     # more than the example gave


def test_star_args_graph_module_is_called_like_the_model():
    model = FirstThenStars().eval()
    x, y, z = _x(), _x(seed=1), _x(seed=2)
    gm = trace(model, (x, y), capture="fx")
    torch.testing.assert_close(gm(x, y, z), model(x, y, z))
    assert signature_of(gm).flatten_inputs((x, y, z))[1] == (y, z)


def test_star_kwargs_forward_takes_its_keyword_inputs_as_a_dict():
    model = Keywords().eval()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (_x(),), {"bias": _x(seed=1)}, chunks=2,
                          capture="fx")
    x, bias = _x(seed=2), _x(seed=3)
    assert_same_up_to_rounding(pipe(x, bias=bias), model(x, bias=bias))


# ---- each front-end records its convention ---------------------------------------------------

class Windowed(nn.Module):
    """An option fx cannot check with an assertion (a slice): it only warns when fixing it."""

    def __init__(self, width=4):
        super().__init__()
        self.a = nn.Linear(width, width)

    def forward(self, x, window=slice(0, 2)):
        return self.a(x)[:, window]


def test_an_input_fixed_to_a_value_fx_cannot_check_is_still_taken_by_its_name():
    model = Windowed().eval()
    with pytest.warns(UserWarning, match="Was not able to add assertion"):
        gm = trace(model, (_x(),), capture="fx")
    signature = signature_of(gm)
    assert signature.names == ("x", "window")
    assert signature.specialised == {"window": slice(0, 2)}
    x = _x(seed=1)
    assert signature.flatten_inputs((x,), {"window": slice(0, 2)})[1] == slice(0, 2)
    torch.testing.assert_close(gm(x), model(x))
    with pytest.raises(InputError, match=r"input 'window' is slice\(1, 3, None\); the graph "
                                         r"was traced with slice\(0, 2, None\)"):
        signature.flatten_inputs((x,), {"window": slice(1, 3)})


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_the_front_end_records_the_signature_on_the_graph(capture):
    model = Options().eval()
    gm = trace(model, (_x(),), {"scale": 2.0}, capture=capture)
    recorded = gm.meta["signature"]
    assert signature_of(gm).names == recorded.names
    if capture == "fx":      # every parameter, `mask` fixed at its default
        assert recorded.names == ("x", "mask", "scale") and recorded.in_spec is None
        assert recorded.specialised == {"mask": None}
    else:                    # what the example gave, as it gave it
        assert recorded.names == ("x", "scale") and recorded.positional == 1
        assert recorded.constants == {1: 2.0}
    x = _x(seed=1)
    torch.testing.assert_close(gm(x, scale=2.0), model(x, scale=2.0))
