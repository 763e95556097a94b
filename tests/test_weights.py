"""fxpipe.weights: a stage's tensors read from a checkpoint by name, or drawn by the model's init.

Every read is compared with the model's own tensors; "reads only what is asked" is checked by
counting the tensors safetensors hands out.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fxpipe.saved import PlanFileError
from fxpipe.weights import Init, open_weights


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, as language models do."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


def small():
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 4))


def built(make, seed=0):
    torch.manual_seed(seed)
    return make()


def on_meta(make):
    with torch.device("meta"):
        return make()


def like(model):
    """Every tensor of `model` by every name, tied names sharing an object (as a stage holds)."""
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


def save_safetensors(tensors, path):
    save_file({name: t.contiguous() for name, t in tensors.items()}, path,
              metadata={"format": "pt"})
    return path


def assert_equal(got, want):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("source", ["mapping", "safetensors"])
def test_a_checkpoint_gives_the_models_tensors_on_the_device(source, tmp_path):
    model = built(small)
    state = model.state_dict()
    spec = state if source == "mapping" else save_safetensors(state, tmp_path / "m.safetensors")
    got = open_weights(spec).read(like(on_meta(small)), "cpu")
    assert_equal(got, state)
    assert all(t.device.type == "cpu" for t in got.values())
    got["0.weight"].add_(1)         # the caller's tensors are not the ones read
    assert not torch.equal(got["0.weight"], model[0].weight)


def test_a_safetensors_file_reads_only_the_asked_tensors(tmp_path, monkeypatch):
    import safetensors

    path = save_safetensors(built(small).state_dict(), tmp_path / "m.safetensors")
    read = []
    real_open = safetensors.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def get_tensor(self, name):
            read.append(name)
            return self.file.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    stage = {name: t for name, t in like(on_meta(small)).items() if name.startswith("3.")}
    got = open_weights(path).read(stage, "cpu")
    assert sorted(read) == sorted(stage) == sorted(got)


def test_tied_names_give_one_tensor_stored_under_either_name(tmp_path):
    model = built(Tied)
    meta = like(on_meta(Tied))
    for stored, dropped in [("embed.weight", "head.weight"), ("head.weight", "embed.weight")]:
        state = {n: t for n, t in model.state_dict().items() if n != dropped}
        got = open_weights(save_safetensors(state, tmp_path / f"{stored}.safetensors")).read(
            meta, "cpu")
        assert got["head.weight"] is got["embed.weight"]
        torch.testing.assert_close(got["head.weight"], model.embed.weight, rtol=0, atol=0)


def test_a_missing_tensor_names_the_tensor_and_the_file(tmp_path):
    state = built(small).state_dict()
    del state["3.bias"]
    path = save_safetensors(state, tmp_path / "m.safetensors")
    with pytest.raises(PlanFileError, match=r"tensor '3\.bias' is not in .*m\.safetensors"):
        open_weights(path).read(like(on_meta(small)), "cpu")


def test_another_shape_or_dtype_names_the_tensor_and_the_file(tmp_path):
    state = built(small).state_dict()
    meta = like(on_meta(small))
    wide = save_safetensors({**state, "0.bias": torch.zeros(5)}, tmp_path / "wide.safetensors")
    with pytest.raises(PlanFileError, match=r"tensor '0\.bias' in .*wide\.safetensors has "
                                            r"shape \[5\], the model's has \[3\]"):
        open_weights(wide).read(meta, "cpu")
    half = save_safetensors({**state, "0.bias": state["0.bias"].half()},
                            tmp_path / "half.safetensors")
    with pytest.raises(PlanFileError, match=r"tensor '0\.bias' in .*half\.safetensors is "
                                            r"torch\.float16, the model's is torch\.float32"):
        open_weights(half).read(meta, "cpu")
    got = open_weights(half, cast=True).read(meta, "cpu")
    assert got["0.bias"].dtype == torch.float32
    torch.testing.assert_close(got["0.bias"], state["0.bias"].half().float())


def test_a_path_that_does_not_exist_is_refused_by_name(tmp_path):
    with pytest.raises(PlanFileError, match="no checkpoint at .*nowhere.*does not exist"):
        open_weights(tmp_path / "nowhere")


def test_init_per_module_does_not_depend_on_the_grouping_of_reads():
    model = on_meta(small)
    names = list(like(model))
    whole = Init(model, seed=1).read(like(model), "cpu")
    stages = [names[:3], names[3:]]
    parts = {}
    for stage in reversed(stages):           # another grouping, in another order
        parts.update(Init(model, seed=1).read({n: like(model)[n] for n in stage}, "cpu"))
    assert_equal(parts, whole)
    assert not torch.equal(Init(model, seed=2).read(like(model), "cpu")["0.weight"],
                           whole["0.weight"])
    assert model[0].weight.is_meta                   # the model is not touched
    torch.testing.assert_close(whole["1.running_var"], torch.ones(3))


def test_init_per_module_leaves_the_callers_random_state_alone():
    model = on_meta(small)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    Init(model).read(like(model), "cpu")
    torch.testing.assert_close(torch.rand(3), expected)


def test_init_per_module_refuses_a_tensor_with_no_rule_by_name():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    model = on_meta(lambda: nn.Sequential(nn.Linear(3, 3), Scaled()))
    with pytest.raises(PlanFileError, match=r"module '1' \(Scaled\) holds tensors \(1\.scale\)"
                                            r".*reset_parameters.*exact=True"):
        Init(model).read(like(model), "cpu")
    assert set(Init(model).read({"0.weight": model[0].weight}, "cpu")) == {"0.weight"}


def test_init_exact_equals_the_model_built_on_cpu_with_the_seed():
    got = Init(build=Tied, seed=7, exact=True).read(like(on_meta(Tied)), "cpu")
    assert got["head.weight"] is got["embed.weight"]
    assert_equal(got, like(built(Tied, seed=7)))
