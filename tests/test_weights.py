"""fxpipe.weights: a stage's tensors read from a checkpoint by name, or drawn by the model's init,
and the model's tensors written as Hugging Face sharded safetensors.

Every read is compared with the model's own tensors; "reads only what is asked" is checked by
counting the files safetensors opens and the tensors it hands out.
"""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from fxpipe.plans.saved import PlanFileError
from fxpipe.weights import INDEX_FILE, Init, open_weights, save_weights, shard_layout


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


FORMATS = ["safetensors", "hf-sharded", "single-file-dir", "torch", "dcp"]


def write(format, state, tmp_path):
    """`state` written in `format` under the directory `tmp_path` (made if needed); the path
    to open."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if format == "safetensors":
        return save_safetensors(state, tmp_path / "m.safetensors")
    if format == "hf-sharded":
        return save_weights(state, tmp_path / "sharded", max_shard_bytes=40)
    if format == "single-file-dir":
        (tmp_path / "single").mkdir()
        save_safetensors(state, tmp_path / "single" / "model.safetensors")
        return tmp_path / "single"
    if format == "torch":
        torch.save(state, tmp_path / "m.pt")
        return tmp_path / "m.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(dict(state), checkpoint_id=tmp_path / "dcp", no_dist=True)
    return tmp_path / "dcp"


def assert_equal(got, want):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("source", ["mapping", *FORMATS])
def test_a_checkpoint_gives_the_models_tensors_on_the_device(source, tmp_path):
    model = built(small)
    state = model.state_dict()
    spec = state if source == "mapping" else write(source, state, tmp_path)
    got = open_weights(spec).read(like(on_meta(small)), "cpu")
    assert_equal(got, state)
    assert all(t.device.type == "cpu" for t in got.values())
    assert not any(t.requires_grad for t in got.values())
    got["0.weight"].add_(1)         # the caller's tensors are not the ones read
    assert not torch.equal(got["0.weight"], model[0].weight)


def test_a_state_dict_of_parameters_gives_plain_tensors():
    model = built(small)
    got = open_weights(model.state_dict(keep_vars=True)).read(like(on_meta(small)), "cpu")
    assert not any(t.requires_grad for t in got.values())
    assert_equal(got, model.state_dict())


@pytest.mark.parametrize("format", ["safetensors", "hf-sharded"])
def test_a_read_opens_and_reads_only_what_holds_the_asked_tensors(format, tmp_path, monkeypatch):
    import safetensors

    path = write(format, built(small).state_dict(), tmp_path)
    weights = open_weights(path)
    read, opened = [], []
    real_open = safetensors.safe_open

    class Counting:
        def __init__(self, file, *args, **kwargs):
            opened.append(file.name)
            self.file = real_open(file, *args, **kwargs)

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
    got = weights.read(stage, "cpu")
    assert sorted(read) == sorted(stage) == sorted(got)
    if format == "hf-sharded":
        index = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        assert len(set(index.values())) > 2
        assert sorted(opened) == sorted({index[name] for name in stage})


def test_tied_names_give_one_tensor_stored_under_either_name(tmp_path):
    model = built(Tied)
    meta = like(on_meta(Tied))
    for stored, dropped in [("embed.weight", "head.weight"), ("head.weight", "embed.weight")]:
        state = {n: t for n, t in model.state_dict().items() if n != dropped}
        got = open_weights(save_safetensors(state, tmp_path / f"{stored}.safetensors")).read(
            meta, "cpu")
        assert got["head.weight"] is got["embed.weight"]
        torch.testing.assert_close(got["head.weight"], model.embed.weight, rtol=0, atol=0)


# the file each format's messages name
NAMED_FILE = {"safetensors": "m.safetensors", "hf-sharded": "model-0000", "single-file-dir":
              "model.safetensors", "torch": "m.pt", "dcp": "dcp"}
MISSING_IN = {**NAMED_FILE, "hf-sharded": INDEX_FILE}


@pytest.mark.parametrize("format", FORMATS)
def test_a_missing_tensor_names_the_tensor_and_the_file(format, tmp_path):
    state = built(small).state_dict()
    del state["3.bias"]
    path = write(format, state, tmp_path)
    with pytest.raises(PlanFileError, match=rf"tensor '3\.bias' is not in \S*{MISSING_IN[format]}"):
        open_weights(path).read(like(on_meta(small)), "cpu")


@pytest.mark.parametrize("format", FORMATS)
def test_another_shape_or_dtype_names_the_tensor_and_the_file(format, tmp_path):
    state = built(small).state_dict()
    meta = like(on_meta(small))
    wide = write(format, {**state, "0.bias": torch.zeros(5)}, tmp_path / "wide")
    with pytest.raises(PlanFileError, match=rf"shape of '0\.bias': \[5\] in \S*{NAMED_FILE[format]}\S*"
                                            rf"( \(.*\))?, \[3\] in the model"):
        open_weights(wide).read(meta, "cpu")
    half = write(format, {**state, "0.bias": state["0.bias"].half()}, tmp_path / "half")
    with pytest.raises(PlanFileError, match=rf"tensor '0\.bias' in \S*{NAMED_FILE[format]}\S* "
                                            rf"(\(.*\) )?is torch\.float16, the model's is "
                                            rf"torch\.float32\nopen the weights with cast=True"):
        open_weights(half).read(meta, "cpu")
    got = open_weights(half, cast=True).read(meta, "cpu")
    assert got["0.bias"].dtype == torch.float32
    torch.testing.assert_close(got["0.bias"], state["0.bias"].half().float(), rtol=0, atol=0)


def test_a_path_that_does_not_exist_is_refused_by_name(tmp_path):
    with pytest.raises(PlanFileError, match="no checkpoint at .*nowhere.*does not exist"):
        open_weights(tmp_path / "nowhere")


def test_a_directory_with_no_checkpoint_is_refused_by_name(tmp_path):
    (tmp_path / "notes.txt").write_text("no tensors here")
    with pytest.raises(PlanFileError, match=rf"no checkpoint in the directory {tmp_path}\nit "
                                            rf"holds none of {INDEX_FILE}"):
        open_weights(tmp_path)


def test_a_file_that_is_not_a_checkpoint_is_refused_by_name(tmp_path):
    (tmp_path / "notes.txt").write_text("no tensors here")
    with pytest.raises(PlanFileError, match="notes.txt is not a checkpoint fxpipe reads"):
        open_weights(tmp_path / "notes.txt")
    torch.save(["not", "a", "state_dict"], tmp_path / "list.pt")
    with pytest.raises(PlanFileError, match="list.pt holds a list, not a state_dict"):
        open_weights(tmp_path / "list.pt")


def test_a_shard_the_index_names_but_that_is_gone_is_refused_by_name(tmp_path):
    path = write("hf-sharded", built(small).state_dict(), tmp_path)
    shard = json.loads((path / INDEX_FILE).read_text())["weight_map"]["3.bias"]
    (path / shard).unlink()
    with pytest.raises(PlanFileError, match=rf"{shard} does not exist; .* names it as holding "
                                            rf"'3\.bias'"):
        open_weights(path).read(like(on_meta(small)), "cpu")


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


def test_init_per_module_runs_the_resets_of_enclosing_modules_as_building_does():
    """nn.MultiheadAttention initialises its own tensors and zeroes its out_proj's bias."""
    def make():
        return nn.Sequential(nn.Linear(4, 8), nn.TransformerEncoderLayer(8, 2, 16))

    model = on_meta(make)
    got = Init(model).read({n: t for n, t in like(model).items() if "self_attn" in n}, "cpu")
    cpu = like(built(make))
    for name in ["1.self_attn.in_proj_bias", "1.self_attn.out_proj.bias"]:
        torch.testing.assert_close(got[name], cpu[name], rtol=0, atol=0)
    bound = (6 / (8 + 24)) ** 0.5                             # xavier_uniform_ on (24, 8)
    assert 0.5 * bound < got["1.self_attn.in_proj_weight"].abs().max() <= bound
    assert_equal(Init(model).read({"1.self_attn.out_proj.weight": like(model)[
        "1.self_attn.out_proj.weight"]}, "cpu"), {"1.self_attn.out_proj.weight": got[
            "1.self_attn.out_proj.weight"]})


def test_init_per_module_refuses_a_tensor_with_no_rule_by_name():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    model = on_meta(lambda: nn.Sequential(nn.Linear(3, 3), Scaled()))
    with pytest.raises(PlanFileError, match=r"module '1' \(Scaled\) has no reset_parameters\(\) "
                                            r"for its tensors\nits tensors: 1\.scale\n"
                                            r".*reset_parameters.*exact=True"):
        Init(model).read(like(model), "cpu")
    assert set(Init(model).read({"0.weight": model[0].weight}, "cpu")) == {"0.weight"}


def test_init_exact_equals_the_model_built_on_cpu_with_the_seed():
    got = Init(build=Tied, seed=7, exact=True).read(like(on_meta(Tied)), "cpu")
    assert got["head.weight"] is got["embed.weight"]
    assert_equal(got, like(built(Tied, seed=7)))


def test_init_draws_a_tied_weight_once_whichever_name_a_stage_holds():
    model = on_meta(Tied)
    whole = Init(model).read(like(model), "cpu")
    assert whole["head.weight"] is whole["embed.weight"]
    head_only = Init(model).read({"head.weight": model.head.weight}, "cpu")
    torch.testing.assert_close(head_only["head.weight"], whole["embed.weight"], rtol=0, atol=0)


def test_init_without_a_model_says_how_to_give_it():
    with pytest.raises(PlanFileError, match=r"Init\(model\) or init\.bind\(model\)"):
        open_weights("init").read(like(on_meta(small)), "cpu")
    model = on_meta(small)
    assert set(open_weights("init").bind(model).read(like(model), "cpu")) == set(like(model))
    with pytest.raises(PlanFileError, match=r"Init\(exact=True\) builds the model on CPU"):
        Init(model, exact=True)


def llama_config():
    import transformers

    return transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=32, vocab_size=64, use_cache=False,
        tie_word_embeddings=True)


def llama():
    import transformers

    return transformers.LlamaForCausalLM(llama_config())


def test_init_per_module_on_a_hugging_face_llama_follows_its_init_weights():
    model = on_meta(llama)
    got = Init(model, seed=3).read(like(model), "cpu")
    cpu = like(built(llama))
    assert set(got) == set(cpu)
    for name in ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]:
        torch.testing.assert_close(got[name], cpu[name], rtol=0, atol=0)
    torch.testing.assert_close(got["model.norm.weight"], torch.ones(32), rtol=0, atol=0)
    assert got["lm_head.weight"] is got["model.embed_tokens.weight"]
    std = got["model.layers.1.mlp.up_proj.weight"].std().item()   # normal(0, initializer_range)
    assert abs(std - llama_config().initializer_range) < 0.004


def test_init_exact_on_a_hugging_face_llama_equals_the_model_built_on_cpu():
    got = Init(build=llama, seed=4, exact=True).read(like(on_meta(llama)), "cpu")
    assert_equal(got, like(built(llama, seed=4)))


def test_save_weights_loads_back_into_the_model_strictly(tmp_path):
    model = built(Tied)
    save_weights(model.state_dict(), tmp_path, max_shard_bytes=100)
    other = built(Tied, seed=1)
    other.load_state_dict(open_weights(tmp_path).read(other.state_dict(), "cpu"), strict=True)
    assert_equal(other.state_dict(), model.state_dict())
    assert other.head.weight is other.embed.weight
    stored = {}
    for shard in tmp_path.glob("model-*.safetensors"):
        stored.update(load_file(shard))
    assert "head.weight" not in stored                               # a tied tensor once
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    other.load_state_dict({**stored, **{name: stored[first] for name, first in
                                        index["metadata"]["tied"].items()}}, strict=True)
    assert_equal(other.state_dict(), model.state_dict())


def test_save_weights_writes_a_correct_index_over_several_shards(tmp_path):
    state = built(small).state_dict()
    save_weights(state, tmp_path, max_shard_bytes=40)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 5      # 48 | 12 12 12 | 12 12 8 | 48 | 16 bytes
    assert files == sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    for file in files:
        shard = load_file(tmp_path / file)
        assert sorted(shard) == sorted(n for n, f in index["weight_map"].items() if f == file)
        sizes = [t.numel() * t.element_size() for t in shard.values()]
        assert sum(sizes) <= 40 or len(sizes) == 1
        assert_equal(shard, {name: state[name] for name in shard})
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in state.values())


def test_each_writer_writes_its_own_shards_and_one_the_index(tmp_path):
    """As torchrun ranks do: the layout from every stage's (meta) tensors, each stage's real
    tensors given only to its own writer; a tied weight held by two stages stored once."""
    model = built(Tied)
    meta = on_meta(Tied)
    stages_meta = [{"embed.weight": meta.embed.weight},
                   {"norm.weight": meta.norm.weight, "norm.bias": meta.norm.bias,
                    "embed.weight": meta.embed.weight}]
    layout = shard_layout(stages_meta, max_shard_bytes=1000, tied={"head.weight": "embed.weight"})
    state = model.state_dict()
    for group, stage in reversed(list(enumerate(stages_meta))):
        save_weights({name: state[name] for name in stage}, tmp_path, layout=layout,
                     group=group, write_index=group == 0)
        assert (tmp_path / INDEX_FILE).exists() == (group == 0)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(load_file(tmp_path / "model-00002-of-00002.safetensors")) == [
        "norm.bias", "norm.weight"]
    assert_equal(open_weights(tmp_path).read(dict(state), "cpu"), state)
    with pytest.raises(PlanFileError, match=r"tensor 'norm\.bias' was not given to this "
                                            r"save_weights call"):
        save_weights({"norm.weight": state["norm.weight"]}, tmp_path, layout=layout, group=1)


def test_save_weights_is_read_by_hugging_face_from_pretrained(tmp_path):
    import transformers

    model = built(llama)
    save_weights(model.state_dict(), tmp_path, max_shard_bytes=20_000)
    assert len(set(json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"].values())) > 2
    llama_config().save_pretrained(tmp_path)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert_equal(back.state_dict(), model.state_dict())


def test_a_hugging_face_checkpoint_is_read_per_stage(tmp_path):
    model = built(llama)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / INDEX_FILE).exists()
    meta = like(on_meta(llama))
    stage = {name: t for name, t in meta.items()
             if ".layers.1." in name or name in ("lm_head.weight", "model.embed_tokens.weight")}
    got = open_weights(tmp_path).read(stage, "cpu")
    assert_equal(got, {name: like(model)[name] for name in stage})
    with pytest.raises(PlanFileError, match=r"tensor 'lm_head.weight' is not in [\s\S]*A tied weight "
                                            "stored once is found when the tensors asked share"):
        open_weights(tmp_path).read({"lm_head.weight": meta["lm_head.weight"]}, "cpu")


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]


@st.composite
def state_dicts(draw):
    names = draw(st.lists(st.lists(st.sampled_from(["a", "b", "layers", "0", "1", "weight"]),
                                   min_size=1, max_size=4).map(".".join),
                          min_size=1, max_size=6, unique=True))
    state = {}
    for name in names:
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        dtype = draw(st.sampled_from(DTYPES))
        state[name] = (torch.rand(shape) * 100).to(dtype)
    return state


@settings(max_examples=40, deadline=None)
@given(state=state_dicts(), max_shard_bytes=st.integers(1, 64))
def test_names_shapes_and_dtypes_round_trip_through_save_and_open(state, max_shard_bytes):
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        save_weights(state, directory, max_shard_bytes=max_shard_bytes)
        meta = {name: torch.empty_like(t, device="meta") for name, t in state.items()}
        got = open_weights(directory).read(meta, "cpu")
    assert_equal(got, state)
    assert all(got[name].dtype == t.dtype for name, t in state.items())


class SlowInit(nn.Module):
    """Its rule draws twice, sleeping between (another thread runs meanwhile)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(2, 4))

    def reset_parameters(self):
        with torch.no_grad():
            self.weight[0].uniform_()
            time.sleep(0.02)
            self.weight[1].uniform_()


def test_init_gives_the_same_values_when_stages_draw_on_threads_at_once():
    from concurrent.futures import ThreadPoolExecutor

    model = on_meta(lambda: nn.Sequential(*[SlowInit() for _ in range(4)]))
    whole = Init(model).read(like(model), "cpu")
    with ThreadPoolExecutor(4) as pool:
        parts = list(pool.map(lambda name: Init(model).read({name: like(model)[name]}, "cpu"),
                              like(model)))
    assert_equal({n: t for part in parts for n, t in part.items()}, whole)


@settings(max_examples=25, deadline=None)
@given(stage_of=st.lists(st.integers(0, 3), min_size=9, max_size=9), data=st.data())
def test_init_per_module_values_do_not_depend_on_the_partition(stage_of, data):
    model = on_meta(small)
    names = list(like(model))
    order = data.draw(st.permutations(sorted(set(stage_of))))
    got = {}
    for stage in order:
        got.update(Init(model, seed=9).read(
            {n: like(model)[n] for n, s in zip(names, stage_of) if s == stage}, "cpu"))
    assert_equal(got, Init(model, seed=9).read(like(model), "cpu"))


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.lists(st.integers(0, 40), max_size=5), min_size=1, max_size=4),
       max_shard_bytes=st.integers(1, 60))
def test_a_layout_stores_each_tensor_once_in_its_own_groups_shards(sizes, max_shard_bytes):
    groups = [{f"g{g}.t{k}": torch.empty(size, dtype=torch.uint8, device="meta")
               for k, size in enumerate(group)} for g, group in enumerate(sizes)]
    layout = shard_layout(groups, max_shard_bytes=max_shard_bytes)
    assert set(layout.files) == {name for group in groups for name in group}
    assert [f for files in layout.shards for f in files] == sorted(set(layout.files.values()))
    for g, group in enumerate(groups):
        assert {layout.files[name] for name in group} <= set(layout.shards[g])
    for file in layout.files.values():
        held = [groups[int(n[1])][n].numel() for n, f in layout.files.items() if f == file]
        assert sum(held) <= max_shard_bytes or len(held) == 1
    assert layout.total_size == sum(map(sum, sizes))
