"""The command line plans, saves, shows, diffs and runs plans; bad input is one line, exit 2."""

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.__main__ import COLOURS, _devices, _measured_inputs, _token_inputs, main
from fxpipe.passes.cost_model import format_bytes
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.weights import save_weights

LAYER = ["torch.nn:TransformerEncoderLayer", "--kwargs",
         '{"d_model": 32, "nhead": 4, "batch_first": true, "dropout": 0.0}', "--input", "8x10x32"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("plans")
    assert main(["plan", *LAYER, "--devices", "cpu,cpu", "--chunks", "2",
                 "--save", str(root / "two")]) == 0
    assert main(["plan", *LAYER, "--devices", "cpu,cpu,cpu", "--chunks", "2",
                 "--save", str(root / "three")]) == 0
    return root


def test_plan_prints_the_plan_and_saves_it_with_its_pictures(saved, capsys):
    assert main(["show", str(saved / "two")]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("fxpipe plan: 2 stages, 2 micro-batches")
    for name in ("plan.json", "plan_data.json", "stage_0.py", "stage_1.pt", "stages.svg",
                 "timeline.svg"):
        assert (saved / "two" / name).is_file(), name
    document = json.loads((saved / "two" / "plan.json").read_text())
    assert dict(fxpipe.load_plan(saved / "two").partition.stage_of) == \
        document["partition"]["stage_of"]


def test_the_pictures_are_svg_with_one_colour_per_stage(saved):
    for plan, k in (("two", 2), ("three", 3)):
        root = ET.parse(saved / plan / "stages.svg").getroot()
        fills = {e.get("fill") for e in root.iter() if e.tag.endswith("rect")}
        assert fills == set(COLOURS[:k])
        ET.parse(saved / plan / "timeline.svg")


def test_run_measures_a_saved_plan_against_its_prediction(saved, capsys):
    assert main(["run", str(saved / "two"), "--input", "8x10x32", "--repeats", "2"]) == 0
    times, memory = capsys.readouterr().out.split("memory measured in the latest run")
    assert "predicted ms" in times and "measured ms" in times
    assert len([line for line in times.splitlines() if line.strip().startswith(("0 ", "1 "))]) == 2
    # each stage's memory, predicted beside measured (one more call, tracked)
    rows = [line.split() for line in memory.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(rows) == 2 and all(row[-2] in ("KB", "MB") for row in rows), memory


def test_run_without_inputs_draws_them_shaped_as_the_plans_example(saved, capsys):
    """The example was 8x10x32 floats in 2 micro-batches: the plan measured one of 4x10x32,
    4 bytes an element. --tokens needs an embedding reading the first input."""
    (x,), keywords = _measured_inputs(fxpipe.load_plan(saved / "two"), None)
    assert x.shape == (8, 10, 32) and x.dtype == torch.float32 and keywords == {}
    assert main(["run", str(saved / "two"), "--repeats", "1"]) == 0
    assert "measured ms" in capsys.readouterr().out
    assert main(["run", str(saved / "two"), "--tokens", "8x10"]) == 2
    assert capsys.readouterr().err.startswith(
        "fxpipe run: error: --tokens: the plan reads no token ids with an embedding")


def test_diff_shows_where_two_plans_differ(saved, capsys):
    assert main(["diff", str(saved / "two"), str(saved / "three")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("devices: cpu, cpu | cpu, cpu, cpu\n") and "nodes in another stage:" in out
    assert "{" not in out and '"' not in out      # names, not the saved JSON


@pytest.mark.parametrize("command", [["plan", "--explain"], ["explain"]])
def test_plan_explains_its_cuts(command, capsys):
    assert main([command[0], *LAYER, "--devices", "cpu,cpu", *command[1:]]) == 0
    assert "boundary 0 | 1" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["plan", "no_such_module:f", "--input", "4x4"], "cannot import 'no_such_module'"),
    (["plan", "torch.nn:NoSuchNet", "--input", "4x4"], "has no factory 'NoSuchNet'"),
    (["plan", "torch.nn:Linear", "--input", "4x4"], "pass its arguments with --kwargs"),
    (["plan", "torch.nn:ReLU", "--input", "4xfour"], "is not a shape"),
    (["plan", "torch.nn:ReLU", "--input", "4x4", "--dtype", "float99"], "is not a torch dtype"),
    (["plan", "torch.nn:ReLU", "--input", "4x4", "--kwargs", "{oops"], "is not JSON"),
    (["plan", "torch.nn:ReLU", "--input", "4x4", "--devices", "gpu7"], "'gpu7' is not a device"),
    (["show", "/nonexistent/plan"], "no saved plan"),
    (["plan", *LAYER, "--memory", "2000"],      # the CPU's, shared by its two stages
     "no device has more than 1.0 KB"),
    (["plan", "transformers:AutoModelForCausalLM", "--config", "/nonexistent/config.json",
      "--meta", "--tokens", "1x16"], "--config /nonexistent/config.json: no such file"),
    (["plan", "torch.nn:Embedding", "--config", "/nonexistent.json", "--tokens", "1x16"],
     "--config /nonexistent.json: no such file"),
    (["plan", "torch.nn:ReLU", "--tokens", "2x"], "--tokens '2x' is not BxS"),
    (["plan", "torch.nn:ReLU", "--tokens", "2x3x4"], "--tokens '2x3x4' is not BxS"),
    (["plan", "torch.nn:ReLU", "--tokens", "2x16"], "the model has no nn.Embedding"),
    (["plan", "torch.nn:ReLU"], "no inputs\n  give --tokens BxS"),
    (["plan", "torch.nn:ReLU", "--input", "4x4", "--devices", "cpu:0=400XB"],
     "is not a memory size"),
    (["plan", "torch.nn:ReLU", "--input", "4x4", "--memory", "lots"], "is not a memory size"),
])
def test_bad_input_is_one_error_line_and_exit_2(argv, message, capsys):
    """The problem on one `error:` line of at most about 80 characters after the prefix; the
    fix, if any, on the lines below it, indented."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    first, *fix = err.strip().splitlines()
    assert first.startswith(f"fxpipe {argv[0]}: error: ") and message in err
    assert len(first.split(": error: ", 1)[1]) <= 80 and "Traceback" not in err
    assert all(line.startswith("  ") for line in fix if line)


SEQUENCE_FIRST = ["plan", "torch.nn:TransformerEncoderLayer", "--kwargs",
                  '{"d_model": 32, "nhead": 4, "dropout": 0.0}', "--input", "8x10x32",
                  "--devices", "cpu,cpu", "--chunks", "2", "--quiet"]


def test_an_errors_fix_names_the_flags_that_exist_and_they_work(capsys):
    """A sequence-first model split along dimension 0 mixes samples: the fix names --batch-dims,
    --chunks 1 and --no-verify (the options' command-line spellings), and each plans."""
    assert main(SEQUENCE_FIRST) == 2
    err = capsys.readouterr().err
    assert "mixes samples across the batch" in err
    for flag in ("--batch-dims DIM", "--chunks 1", "--no-verify"):
        assert flag in err, err
    assert "batch_dims=" not in err and "verify=False" not in err
    for fix in (["--batch-dims", "1"], ["--no-verify"]):
        assert main([*SEQUENCE_FIRST, *fix]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert ("outputs checked against the model: yes" in out) == (fix != ["--no-verify"])


def test_every_option_a_memory_refusal_offers_is_a_flag_of_plan(tmp_path):
    from fxpipe.__main__ import _as_flags
    from fxpipe.plans.saved import plan_document
    said = _as_flags("use devices with more memory, schedule='1f1b' (fewer micro-batches in "
                     "flight), more micro-batches (chunks=), or recompute='auto'")
    assert said == ("use devices with more memory, --schedule 1f1b (fewer micro-batches in "
                    "flight), more micro-batches (--chunks N), or --recompute auto")
    argv = [*LAYER, "--train", "--chunks", "4", "--schedule", "1f1b", "--quiet",
            "--save", str(tmp_path / "plan")]
    assert main(["plan", *argv]) == 0
    assert plan_document(tmp_path / "plan")["schedule"] == "1f1b"


def test_batch_dims_take_one_for_every_input_or_a_list_of_one_per_input():
    from fxpipe.__main__ import _batch_dims
    assert (_batch_dims("1"), _batch_dims("null"), _batch_dims("[1, null]")) == \
        (1, None, {0: 1, 1: None})


@pytest.mark.parametrize("dims", ["x", "[1, true]", '{"a": 1}'])
def test_a_batch_dims_flag_that_is_no_dimension_is_refused(dims, capsys):
    assert main(["plan", *LAYER[:3], "--input", "4x4x32", "--batch-dims", dims]) == 2
    assert f"--batch-dims {dims!r} is not a dimension" in capsys.readouterr().err


def test_the_module_runs_as_a_program():
    done = subprocess.run([sys.executable, "-m", "fxpipe", "show", "/nonexistent"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("fxpipe show: error: no saved plan")
    assert subprocess.run([sys.executable, "-m", "fxpipe", "--help"], capture_output=True,
                          timeout=120).returncode == 0


class Skip(nn.Module):
    """A value of the first layer read by the last: a skip across every cut of a chain."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(32, 32)
        self.body = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])

    def forward(self, x):
        h = torch.relu(self.first(x))
        return self.body(h) + h


def test_explain_names_the_skip_tensor_at_every_boundary_it_crosses():
    torch.manual_seed(0)
    pipe = fxpipe.compile(Skip().eval(), ["cpu"] * 3, (torch.randn(16, 32),))
    stage_of = pipe.plan.partition.stage_of
    text = pipe.explain()
    blocks = text.split("\nboundary ")[1:]
    assert len(blocks) == 2
    for s, block in enumerate(blocks):
        crosses = stage_of["relu"] <= s < stage_of["add"]
        skip = [line for line in block.splitlines()
                if line.strip().startswith(f"relu (stage {stage_of['relu']}) ->")]
        assert any(f"add (stage {stage_of['add']})" in line for line in skip) == crosses, block
        assert "one node earlier" in block and "one node later" in block
    assert stage_of["add"] - stage_of["relu"] >= 1


def test_a_loaded_plan_cannot_explain_without_its_costs(saved):
    with pytest.raises(fxpipe.FxpipeError, match="compile the model to explain"):
        fxpipe.Pipeline(fxpipe.load_plan(saved / "two")).explain()


def test_progress_shows_nodes_measured_when_asked_and_not_by_default(capsys):
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval(), torch.randn(4, 8)
    fxpipe.compile(model, ["cpu"] * 2, (x,), progress=True)
    err = capsys.readouterr().err
    assert "fxpipe: planning 2 stages x 4 micro-batches" in err
    assert "measuring node 4 of 4" in err and err.endswith("\r")     # the line cleared after
    fxpipe.compile(model, ["cpu"] * 2, (x,))       # stderr is not a terminal here
    assert capsys.readouterr().err == ""


def test_the_node_graph_colours_each_node_by_its_stage(saved, tmp_path):
    from fxpipe.plans.pictures import write_node_graph

    torch.manual_seed(0)
    pipe = fxpipe.compile(Skip().eval(), ["cpu"] * 3, (torch.randn(16, 32),))
    dot = write_node_graph(pipe.module, pipe.plan, tmp_path / "graph.dot").read_text()
    for name, s in pipe.plan.partition.stage_of.items():
        assert f'"{name}" [fillcolor="{COLOURS[s]}"' in dot
    cuts = {(p, n) for n, s in pipe.plan.partition.stage_of.items()
            for p in [a.name for a in next(x for x in pipe.module.graph.nodes
                                           if x.name == n).all_input_nodes]
            if p in pipe.plan.partition.stage_of and pipe.plan.partition.stage_of[p] != s}
    assert cuts and all(f'"{p}" -> "{n}" [label=' in dot for p, n in cuts)
    if shutil.which("dot"):       # Graphviz renders it beside the DOT file
        fills = {e.get("fill") for e in ET.parse(tmp_path / "graph.svg").getroot().iter()}
        assert set(COLOURS[:3]) <= fills


@pytest.mark.parametrize("name", ["resnet50", "vit"])
def test_plan_on_zoo_models_saves_a_plan_that_reloads_to_the_same_partition(name, tmp_path,
                                                                             capsys):
    argv = ["plan", "examples.zoo:model", "--kwargs", json.dumps({"name": name}),
            "--input", "4x3x32x32", "--devices", "cpu,cpu,cpu", "--save", str(tmp_path)]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("fxpipe plan: 3 stages")
    document = json.loads((tmp_path / "plan.json").read_text())
    assert dict(fxpipe.load_plan(tmp_path).partition.stage_of) == \
        document["partition"]["stage_of"]
    assert main(["run", str(tmp_path), "--input", "4x3x32x32", "--repeats", "1"]) == 0


def test_plan_for_training_shows_each_stages_memory_and_recomputation(capsys):
    assert main(["plan", *LAYER, "--train", "--chunks", "2", "--recompute", "always",
                 "--optimizer", "sgd", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "recompute='always'" in out and out.count("recomputes its forward") == 2


def test_plan_for_a_run_under_torchrun_prices_values_as_gloo_messages(tmp_path, capsys):
    assert main(["plan", *LAYER, "--link", "gloo", "--quiet", "--save", str(tmp_path)]) == 0
    assert "values priced as messages between processes over gloo" in capsys.readouterr().out
    assert fxpipe.load_plan(tmp_path).link == "gloo"


# ---- a model built from its configuration -------------------------------------------------------

TINY_LLAMA = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


def test_plan_builds_a_hugging_face_config_on_meta_and_show_gives_each_stages_tensors(
        tmp_path, capsys):
    """A config.json read from disk, the model built on meta in bf16, planned on two CPU
    devices of 400 MB on token ids, saved with its manifest; `show` says which of the
    checkpoint's tensors each stage reads."""
    import transformers
    config = transformers.LlamaConfig(**TINY_LLAMA)
    config.to_json_file(tmp_path / "config.json")
    assert main(["plan", "transformers:AutoModelForCausalLM", "--config",
                 str(tmp_path / "config.json"), "--meta", "--tokens", "2x16", "--dtype", "bf16",
                 "--devices", "cpu:0=400MB,cpu:1=400MB", "--quiet",
                 "--save", str(tmp_path / "plan")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fxpipe plan: 2 stages") and "planned from the meta device" in out
    assert "outputs checked against the model: yes, within " in out and \
           "bf16 rounding x4, measured against float32" in out
    document = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert [(d["name"], d["memory_bytes"]) for d in document["devices"]] == \
        [("cpu:0", 400e6), ("cpu:1", 400e6)]
    entries = {name: entry for stage in document["weights"]["stages"]
               for name, entry in stage.items()}
    assert entries["lm_head.weight"]["dtype"] == "bfloat16"
    # a manifest, no values of the checkpoint's tensors; the rotary inv_freq, in none, computed
    assert not any(entry["saved"] for entry in entries.values() if entry["persistent"])
    assert entries["model.rotary_emb.inv_freq"]["saved"]
    # The model's own bf16 rounding, measured: between one bf16 epsilon and the unmeasured 16.
    assert 2 ** -7 <= document["verify_tolerance"] < 16 * 2 ** -7
    assert document["verify_tolerance_source"].endswith("measured against float32")

    assert main(["show", str(tmp_path / "plan")]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("fxpipe plan: 2 stages")
    assert "the plan holds none of their values: load it with weights=" in shown
    rows = {line.split()[0]: line.split() for line in shown.splitlines()
            if line.split() and line.split()[0] in ("0", "1", "all")}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = model.to(torch.bfloat16).state_dict()
    assert int(rows["0"][2]) + int(rows["1"][2]) == int(rows["all"][1]) == len(state)
    assert rows["0"][1] == "cpu:0" and rows["1"][1] == "cpu:1"
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert f"{rows['all'][2]} {rows['all'][3]}" == format_bytes(total)


def test_plan_calls_a_plain_factory_with_its_config_file_in_the_dtype_asked(tmp_path, capsys):
    """Any other factory is called with the file's JSON object, `--kwargs` overriding it;
    --tokens reads the vocabulary off its embedding."""
    (tmp_path / "embedding.json").write_text('{"num_embeddings": 50, "embedding_dim": 4}')
    assert main(["plan", "torch.nn:Embedding", "--config", str(tmp_path / "embedding.json"),
                 "--kwargs", '{"embedding_dim": 8}', "--tokens", "4x6", "--dtype", "bf16",
                 "--devices", "cpu", "--quiet", "--save", str(tmp_path / "plan")]) == 0
    assert capsys.readouterr().out.startswith("fxpipe plan: 1 stage")
    (weight,) = [entry for stage in json.loads((tmp_path / "plan" / "plan.json").read_text())
                 ["weights"]["stages"] for entry in stage.values()]
    assert weight["shape"] == [50, 8] and weight["dtype"] == "bfloat16" and weight["saved"]
    assert main(["show", str(tmp_path / "plan")]) == 0
    assert "the plan's files hold their values" in capsys.readouterr().out
    assert list(_token_inputs(fxpipe.load_plan(tmp_path / "plan")).values()) == [50]
    assert main(["run", str(tmp_path / "plan"), "--tokens", "4x6", "--repeats", "1"]) == 0


def test_run_gives_a_plan_made_on_meta_its_weights_from_a_checkpoint(tmp_path, capsys):
    """A Hugging Face config planned on meta (`plan --meta`), its checkpoint written by
    save_weights: `run --weights` runs it on token ids below its vocabulary (`--tokens`, or
    shaped as the example); without --weights, one line saying to pass it. What it runs is
    the model (the rotary inv_freq, in no checkpoint, kept in the plan)."""
    import transformers
    config = transformers.LlamaConfig(**TINY_LLAMA)
    config.to_json_file(tmp_path / "config.json")
    plan, checkpoint = str(tmp_path / "plan"), str(tmp_path / "ckpt")
    assert main(["plan", "transformers:AutoModelForCausalLM", "--config",
                 str(tmp_path / "config.json"), "--meta", "--tokens", "2x16",
                 "--devices", "cpu:0=400MB,cpu:1=400MB", "--quiet", "--save", plan]) == 0
    torch.manual_seed(0)
    real = transformers.AutoModelForCausalLM.from_config(config).eval()
    save_weights(real.state_dict(), checkpoint)
    capsys.readouterr()
    assert main(["run", plan, "--tokens", "4x8"]) == 2
    assert capsys.readouterr().err == (
        f"fxpipe run: error: the plan at {plan} holds no weights\n  it was planned on the meta "
        f"device: pass --weights CKPT, a .safetensors file or a Hugging Face sharded folder\n")
    for inputs in (["--tokens", "4x8"], []):
        assert main(["run", plan, "--weights", checkpoint, *inputs, "--repeats", "1"]) == 0
        assert "measured ms" in capsys.readouterr().out
    loaded = fxpipe.load_plan(plan, weights=checkpoint)
    (ids,), keywords = _measured_inputs(loaded, None)
    assert ids.shape == (2, 16) and ids.dtype == torch.int64 and 0 <= ids.min() <= ids.max() < 256
    with torch.no_grad():
        assert_same_up_to_rounding(fxpipe.Pipeline(loaded)(ids, **keywords).logits,
                                   real(ids).logits)


def test_devices_take_their_memory_in_units_and_memory_the_rest():
    assert _devices("cpu:0=400MB,cpu:1=1.5GiB,cpu:2", 2e9) == [
        fxpipe.DeviceSpec("cpu:0", memory_bytes=400e6),
        fxpipe.DeviceSpec("cpu:1", memory_bytes=1.5 * 2 ** 30),
        fxpipe.DeviceSpec("cpu:2", memory_bytes=2e9)]
    assert _devices("cpu,cuda:0=80GB", None) == ["cpu", fxpipe.DeviceSpec("cuda:0",
                                                                          memory_bytes=80e9)]
