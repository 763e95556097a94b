"""Planning generation (`fxpipe.planning.generation`): from the meta device, with each stage's
KV bytes exact; the lanes chosen on the decode costs (or taken as asked), never a lane count
that does not fit; the model as is where no pipeline decodes faster."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fxpipe
from fxpipe.generate import GenerationError, load_generation, plan_generation, save_generation
from fxpipe.planning import measure
from fxpipe.planning.generation import (LaneOption, LanesError, choose_lanes, decode_step_s)
from fxpipe.passes.cost_model import NodeCost
from fxpipe.weights import build_on_meta

FAST = dict(capture="export", repeats=1, verify=False)
CONFIG = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=1000)


@pytest.fixture
def scripted(monkeypatch):
    from conftest import script_costs
    return script_costs(monkeypatch)


def kv_bytes_by_hand(layers: int, rows: int, heads: int, length: int, head_dim: int,
                     itemsize: int) -> int:
    """A stage's key/value cache: its layers x rows x heads x length x head dim x bytes, for
    the keys and again for the values."""
    return layers * rows * heads * length * head_dim * itemsize * 2


def test_a_model_on_meta_gets_a_generation_plan_with_exact_kv_bytes_and_runs_from_a_checkpoint(
        scripted, tmp_path):
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    on_meta = build_on_meta(lambda: LlamaForCausalLM(config)).eval()
    generation = plan_generation(on_meta, ["cpu", "cpu"], rows=4, prompt=8, length=24, lanes=2,
                                 **FAST)
    try:
        # Each stage holds whole keys or values buffers of its layers (a layer's keys and values
        # may sit in two stages): rows x heads x length x head dim x 4 bytes each.
        one = kv_bytes_by_hand(1, 4, 2, 24, 64 // 4, 4) // 2
        want = [len(state.planned) * one for state in generation.states]
        assert sum(want) == kv_bytes_by_hand(3, 4, 2, 24, 64 // 4, 4) and all(want)
        assert generation.kv_predicted == want and generation.kv_bytes() == want
        text = str(generation)
        assert "4 sequences of up to 24 tokens" in text and "2 lanes" in text, text
        with pytest.raises(GenerationError, match="planned on meta"):
            generation.generate(input_ids=torch.ones((4, 8), dtype=torch.long),
                                max_new_tokens=4)
        save_generation(generation, tmp_path / "gen")
    finally:
        generation.close()
    assert all(p.is_meta for p in on_meta.parameters())         # planning held no weight
    loaded = load_generation(tmp_path / "gen", weights=model.state_dict())
    try:
        ids = torch.randint(1, 1000, (4, 8), generator=torch.Generator().manual_seed(1))
        kwargs = dict(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(loaded.generate(**kwargs), model.generate(**kwargs))
    finally:
        loaded.close()


def test_the_cli_plans_generation_from_meta_printing_each_stages_kv_bytes(scripted, tmp_path,
                                                                          capsys):
    from fxpipe.__main__ import main
    from fxpipe.passes.cost_model import format_bytes
    LlamaConfig(**CONFIG).to_json_file(tmp_path / "config.json")
    assert main(["plan", "transformers:AutoModelForCausalLM", "--config",
                 str(tmp_path / "config.json"), "--meta", "--dtype", "bf16", "--tokens", "2x4",
                 "--generate", "16", "--chunks", "2", "--capture", "export", "--no-verify",
                 "--quiet", "--devices", "cpu,cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fxpipe generation plan: 2 sequences of up to 16 tokens") and \
        "2 lanes" in out, out
    total = kv_bytes_by_hand(3, 2, 2, 16, 16, 2)           # bf16: 2 bytes
    assert f"key/value cache: {format_bytes(total)} in all" in out, out
    one = total // 6                                  # a layer's keys, or its values
    stages = [line.split() for line in out.splitlines() if line.split()[:2] in
              (["0", "cpu"], ["1", "cpu"])]
    assert len(stages) == 2 and all(" ".join(row[3:5]) in {format_bytes(k * one)
                                                           for k in range(1, 6)}
                                    for row in stages), out


# --- the lanes ---------------------------------------------------------------------------------

def test_a_decode_step_of_lanes_on_their_own_is_one_trip_or_the_slowest_stage_on_every_lane():
    assert decode_step_s([1.0, 1.0], 1) == 2.0
    assert decode_step_s([1.0, 3.0], 4) == 4 * 3.0      # the slowest stage busy throughout
    assert decode_step_s([3.0, 3.0, 3.0], 2) == 9.0     # a lane's trip outlasts both lanes' work
    assert decode_step_s([2.0], 3) == 6.0               # one stage: the lanes one after the other
    # Each lane's loop chooses its next token after its trip, and the loops take turns.
    assert decode_step_s([1.0, 1.0], 1, loop_s=0.5) == 2.5
    assert decode_step_s([1.0, 1.0], 2, loop_s=0.5) == 2.5
    assert decode_step_s([1.0, 1.0], 4, loop_s=1.5) == 4 * 1.5


def test_lanes_whose_loops_cost_more_than_they_gain_are_not_chosen():
    linear = [LaneOption(1, (4.0, 4.0, 4.0)), LaneOption(2, (2.0, 2.0, 2.0)),
              LaneOption(4, (1.0, 1.0, 1.0))]
    assert choose_lanes(4, linear).lanes == 4
    # A loop of 3.5 s a token on any lane: 4 lanes' loops take 14 s, 2 lanes' rounds 9.5.
    looped = [replace(o, loop_s=3.5) for o in linear]
    choice = choose_lanes(4, looped)
    assert choice.lanes == 2 and choice.step_s(2) == 9.5 and choice.step_s(4) == 14.0


def test_lanes_slower_than_the_models_step_and_loop_give_the_model_as_is():
    from types import SimpleNamespace
    from fxpipe.planning.generation import slower_than_the_model
    choice = choose_lanes(4, [LaneOption(2, (2.0, 2.0), loop_s=0.5)], asked=2)   # 4.5 s a step
    plan = SimpleNamespace(runs_as_is=False, record=SimpleNamespace(unpipelined_s=4.0))
    why = slower_than_the_model(plan, choice, 0.25)
    assert "(4.25e+03 ms) is faster than 2 lanes' predicted (4.5e+03 ms)" in why, why
    assert slower_than_the_model(plan, choice, 0.5) == ""           # 4.5 against 4.5: the lanes
    plan.record.unpipelined_s = None                                # not measured: the lanes
    assert slower_than_the_model(plan, choice, 0.25) == ""


def test_the_choice_follows_the_prediction():
    # A step that only reads weights: a lane of 2 rows costs what 4 rows cost; one lane wins.
    flat = [LaneOption(1, (1.0, 1.0)), LaneOption(2, (0.99, 0.99)), LaneOption(4, (0.98, 0.98))]
    assert choose_lanes(4, flat).lanes == 1
    # A step whose time follows its rows, on 3 stages: 4 lanes take 4 units, 2 take 6, 1 takes 12.
    linear = [LaneOption(1, (4.0, 4.0, 4.0)), LaneOption(2, (2.0, 2.0, 2.0)),
              LaneOption(4, (1.0, 1.0, 1.0))]
    choice = choose_lanes(4, linear)
    assert choice.lanes == 4 and choice.tokens_per_s() == 4 / 4.0
    assert choice.bound(4) == 4.0
    assert "4 lanes: 1 tokens/s predicted, T(4)/T(1) = 4.00" in "\n".join(choice.lines())


def test_a_lane_count_that_does_not_fit_is_not_chosen():
    options = [LaneOption(1, (4.0, 4.0)), LaneOption(2, (2.0, 2.0)),
               LaneOption(4, (1.0, 1.0), problem="stage 0 needs 9 GB, the device holds 8 GB")]
    choice = choose_lanes(4, options)
    assert choice.lanes == 2 and "4 lanes do not fit" in choice.reason
    assert "does not fit: stage 0 needs 9 GB" in "\n".join(choice.lines())
    with pytest.raises(LanesError, match="no number of lanes fits"):
        choose_lanes(4, [LaneOption(1, (), problem="too big")])


def test_the_users_lanes_are_taken(scripted):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    generation = plan_generation(model, ["cpu", "cpu"], rows=4, prompt=4, length=12, lanes=2,
                                 **FAST)
    try:
        assert generation.lanes == 2 and generation.prefill.chunks == 2
        assert generation.lane_choice.reason == "lanes=2 asked for"
    finally:
        generation.close()


def rows_times_ms(monkeypatch):
    """Node costs that follow the micro-batch's rows (1 ms a row): lanes pay."""
    def annotate(gm, args, kwargs, *rest, **options):
        rows = kwargs["input_ids"].shape[0]
        for n in gm.graph.nodes:
            n.meta["cost"] = (NodeCost() if n.op in ("placeholder", "get_attr", "output") else
                              NodeCost(fwd_s=rows * 1e-3, out_bytes=64))
        return gm
    monkeypatch.setattr(measure, "annotate_costs", annotate)


from test_reading_the_plan import PAGE, unexplained      # noqa: E402  (the page's check)


@pytest.mark.parametrize("follow_rows", [False, True])
def test_auto_lanes_are_chosen_on_the_decode_costs_and_generate_the_models_tokens(
        scripted, monkeypatch, follow_rows):
    if follow_rows:
        rows_times_ms(monkeypatch)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    generation = plan_generation(model, ["cpu", "cpu"], rows=4, prompt=4, length=12, **FAST)
    try:
        choice = generation.lane_choice
        assert [o.lanes for o in choice.options] == [1, 2, 4]
        best = max(choice.options, key=lambda o: choice.tokens_per_s(o.lanes))
        # Costs that follow the rows: on 2 stages, 2 lanes keep both busy; 4 gain nothing more.
        assert generation.lanes == choice.lanes == best.lanes == (2 if follow_rows else 1)
        assert generation.tokens_per_s() == choice.tokens_per_s()
        assert f"lanes: {choice.lanes} (" in str(generation)
        assert unexplained(str(generation), PAGE.read_text()) == [], str(generation)
        ids = torch.randint(1, 1000, (4, 4), generator=torch.Generator().manual_seed(2))
        kwargs = dict(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(generation.generate(**kwargs), model.generate(**kwargs))
    finally:
        generation.close()


def generates_with_the_model(generation, model, monkeypatch):
    """`generation.generate(...)` is `model.generate(...)`, called once with the same kwargs."""
    ids = torch.randint(1, 1000, (4, 4), generator=torch.Generator().manual_seed(3))
    kwargs = dict(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    calls = []
    monkeypatch.setattr(model, "generate", lambda **kw: calls.append(kw) or "model's")
    assert generation.generate(**kwargs) == "model's" and calls == [kwargs]


def test_where_no_pipeline_decodes_faster_generation_is_the_model_as_is(scripted, monkeypatch):
    from fxpipe.planning import build
    # The model measured at a thousandth of the pipeline's predicted step: the model as is wins.
    monkeypatch.setattr(build, "race", lambda plans, model, recipe: measure.Race(
        tuple(p.record.predicted_step_s for p in plans),
        min(p.record.predicted_step_s for p in plans) / 1000, 1))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    generation = plan_generation(model, ["cpu", "cpu"], rows=4, prompt=4, length=12,
                                 num_stages="auto", **FAST)
    try:
        assert generation.decode.runs_as_is and generation.as_is
        assert "as is: no pipeline is predicted to decode faster" in str(generation)
        assert unexplained(str(generation), PAGE.read_text()) == [], str(generation)
        generates_with_the_model(generation, model, monkeypatch)
    finally:
        generation.close()


def test_auto_stages_generate_as_is_where_the_lanes_are_slower(scripted, monkeypatch):
    from fxpipe.planning import generation as planning
    rows_times_ms(monkeypatch)           # lanes pay, and the model measured at 1000 s a step:
    monkeypatch.setattr(measure.Baseline, "seconds", property(lambda self: 1000.0))  # a pipeline
    asked = []
    monkeypatch.setattr(planning, "slower_than_the_model",
                        lambda plan, choice, loop_s: asked.append(loop_s) or "slower, scripted")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    generation = plan_generation(model, ["cpu", "cpu"], rows=4, prompt=4, length=12, **FAST)
    generation.close()
    assert not generation.as_is and not asked          # stages asked for: the lanes run
    generation = plan_generation(model, ["cpu", "cpu"], rows=4, prompt=4, length=12,
                                 num_stages="auto", **FAST)
    try:
        assert not generation.decode.runs_as_is and asked == [0.0]
        assert generation.as_is.endswith("slower, scripted")
        assert generation.prefill is generation.decode        # no prefill planned for nothing
        assert not generation.runtimes and generation.last_run is None   # nor stages started
        generates_with_the_model(generation, model, monkeypatch)
    finally:
        generation.close()


def test_the_plan_runs_the_lanes_predicted_even_where_planning_chose_others(scripted,
                                                                           monkeypatch):
    """The step's prediction is one function (the runtime's way of stepping lanes may change
    it): the decode plan is made again for the lanes it predicts fastest."""
    from fxpipe.planning import generation as planning
    monkeypatch.setattr(planning, "decode_step_s",
                        lambda stage_s, lanes, loop_s: 1.0 + abs(lanes - 2))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    generation = plan_generation(model, ["cpu", "cpu"], rows=4, prompt=1, length=8, **FAST)
    try:
        assert generation.lane_choice.lanes == 2 and generation.decode.chunks == 2
    finally:
        generation.close()


# --- a pipeline from a saved plan ------------------------------------------------------------

def test_a_pipeline_loaded_with_its_model_generates_the_models_tokens(scripted, tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    ids = torch.randint(1, 1000, (4, 4), generator=torch.Generator().manual_seed(4))
    fxpipe.plan(model, ["cpu", "cpu"], example_kwargs=dict(input_ids=ids), chunks=2,
                **FAST).save(tmp_path / "plan")
    kwargs = dict(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with fxpipe.Pipeline(fxpipe.load_plan(tmp_path / "plan", model=model)) as pipe:
        assert torch.equal(pipe.generate(**kwargs), model.generate(**kwargs))
        assert pipe._generation.model is model
    with fxpipe.Pipeline(fxpipe.load_plan(tmp_path / "plan")) as pipe:
        with pytest.raises(GenerationError, match=r"load_plan\(path, model=model\)") as e:
            pipe.generate(**kwargs)
        assert "load_generation" in str(e.value)


# --- planning from meta holds one layer's cache at a time, never every layer's -----------------

_PLANNING = """
import sys
from transformers import LlamaConfig, LlamaForCausalLM
from fxpipe.generate import plan_generation
from fxpipe.testing.memory import peak_bytes, return_freed_memory
from fxpipe.weights import build_on_meta
layers, length = int(sys.argv[1]), int(sys.argv[2])
return_freed_memory()
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=layers, vocab_size=256)
model = build_on_meta(lambda: LlamaForCausalLM(config)).eval()
def plan(length):
    plan_generation(model, ["cpu", "cpu"], rows=4, prompt=1, length=length, lanes=2,
                    capture="export", repeats=1, verify=False, progress=False).close()
plan(8)       # what a process does once (imports, first calls), before the peak is taken
print(peak_bytes(lambda: plan(length)))
"""


@pytest.mark.slow          # about 20 s, a planning process of its own
def test_a_generation_planned_from_meta_holds_one_layers_cache_at_a_time_not_every_layers():
    """16 layers of 8.4 MB of cache (4 rows of 8192 slots): planning them from meta, after
    planning 8 slots, holds no more than a few layers' worth at once. Two ways it once held
    them all: a cache buffer read made every layer's (`CachedLM` owns them all, and no rule
    writes them), and functionalize's run kept every value to the end (each layer's whole
    cache read back, and repeated per head)."""
    import subprocess
    import sys
    layers, length = 16, 8192
    found = subprocess.run([sys.executable, "-c", _PLANNING, str(layers), str(length)],
                           capture_output=True, text=True, timeout=600)
    assert found.returncode == 0, found.stderr
    peak = int(found.stdout.split()[-1])
    cache = kv_bytes_by_hand(layers, 4, 2, length, 64 // 4, 4)        # 134 MB
    assert peak < cache / 4, (peak, cache)


def test_a_cache_read_alone_gets_the_values_it_gets_with_the_others():
    """A stand-in (a cache no rule writes) is drawn under a seed of its own name: a stage
    reading one layer's cache gets what a stage reading all of them gets."""
    from fxpipe.cached_lm import CachedLM
    from fxpipe.weights import Init
    on_meta = build_on_meta(lambda: LlamaForCausalLM(LlamaConfig(**CONFIG))).eval()
    lm = CachedLM(on_meta, rows=2, length=8)
    names = lm.cache_names()
    init = Init(lm, stand_ins=True)
    together = init.read({name: getattr(lm, name) for name in names}, "cpu")
    for name in (names[0], names[-1]):
        alone = init.read({name: getattr(lm, name)}, "cpu")
        assert torch.equal(alone[name], together[name]), name
    assert together[names[0]].std() > 0 and set(init.stood_in) == set(names)


# Llama-70B's shape (Llama 3: 80 layers, hidden 8192, 64 heads, 8 key/value heads of 128, MLP
# 28672, vocabulary 128256), bf16, on 8 CPU devices of 24 GB: no one holds its 141 GB.
LLAMA_70B = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)


@pytest.mark.slow
def test_the_70b_shape_gets_a_generation_plan_from_meta_with_its_kv_bytes(tmp_path, capsys):
    """Minutes on a 2-core machine: the decode plan of the 70B shape from meta (prompts of one
    token: no prefill plan), 4 sequences of up to 512 tokens in 2 lanes."""
    from fxpipe.__main__ import main
    from fxpipe.passes.cost_model import format_bytes
    LlamaConfig(**LLAMA_70B).to_json_file(tmp_path / "config.json")
    devices = ",".join(f"cpu:{s}=24GB" for s in range(8))
    assert main(["plan", "transformers:AutoModelForCausalLM", "--config",
                 str(tmp_path / "config.json"), "--meta", "--dtype", "bf16", "--tokens", "4x1",
                 "--generate", "512", "--chunks", "2", "--capture", "export", "--no-verify",
                 "--quiet",
                 "--devices", devices]) == 0
    out = capsys.readouterr().out
    total = kv_bytes_by_hand(80, 4, 8, 512, 128, 2)           # 671 MB
    assert f"key/value cache: {format_bytes(total)} in all" in out and "2 lanes" in out, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in
            [[str(s)] for s in range(8)] and line.split()[1].startswith("cpu:")]
    assert len(rows) == 8, out


def test_a_few_tokens_a_second_print_as_more_than_zero():
    from fxpipe.plans.report import per_s
    assert [per_s(r) for r in (0.0412, 3.456, 12.6, 1234.4)] == ["0.041", "3.5", "13", "1234"]
