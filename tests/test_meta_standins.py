"""Planning never needs an init rule: a model built on meta whose modules have none (a custom
RMSNorm holding `nn.Parameter(torch.ones(d))` and no `reset_parameters()`, as torchtitan and the
Llama reference code write it) is timed and checked on stand-in values, the plan names them,
and only running the plan needs the real ones (a checkpoint); `weights="init"` at load still
refuses them by name. A model whose autocast regions meta tensors do not see is captured on
fake tensors of the planned device type.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.passes.codegen import with_tensors
from fxpipe.passes.errors import PlanFileError
from fxpipe.passes.capture import trace
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.weights import Init, build_on_meta, open_weights, save_weights, stand_in_

VOCAB, WIDTH, LAYERS, HEADS = 256, 64, 4, 4


class RMSNorm(nn.Module):
    """As the Llama reference code writes it: ones, and no reset_parameters()."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.silu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block(WIDTH, HEADS) for _ in range(LAYERS))
        self.norm = RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


NORMS = tuple([f"layers.{i}.norm{j}.weight" for i in range(LAYERS) for j in (1, 2)] +
              ["norm.weight"])
DEVICES = [fxpipe.DeviceSpec(f"cpu:{i}", memory_bytes=400e6) for i in range(4)]


def on_meta() -> Decoder:
    with torch.device("meta"):
        return Decoder().eval()


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def planned():
    """The decoder built on meta and its plan, made without weights."""
    model = on_meta()
    return model, fxpipe.plan(model, DEVICES, example_inputs=(ids(),), chunks=2)


def test_a_decoder_whose_norms_have_no_init_rule_plans_on_meta_naming_its_stand_ins(planned):
    model, plan = planned
    assert len(plan.stages) == 4 and plan.record.verified == "yes"
    assert plan.record.stand_ins == NORMS
    assert all(t.is_meta for t in model.parameters())        # the model is never touched
    shown = [line for line in str(plan).splitlines() if "stand-in" in line]
    assert len(shown) == 1
    assert shown[0].startswith("timed and checked on stand-in values")
    assert "layers.*.norm1.weight (4 tensors), layers.*.norm2.weight (4 tensors), " \
           "norm.weight" in shown[0]


def test_the_saved_plan_keeps_its_stand_ins_and_runs_from_a_safetensors_checkpoint(
        planned, tmp_path):
    model, plan = planned
    torch.manual_seed(1)
    real = Decoder().eval()
    with torch.no_grad():        # norms unlike the stand-ins' ones: a leak would show
        for name in NORMS:
            real.get_parameter(name).normal_(1.0, 0.2)
    save_weights(real.state_dict(), tmp_path / "ckpt")
    saved = plan.save(tmp_path / "plan")
    assert json.loads((saved / "plan.json").read_text())["stand_ins"] == list(NORMS)
    loaded = fxpipe.load_plan(saved, model, weights=tmp_path / "ckpt")
    assert loaded.record.stand_ins == NORMS
    x = ids()
    with torch.no_grad():
        got, want = fxpipe.Pipeline(loaded)(x), real(x)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)


def test_weights_init_at_load_refuses_the_norm_weight_by_name_with_the_fix(planned, tmp_path):
    model, plan = planned
    fixes = r"reset_parameters\(\).*checkpoint.*Init\(build=\.\.\., exact=True\)"
    with pytest.raises(PlanFileError, match=r"(?s)layers\.0\.norm1\.weight.*" + fixes):
        plan.with_weights("init", model=model)
    with pytest.raises(PlanFileError, match=r"(?s)layers\.0\.norm1\.weight.*" + fixes):
        fxpipe.load_plan(plan.save(tmp_path / "plan"), model, weights="init")
    with pytest.raises(PlanFileError, match=r"(?s)norm\.weight.*" + fixes):
        Init(model).read({"norm.weight": model.norm.weight}, "cpu")


def test_init_exact_gives_the_norms_their_values_at_load(planned):
    model, plan = planned
    x = ids()
    pipe = fxpipe.Pipeline(plan.with_weights(Init(build=Decoder, seed=3, exact=True)))
    torch.manual_seed(3)
    real = Decoder().eval()
    with torch.no_grad():
        got, want = pipe(x), real(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


class HalfInitialised(nn.Module):
    """Its reset_parameters() writes the weight and leaves the buffer unwritten."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 4))
        self.register_buffer("gain", torch.empty(8))

    def reset_parameters(self):
        nn.init.zeros_(self.weight)

    def forward(self, x):
        return x @ self.weight.t() * self.gain


def test_stand_ins_fill_only_what_no_rule_writes_the_same_on_every_read():
    with torch.device("meta"):
        model = HalfInitialised()
    like = {"weight": model.weight, "gain": model.gain}
    with pytest.raises(PlanFileError, match=r"(?s)'gain'.*unwritten.*reset_parameters\(\)"):
        Init(model).read(like, "cpu")
    planning = Init(model, stand_ins=True)
    first, second = planning.read(like, "cpu"), planning.read(like, "cpu")
    assert torch.equal(first["weight"], torch.zeros(8, 4))       # the rule's values
    assert torch.equal(first["gain"], torch.ones(8)) and torch.equal(second["gain"], first["gain"])
    assert planning.stood_in == {"gain"}


def test_a_stand_in_has_a_plausible_scale_for_its_role():
    torch.manual_seed(0)
    assert torch.equal(stand_in_(torch.empty(16), "weight"), torch.ones(16))
    assert torch.equal(stand_in_(torch.empty(16), "bias"), torch.zeros(16))
    assert torch.equal(stand_in_(torch.empty(3, dtype=torch.int64), "index"),
                       torch.zeros(3, dtype=torch.int64))
    matrix = stand_in_(torch.empty(512, 1024), "weight")
    assert abs(matrix.std().item() - 1024 ** -0.5) < 0.05 * 1024 ** -0.5
    assert abs(matrix.mean().item()) < 1e-3
    conv = stand_in_(torch.empty(64, 8, 3, 3, dtype=torch.bfloat16), "weight")
    assert conv.dtype == torch.bfloat16 and abs(conv.float().std().item() * 72 ** 0.5 - 1) < 0.1


def test_a_plan_made_from_a_checkpoint_names_no_stand_ins(tmp_path):
    torch.manual_seed(0)
    save_weights(Decoder().state_dict(), tmp_path / "ckpt")
    plan = fxpipe.plan(on_meta(), ["cpu:0", "cpu:1"], example_inputs=(ids(),), chunks=2,
                       weights=tmp_path / "ckpt", verify=False)
    assert plan.record.stand_ins == ()
    assert "stand-in" not in str(plan)


# ---- under torchrun: 4 ranks, each reading its stage from the checkpoint ---------------------

def real_decoder(cls=None, seed: int = 1) -> nn.Module:
    """The model built on CPU, its norms unlike the stand-ins' ones (a leak would show)."""
    torch.manual_seed(seed)
    real = (cls or Decoder)().eval()
    with torch.no_grad():
        for name in NORMS:
            real.get_parameter(name).normal_(1.0, 0.2)
    return real


def on_ranks(tmp_path, plan_dir, checkpoint, x, **env) -> list[Path]:
    """Run tests/distributed_worker.py on 4 ranks with the plan saved at `plan_dir`, each
    reading its stage from `checkpoint` (`env`: FXPIPE_MODEL, ...); each rank's result file
    (rank<r>.pt, or rank<r>.err where it met an FxpipeError)."""
    from test_distributed import WORKER, torchrun
    torch.save({"x": x, "target": torch.randn(*x.shape, VOCAB)}, tmp_path / "data.pt")
    out = tmp_path / "out"
    out.mkdir()
    code, text = torchrun([str(WORKER), str(plan_dir), str(tmp_path / "data.pt"), str(out),
                           "call"], 4, {"FXPIPE_TIMEOUT": "30",
                                        "FXPIPE_WEIGHTS": str(checkpoint), **env})
    assert code == 0, text[-3000:]
    return [next(out.glob(f"rank{r}.*")) for r in range(4)]


def test_under_torchrun_four_ranks_run_the_meta_plan_from_a_safetensors_checkpoint(
        planned, tmp_path):
    """The decoder planned on meta (its norms stand-ins), saved without weights, run by 4 ranks
    on cpu:0..cpu:3, each reading its own stage's tensors from the checkpoint: the last rank's
    output is the model's, built on CPU with the checkpoint's values."""
    model, plan = planned
    real = real_decoder()
    save_weights(real.state_dict(), tmp_path / "ckpt")
    saved = plan.save(tmp_path / "plan")
    x = ids()
    files = on_ranks(tmp_path, saved, tmp_path / "ckpt", x)
    assert [f.suffix for f in files] == [".pt"] * 4, [f.read_text() for f in files
                                                      if f.suffix == ".err"]
    results = [torch.load(f) for f in files]
    assert [r["output"] is None for r in results] == [True, True, True, False]
    with torch.no_grad():
        assert_same_up_to_rounding(results[-1]["output"], real(x))


# ---- non-persistent buffers computed in __init__ (no checkpoint holds them) ------------------

class RopeDecoder(Decoder):
    """The decoder with rotary frequencies as plain-torch decoders register them: computed in
    `__init__`, `persistent=False` (no checkpoint holds them), and no rule to compute them
    again. The model built on meta holds them as meta tensors."""

    def __init__(self):
        super().__init__()
        half = WIDTH // HEADS // 2
        inv_freq = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", torch.outer(torch.arange(16.0), inv_freq),
                             persistent=False)

    def forward(self, ids):
        rotation = torch.cos(self.freqs[: ids.shape[1]]).repeat(1, 2 * HEADS)
        h = self.embed(ids) * rotation
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def rope_structure() -> RopeDecoder:
    """What the torchrun worker builds as `model=` (FXPIPE_MODEL)."""
    return build_on_meta(RopeDecoder).eval()


@pytest.fixture(scope="module")
def rope_checkpoint(tmp_path_factory):
    real = real_decoder(RopeDecoder)
    path = save_weights(real.state_dict(), tmp_path_factory.mktemp("rope") / "ckpt")
    assert "freqs" not in real.state_dict()
    return real, path


def assert_runs_as(plan: fxpipe.Plan, real: nn.Module) -> None:
    x = ids()
    with torch.no_grad():
        assert_same_up_to_rounding(fxpipe.Pipeline(plan)(x), real(x))


def test_a_buffer_computed_in_init_is_refused_at_load_by_name_with_a_fix_that_works(
        rope_checkpoint, tmp_path):
    real, checkpoint = rope_checkpoint
    with torch.device("meta"):
        model = RopeDecoder().eval()
    plan = fxpipe.plan(model, DEVICES, example_inputs=(ids(),), chunks=2)
    assert plan.record.stand_ins == (*NORMS, "freqs")      # planning is fine with a stand-in
    saved = plan.save(tmp_path / "plan")
    refused = r"(?s)^buffer 'freqs' \(RopeDecoder\) has no value.*not persistent.*" \
              r"fxpipe\.weights\.build_on_meta\(make_model\).*model="
    for attempt in [lambda: fxpipe.load_plan(saved, weights=checkpoint),
                    lambda: fxpipe.load_plan(saved, model, weights=checkpoint),
                    lambda: plan.with_weights(checkpoint, model=model)]:
        with pytest.raises(PlanFileError, match=refused.replace("RopeDecoder", r"\w+")):
            attempt()
    with pytest.raises(PlanFileError, match=refused):
        Init(model).read({"freqs": model.freqs}, "cpu")
    # The fix: the model's structure with its buffers computed, as model= at load.
    structure = build_on_meta(RopeDecoder)
    assert structure.freqs.device.type == "cpu" and torch.equal(structure.freqs, real.freqs)
    assert all(p.is_meta for p in structure.parameters())
    assert_runs_as(fxpipe.load_plan(saved, structure, weights=checkpoint), real)
    assert_runs_as(plan.with_weights(checkpoint, model=structure), real)


def test_a_model_built_on_meta_with_its_buffers_computed_plans_a_plan_that_holds_them(
        rope_checkpoint, tmp_path):
    """Planned from `build_on_meta`, the plan holds the buffer's values (no stand-in for it)
    and loads from the checkpoint alone."""
    real, checkpoint = rope_checkpoint
    plan = fxpipe.plan(rope_structure(), DEVICES, example_inputs=(ids(),), chunks=2)
    assert plan.record.stand_ins == NORMS
    saved = plan.save(tmp_path / "plan")
    entries = {name: entry for stage in json.loads((saved / "plan.json").read_text())[
        "weights"]["stages"] for name, entry in stage.items()}
    assert entries["freqs"]["saved"] and not entries["freqs"]["persistent"]
    assert_runs_as(fxpipe.load_plan(saved, weights=checkpoint), real)


def test_init_built_gives_a_buffer_computed_in_init_its_value(rope_checkpoint):
    real, _ = rope_checkpoint
    got = Init(build=RopeDecoder).read({"freqs": torch.empty(16, 8, device="meta")}, "cpu")
    assert torch.equal(got["freqs"], real.freqs)


@pytest.mark.slow     # the rule's one-process tests run in make test; this adds the ranks' path
def test_under_torchrun_a_buffer_computed_in_init_comes_from_the_model_given(
        rope_checkpoint, tmp_path):
    """A plan made on meta, run by 4 ranks given `model=build_on_meta(RopeDecoder)`: each rank
    computes the buffer from it, and the output is the model's."""
    real, checkpoint = rope_checkpoint
    with torch.device("meta"):
        model = RopeDecoder().eval()
    saved = fxpipe.plan(model, DEVICES, example_inputs=(ids(),), chunks=2).save(tmp_path / "p")
    x = ids()
    files = on_ranks(tmp_path, saved, checkpoint, x,
                     FXPIPE_MODEL="test_meta_standins:rope_structure")
    assert [f.suffix for f in files] == [".pt"] * 4, [f.read_text() for f in files
                                                      if f.suffix == ".err"]
    with torch.no_grad():
        assert_same_up_to_rounding(torch.load(files[-1])["output"], real(x))


# ---- capture on fake tensors where meta alone fails ----------------------------------------------

class Mixed(nn.Module):
    """Linear layers under autocast, each output scaled by a gate cast to its dtype.
    `own_device`: the region names the input's device type (on meta, "meta": autocast refuses
    it, so export on meta fails); otherwise "cpu" (export on meta succeeds, but meta tensors do
    not autocast: the dtype the gate is cast to, read off the region's output and baked into
    the graph, would be float32 instead of bfloat16). The gate has no init rule: a stand-in."""

    def __init__(self, own_device: bool, width: int = 32, layers: int = 4):
        super().__init__()
        self.own_device = own_device
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.gate = nn.Parameter(torch.full((width,), 0.3))

    def forward(self, x):
        for layer in self.layers:
            with torch.autocast(x.device.type if self.own_device else "cpu",
                                dtype=torch.bfloat16):
                h = layer(x)
            x = x + torch.tanh(h * self.gate.to(h.dtype)).float()
        return x


@pytest.mark.parametrize("own_device", [False, True], ids=["cpu-region", "input-device-region"])
def test_a_model_autocasting_on_meta_is_captured_on_fake_tensors_and_runs_as_the_model(
        own_device, tmp_path):
    torch.manual_seed(0)
    real = Mixed(own_device).eval()
    save_weights(real.state_dict(), tmp_path / "ckpt")
    with torch.device("meta"):
        model = Mixed(own_device).eval()
    x = torch.randn(8, 32)
    plan = fxpipe.plan(model, ["cpu:0", "cpu:1"], example_inputs=(x,), chunks=2)
    assert plan.capture.method == "export" and plan.capture.fake == "cpu"
    assert "on fake cpu tensors" in str(plan) and plan.record.verified == "yes"
    assert plan.record.stand_ins == ("gate",)
    # given its values in memory: a stage pickled (plan.save, plan.with_weights) is traced
    # again from its code as it loads, which inlines export's autocast regions
    with torch.no_grad():
        got, want = fxpipe.Pipeline(given(plan, tmp_path / "ckpt"))(x), real(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def given(plan: fxpipe.Plan, checkpoint) -> fxpipe.Plan:
    """`plan` (its stages on the CPU) with its tensors' values read from `checkpoint`, in
    memory: a tensor several stages hold (the gate) read once, one tensor in all of them."""
    named = {name: t for stage in plan.stages
             for name, t in [*stage.module.named_parameters(remove_duplicate=False),
                             *stage.module.named_buffers(remove_duplicate=False)]}
    values = open_weights(checkpoint).read(named, "cpu")
    by_id = {id(t): nn.Parameter(values[name], requires_grad=t.requires_grad)
             if isinstance(t, nn.Parameter) else values[name] for name, t in named.items()}
    return dataclasses.replace(plan, graph=None, stages=tuple(
        dataclasses.replace(stage, module=with_tensors(stage.module, lambda t: by_id[id(t)]))
        for stage in plan.stages))


def test_fx_refuses_an_enabled_autocast_region_by_its_line_and_export_keeps_it():
    with torch.device("meta"):
        model = Mixed(own_device=False)
    with pytest.raises(fxpipe.TraceError, match=r"torch\.autocast \(at .*test_meta_standins"
                                                r"\.py:\d+: with torch\.autocast"):
        trace(model, (torch.randn(8, 32),), capture="fx")
    gm = trace(model, (torch.randn(8, 32),))
    assert "torch.fx failed: forward runs ops under torch.autocast" in str(gm.meta["capture"])
    assert all(t.is_meta for t in gm.parameters())
    assert gm.get_parameter("layers.0.weight") is model.layers[0].weight


class Unautocast(nn.Module):
    """A disabled region (as Hugging Face's rotary embeddings force float32) changes nothing:
    fx keeps the model."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return self.layer(x).float()


def test_a_disabled_autocast_region_stays_with_fx():
    assert trace(Unautocast(), (torch.randn(2, 8),)).meta["capture"].method == "fx"
