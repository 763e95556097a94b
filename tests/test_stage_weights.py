"""A plan saved without weights (a manifest of each stage's tensors) runs with each stage's own
weights, read from a checkpoint or drawn by `Init`, in one process and under torchrun; a
pipeline's trained weights save as a checkpoint the model loads back."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe import DeviceError, PlanFileError
from fxpipe.passes.cost_model import DeviceSpec
from fxpipe.plans.saved import FORMAT, load_stage
from fxpipe.weights import Init


class Tied(nn.Module):
    """An embedding the output layer reads again (tied across stages), a persistent buffer and
    a non-persistent one (as rotary `inv_freq`: computed by its module, in no checkpoint)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.norm = Norm(8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.b(torch.relu(self.a(self.emb(ids))))
        return self.head(self.norm(h))


class Norm(nn.Module):
    """A scale and shift; `shift` a persistent buffer, `scale` a non-persistent one, both
    set by `reset_parameters`."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.register_buffer("shift", torch.zeros(width))
        self.register_buffer("scale", torch.empty(width), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.shift.zero_()
            self.scale.copy_(torch.linspace(0.5, 1.5, self.scale.numel()))

    def forward(self, h):
        return h * self.weight * self.scale + self.shift


def example(seed=0):
    """The model (its persistent buffer given values a fresh model lacks) and a batch."""
    torch.manual_seed(seed)
    model = Tied()
    with torch.no_grad():
        model.norm.shift.copy_(torch.randn(8))
        model.norm.weight.copy_(torch.rand(8) + 0.5)
    return model, torch.randint(0, 20, (8, 5))


def on_meta(plan):
    """`plan` with every tensor its stages and costed graph hold swapped, in place, for a meta
    tensor of its shape and dtype, one for each tensor (tied ones stay tied): what planning a
    model built on meta gives. Plan a copy of the model: the graph may share its modules."""
    metas = {}
    for module in [stage.module for stage in plan.stages] + [plan.graph]:
        for owner in module.modules():
            for table in (owner._parameters, owner._buffers):
                for name, t in table.items():
                    if t is None:
                        continue
                    if id(t) not in metas:       # (a module the graph shares: swapped)
                        empty = torch.empty_like(t, device="meta")
                        meta = (nn.Parameter(empty, t.requires_grad)
                                if isinstance(t, nn.Parameter) else empty)
                        metas[id(t)] = metas[id(meta)] = (t, meta)
                    table[name] = metas[id(t)][1]
    return plan


def planned_on_meta(model, ids, stages=2, **options):
    plan = fxpipe.plan(copy.deepcopy(model), ["cpu"] * stages, (ids,), chunks=2, **options)
    assert len(plan.stages) == stages
    return on_meta(plan)


def checkpoint(model, path):
    """The model's state_dict as one safetensors file (tied weights stored once)."""
    state = {name: t.detach().clone() for name, t in model.state_dict().items()
             if name != "head.weight"}
    save_file(state, str(path))        # the output layer's weight is the embedding's: once
    return path


def assert_runs_as(plan, model, ids):
    pipe = fxpipe.Pipeline(plan)
    with torch.no_grad():
        assert_same_up_to_rounding(pipe(ids), model(ids))
    return pipe


# ---- the manifest -------------------------------------------------------------------------

def test_a_plan_without_weights_saves_a_manifest_and_no_weight_files(tmp_path):
    model, ids = example()
    plan = planned_on_meta(model, ids)
    plan.save(tmp_path / "plan")
    assert sorted(p.name for p in (tmp_path / "plan").glob("*.pt")) == []
    document = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert not [name for name in document["files"] if name.startswith("stage_") and
                name.endswith(".pt")]
    manifest = document["weights"]
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    held = {name for stage in manifest["stages"] for name in stage}
    assert held == set(state)
    for stage in manifest["stages"]:
        for name, entry in stage.items():
            assert entry["shape"] == list(state[name].shape), name
            assert entry["dtype"] == str(state[name].dtype).removeprefix("torch."), name
            assert entry["parameter"] == isinstance(state[name], nn.Parameter), name
            assert entry["persistent"] == (name != "norm.scale"), name
            assert entry["saved"] is False
    # The embedding is tied to the output layer, held by the first and the last stage.
    assert manifest["tied"] == [[[0, "emb.weight"], [1, "head.weight"]]]


def test_a_plan_with_its_weights_saves_them_and_says_so_in_its_manifest(tmp_path):
    model, ids = example()
    plan = fxpipe.plan(model, ["cpu"] * 2, (ids,), chunks=2)
    plan.save(tmp_path / "plan")
    document = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert {"stage_0.pt", "stage_1.pt"} <= set(document["files"])
    assert all(entry["saved"] for stage in document["weights"]["stages"]
               for entry in stage.values())
    loaded = fxpipe.load_plan(tmp_path / "plan")
    pipe = assert_runs_as(loaded, model, ids)
    # The non-persistent buffer stays out of the state, as out of the model's.
    assert set(pipe.state_dict()) == set(model.state_dict())


def test_an_older_plan_is_refused_with_the_fix(tmp_path):
    model, ids = example()
    fxpipe.plan(model, ["cpu"] * 2, (ids,), chunks=2).save(tmp_path / "plan")
    path = tmp_path / "plan" / "plan.json"
    path.write_text(path.read_text().replace(f'"format": {FORMAT}', '"format": 2'))
    with pytest.raises(PlanFileError, match=f"has format 2, this fxpipe reads format {FORMAT}\n"
                                            "save the plan again"):
        fxpipe.load_plan(tmp_path / "plan")


# ---- loading with weights -----------------------------------------------------------------

def test_a_plan_without_weights_is_refused_by_pipeline_naming_both_ways(tmp_path):
    model, ids = example()
    plan = planned_on_meta(model, ids)
    plan.save(tmp_path / "plan")
    for unfilled in (plan, fxpipe.load_plan(tmp_path / "plan")):
        with pytest.raises(fxpipe.DeviceError, match=r"holds '.*' .*on the meta device[\s\S]*"
                                                       r"plan.with_weights\(.*"
                                                r"fxpipe.load_plan\(path, weights="):
            fxpipe.Pipeline(unfilled)


def test_a_saved_plan_loads_its_weights_from_a_safetensors_file(tmp_path):
    model, ids = example()
    planned_on_meta(model, ids).save(tmp_path / "plan")
    plan = fxpipe.load_plan(tmp_path / "plan", model=model,
                            weights=checkpoint(model, tmp_path / "model.safetensors"))
    pipe = assert_runs_as(plan, model, ids)
    torch.testing.assert_close(pipe.state_dict(), model.state_dict())
    # The tied weight is one tensor again, as in the model.
    assert pipe.stages[0].emb.weight is pipe.stages[-1].head.weight


class Recording(fxpipe.weights.Weights):
    """Weights read from `inner`, recording the names each read asks the checkpoint for."""

    def __init__(self, inner):
        self.inner, self.where, self.asked = inner, inner.where, []

    def names(self):
        return self.inner.names()

    def _read(self, like, device):
        self.asked.append(set(like))
        return self.inner._read(like, device)


def test_one_stage_reads_only_its_own_tensors_from_the_checkpoint(tmp_path):
    model, ids = example()
    planned_on_meta(model, ids).save(tmp_path / "plan")
    manifest = json.loads((tmp_path / "plan" / "plan.json").read_text())["weights"]
    weights = Recording(fxpipe.weights.open_weights(checkpoint(model,
                                                               tmp_path / "model.safetensors")))
    stage = load_stage(tmp_path / "plan", 1, weights=weights, model=model)
    # Its persistent tensors, the tied output layer read under the name the checkpoint has.
    own = {name for name, entry in manifest["stages"][1].items() if entry["persistent"]}
    assert weights.asked == [own - {"head.weight"} | {"emb.weight"}]
    with torch.no_grad():
        torch.testing.assert_close(stage.module.get_parameter("head.weight"), model.emb.weight)


def test_a_plan_in_memory_takes_its_weights_leaving_itself_as_it_was(tmp_path):
    model, ids = example()
    plan = planned_on_meta(model, ids)
    filled = plan.with_weights(model.state_dict(), model=model)
    assert_runs_as(filled, model, ids)
    assert all(t.is_meta for stage in plan.stages for t in stage.module.parameters())


def test_a_saved_plan_with_its_weights_takes_a_checkpoint_instead(tmp_path):
    model, ids = example()
    fxpipe.plan(model, ["cpu"] * 2, (ids,), chunks=2).save(tmp_path / "plan")
    other, _ = example(seed=1)
    plan = fxpipe.load_plan(tmp_path / "plan",
                            weights=checkpoint(other, tmp_path / "other.safetensors"))
    assert_runs_as(plan, other, ids)


def test_init_draws_each_module_as_the_model_would_whatever_the_partition():
    model, ids = example()
    two = fxpipe.Pipeline(planned_on_meta(model, ids, 2).with_weights(Init(model, seed=3)))
    three = fxpipe.Pipeline(planned_on_meta(model, ids, 3).with_weights(Init(model, seed=3)))
    torch.testing.assert_close(three.state_dict(), two.state_dict())
    assert not torch.equal(two.state_dict()["a.weight"], model.a.weight)     # drawn, not copied
    # The non-persistent buffer is computed by its module's rule, never left uninitialised.
    torch.testing.assert_close(two.module.get_buffer("norm.scale"), torch.linspace(0.5, 1.5, 8))
    # The model holding those weights computes what the pipeline does.
    drawn = copy.deepcopy(model)
    drawn.load_state_dict(two.state_dict())
    assert_runs_as(planned_on_meta(model, ids, 2).with_weights(Init(model, seed=3)), drawn, ids)
    # weights="init" is Init(model) of seed 0, given the model's structure (built on meta).
    with torch.device("meta"):
        structure = Tied()
    by_name = fxpipe.Pipeline(planned_on_meta(model, ids).with_weights("init", model=structure))
    torch.testing.assert_close(
        by_name.state_dict(),
        fxpipe.Pipeline(planned_on_meta(model, ids).with_weights(Init(model))).state_dict())


def test_a_plan_loads_from_a_sharded_directory_and_a_torch_file(tmp_path):
    model, ids = example()
    planned_on_meta(model, ids).save(tmp_path / "plan")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    pipe = fxpipe.Pipeline(fxpipe.plan(model, ["cpu"] * 2, (ids,), chunks=2))
    pipe.save_weights(tmp_path / "sharded", max_shard_bytes=600)     # several shards
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    for weights in (tmp_path / "sharded", tmp_path / "model.pt"):
        assert_runs_as(fxpipe.load_plan(tmp_path / "plan", model=model, weights=weights),
                       model, ids)


def test_devices_are_remapped_at_load_and_a_stage_too_big_for_its_new_device_refused(tmp_path):
    model, ids = example()
    planned_on_meta(model, ids).save(tmp_path / "plan")
    weights = checkpoint(model, tmp_path / "model.safetensors")
    plan = fxpipe.load_plan(tmp_path / "plan", model=model, weights=weights,
                            devices=[DeviceSpec("cpu", memory_bytes=2 ** 30)] * 2)
    assert_runs_as(plan, model, ids)
    small = [DeviceSpec("cpu", memory_bytes=2 ** 30), DeviceSpec("cpu:1", memory_bytes=64)]
    with pytest.raises(DeviceError, match=r"stage 1 of the plan at .* needs .*; "
                                          r"cpu:1 has 64 B\nthat is the planned need"):
        fxpipe.load_plan(tmp_path / "plan", weights=weights, devices=small)
    with pytest.raises(DeviceError, match=r"stage 1 of this plan needs"):
        planned_on_meta(model, ids).with_weights(weights, devices=small)


@pytest.mark.parametrize("broken, message", [
    ("missing", r"tensor 'b.weight' is not in .*broken.safetensors"),
    ("shape", r"shape of 'b.weight': \[8, 15\] in .*broken.safetensors.*, \[8, 16\] in the "
              r"model"),
    ("dtype", r"tensor 'b.weight' in .*broken.safetensors is torch.float64, the model's is "
              r"torch.float32"),
    ("no file", r"no checkpoint at '.*broken.safetensors'"),
])
def test_a_bad_checkpoint_is_refused_naming_the_tensor_and_the_file(tmp_path, broken, message):
    model, ids = example()
    planned_on_meta(model, ids).save(tmp_path / "plan")
    state = {name: t.clone() for name, t in model.state_dict().items() if name != "head.weight"}
    if broken == "missing":
        del state["b.weight"]
    elif broken == "shape":
        state["b.weight"] = state["b.weight"][:, :15].clone()
    elif broken == "dtype":
        state["b.weight"] = state["b.weight"].double()
    if broken != "no file":
        save_file(state, str(tmp_path / "broken.safetensors"))
    with pytest.raises(PlanFileError, match=message):
        fxpipe.load_plan(tmp_path / "plan", weights=tmp_path / "broken.safetensors")


def test_trained_weights_save_and_load_back_into_the_model(tmp_path):
    model, ids = example()
    target = torch.randn(8, 5, 20)
    pipe = fxpipe.Pipeline(fxpipe.plan(copy.deepcopy(model), ["cpu"] * 2, (ids,), chunks=2,
                                       training=True))
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    for _ in range(3):
        optimizer.zero_grad()
        pipe.train_step(ids, target, F.mse_loss)
        optimizer.step()
    pipe.save_weights(tmp_path / "trained")
    index = json.loads((tmp_path / "trained" / "model.safetensors.index.json").read_text())
    assert "head.weight" not in index["weight_map"]        # the tied weight once
    trained = copy.deepcopy(model)
    trained.load_state_dict(
        fxpipe.weights.open_weights(tmp_path / "trained").read(trained.state_dict(), "cpu"),
        strict=True)
    torch.testing.assert_close(trained.state_dict(), pipe.state_dict())
    assert not torch.equal(trained.a.weight, model.a.weight)       # it trained
    # The checkpoint runs the plan saved without weights, too.
    planned_on_meta(model, ids).save(tmp_path / "plan")
    assert_runs_as(fxpipe.load_plan(tmp_path / "plan", model=model,
                                    weights=tmp_path / "trained"), trained, ids)


# ---- under torchrun -----------------------------------------------------------------------

def ranks(tmp_path, plan, data, mode, processes=2, **env):
    """Run tests/distributed_worker.py on `processes` ranks in `mode` with the environment
    `env` (FXPIPE_WEIGHTS, FXPIPE_MODEL, ...); the folder holding what each rank wrote."""
    from test_distributed import WORKER, torchrun
    out = tmp_path / "out"
    out.mkdir()
    code, text = torchrun([str(WORKER), str(plan), str(data), str(out), mode], processes,
                          {"FXPIPE_TIMEOUT": "30", **env})
    assert code == 0, text[-3000:]
    return out


def test_under_torchrun_each_rank_reads_its_stage_trains_and_saves_its_shard(tmp_path):
    model, ids = example()
    target = torch.randn(8, 5, 20)
    planned_on_meta(model, ids, training=True).save(tmp_path / "plan")
    torch.save({"x": ids, "target": target}, tmp_path / "data.pt")
    out = ranks(tmp_path, tmp_path / "plan", tmp_path / "data.pt", "train",
                FXPIPE_WEIGHTS=str(checkpoint(model, tmp_path / "model.safetensors")),
                FXPIPE_MODEL="test_stage_weights:Tied")
    first, last = (torch.load(out / f"rank{r}.pt") for r in range(2))
    loss = F.mse_loss(model(ids), target)
    loss.backward()
    with torch.no_grad():
        assert_same_up_to_rounding(last["output"], model(ids))
    assert_same_up_to_rounding(last["loss"], loss)
    # Each rank wrote its own shards, rank 0 the index; the model loads them back whole.
    assert len(list((out / "saved").glob("model-*.safetensors"))) == 2
    trained = copy.deepcopy(model)
    trained.load_state_dict(
        fxpipe.weights.open_weights(out / "saved").read(trained.state_dict(), "cpu"),
        strict=True)
    with torch.no_grad():
        assert_same_up_to_rounding(dict(trained.named_parameters()),
                                   {name: p - 0.1 * p.grad for name, p in model.named_parameters()},
                                   what="trained weight")
        torch.testing.assert_close(trained.norm.shift, model.norm.shift)


def test_under_torchrun_a_checkpoint_error_is_named_on_every_rank(tmp_path):
    model, ids = example()
    planned_on_meta(model, ids).save(tmp_path / "plan")
    manifest = json.loads((tmp_path / "plan" / "plan.json").read_text())["weights"]
    tied = {name for held in manifest["tied"] for _, name in held}
    missing = next(name for name, entry in manifest["stages"][-1].items()
                   if entry["persistent"] and name not in tied)
    state = {name: t for name, t in model.state_dict().items()
             if name not in ("head.weight", missing)}
    save_file(state, str(tmp_path / "broken.safetensors"))
    torch.save({"x": ids, "target": torch.randn(8, 5, 20)}, tmp_path / "data.pt")
    out = ranks(tmp_path, tmp_path / "plan", tmp_path / "data.pt", "run",
                FXPIPE_WEIGHTS=str(tmp_path / "broken.safetensors"),
                FXPIPE_MODEL="test_stage_weights:Tied")
    first, last = ((out / f"rank{r}.err").read_text() for r in range(2))
    assert last.startswith(f"PlanFileError: tensor {missing!r} is not in "), last
    assert first.startswith("DistributedError: rank 1 could not load its stage, so rank 0 stops "
                            f"too\nPlanFileError: tensor {missing!r} is not in "), first
    assert all("broken.safetensors" in message for message in (first, last))


class Wide(nn.Module):
    """Eight 2048 x 2048 layers: 134 MB of float32."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])

    def forward(self, x):
        return self.layers(x)


def test_under_torchrun_each_rank_holds_its_stage_not_the_model(tmp_path):
    """Each of 4 ranks reads its quarter of a 134 MB safetensors checkpoint and runs a call:
    its peak resident memory growth stays under 1.5 x its stage's weights + 40 MB (the plan's
    skeleton, the process group, the call's activations and buffers), far under the model's
    134 MB."""
    torch.manual_seed(0)
    model, x = Wide(), torch.randn(4, 2048)
    plan = fxpipe.plan(copy.deepcopy(model), ["cpu"] * 4, (x,), chunks=2, verify=False,
                       link="gloo")
    assert len(plan.stages) == 4
    on_meta(plan).save(tmp_path / "plan")
    save_file({n: t.contiguous() for n, t in model.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    torch.save({"x": x, "target": x}, tmp_path / "data.pt")
    out = ranks(tmp_path, tmp_path / "plan", tmp_path / "data.pt", "memory", processes=4,
                FXPIPE_WEIGHTS=str(tmp_path / "model.safetensors"))
    for r in range(4):
        measured = torch.load(out / f"rank{r}.memory.pt")
        assert measured["stage_bytes"] < model_bytes / 2
        # The weights were read: the call's output on the last rank is the model's.
        assert measured["peak"] >= measured["stage_bytes"] / 2, (r, measured)
        assert measured["peak"] < 1.5 * measured["stage_bytes"] + 40 * 2 ** 20, (r, measured)
    with torch.no_grad():
        assert_same_up_to_rounding(torch.load(out / "rank3.memory.pt")["output"], model(x))
