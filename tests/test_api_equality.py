"""compile's checks and options: the pipeline equals the model, or compile says why not."""

import copy
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fxpipe
from fxpipe.testing import assert_same_up_to_rounding
from fxpipe.planning.reference import run_per_microbatch
from fxpipe.passes.randomness import microbatch_seeds

from examples.zoo.resnet import from_preset


def contract_reference(model, x, chunks, seed=0, **options):
    """The model run once per micro-batch under the seeds a pipeline call draws after `seed`."""
    torch.manual_seed(seed)
    seeds = microbatch_seeds(chunks)
    with torch.no_grad():
        return run_per_microbatch(model, (x,), {}, chunks, seeds=seeds, **options)


# ---- item 1: the mode a graph reads --------------------------------------------------------

class DropPath(nn.Module):
    """A residual block whose branch is scaled in training, written with `if self.training:`."""

    def __init__(self, width=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        h = self.body(x)
        if self.training:
            h = h * 0.5
        return self.head(x + h)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_graph_reading_self_training_follows_train_and_eval(capture):
    torch.manual_seed(0)
    model, x = DropPath().eval(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, capture=capture)
    assert_same_up_to_rounding(pipe(x), model(x))
    pipe.train()
    assert not model.training                       # capturing again restores the model's mode
    assert_same_up_to_rounding(pipe(x), model.train()(x))
    pipe.eval()
    assert_same_up_to_rounding(pipe(x), model.eval()(x))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_graph_captured_in_training_runs_the_eval_branch_after_eval(capture):
    torch.manual_seed(0)
    model, x = DropPath().train(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, capture=capture)
    assert_same_up_to_rounding(pipe(x), model(x))
    assert_same_up_to_rounding(pipe.eval()(x), model.eval()(x))
    assert pipe.plan.capture.method == capture


class FunctionalDropout(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, 4)

    def forward(self, x):
        return self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.5, training=self.training))


def test_functional_dropout_compiled_in_eval_drops_after_train_as_the_model_would():
    torch.manual_seed(0)
    model, x = FunctionalDropout().eval(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    assert_same_up_to_rounding(pipe(x), model(x))
    pipe.train()
    torch.manual_seed(7)
    out = pipe(x)
    expected = contract_reference(model.train(), x, 2, seed=7)
    assert_same_up_to_rounding(out, torch.cat(expected))
    assert not torch.equal(out, model.eval()(x))     # it drops


def test_a_graph_that_does_not_read_the_mode_is_not_captured_again():
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4)).eval()
    x = torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    graph_module = pipe.module
    pipe.train()
    assert pipe.module is graph_module and pipe.stages[0].training
    pipe.eval()
    assert pipe.module is graph_module
    assert_same_up_to_rounding(pipe(x), model(x))


# ---- item 6: training-mode checks, batch dimensions, reductions over the batch ---------------

class Centered(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0)


def test_a_model_mixing_samples_is_refused_in_training_mode_too():
    model, x = Centered().train(), torch.randn(8, 16)
    with pytest.raises(fxpipe.BatchError, match=r"mixes samples across the batch[\s\S]*batch_dims=.*chunks=1"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=1)   # the fix it names works
    assert_same_up_to_rounding(pipe(x), model(x))


class Summed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return {"features": h, "total": h.sum(0)}


def test_an_output_reduced_over_the_batch_is_refused_by_name():
    with pytest.raises(fxpipe.BatchError, match=r"output 'total' of shape \(16,\) reduces over "
                                                r"the batch"):
        fxpipe.compile(Summed().train(), ["cpu"] * 2, (torch.randn(64, 16),), chunks=4)


def test_an_output_reduced_over_the_batch_is_refused_without_verify():
    with pytest.raises(fxpipe.BatchError, match="output 'total'"):
        fxpipe.compile(Summed().eval(), ["cpu"] * 2, (torch.randn(64, 16),), chunks=4,
                       verify=False)


class ClipLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.image, self.text = nn.Linear(16, 8), nn.Linear(12, 8)

    def forward(self, pixels, tokens):
        a, b = self.image(pixels), self.text(tokens)
        return {"image_embeds": a, "logits_per_image": a @ b.t()}


def test_an_output_mixing_the_batch_is_named():
    with pytest.raises(fxpipe.BatchError, match=r"output 'logits_per_image' of shape \(B, B\) "
                                                r"mixes the batch"):
        fxpipe.compile(ClipLike().eval(), ["cpu"] * 2, (torch.randn(8, 16), torch.randn(8, 12)),
                       chunks=2)


class SequenceFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):                       # x: (time, batch, features)
        out, (h, c) = self.rnn(x)
        return self.head(out), h


def test_a_sequence_first_rnn_needs_batch_dims_and_then_matches():
    torch.manual_seed(0)
    model, x = SequenceFirst().train(), torch.randn(6, 8, 8)
    with pytest.raises(fxpipe.BatchError, match="batch_dims="):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, batch_dims=1)
    assert_same_up_to_rounding(pipe(x), model(x))
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, batch_dims={"x": 1})
    assert_same_up_to_rounding(pipe(x[:, :5]), model(x[:, :5]))


class MaskedSequenceFirst(SequenceFirst):
    def forward(self, x, mask):                 # x: (time, batch, features), mask: (batch, 1)
        out, (h, c) = self.rnn(x)
        return self.head(out) * mask


def test_batch_dims_per_input_by_position():
    torch.manual_seed(0)
    model, x, mask = MaskedSequenceFirst().eval(), torch.randn(6, 8, 8), torch.rand(8, 1)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x, mask), chunks=4, batch_dims={0: 1})
    assert_same_up_to_rounding(pipe(x, mask), model(x, mask))


def test_batchnorm_in_training_mode_is_verified_per_micro_batch_and_left_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)).train()
    x = torch.randn(8, 16)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.random.get_rng_state()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    assert "outputs checked against the model: yes" in str(pipe.plan)
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, buffers[name], msg=name)
    assert torch.equal(torch.random.get_rng_state(), rng)
    reference = copy.deepcopy(model)
    assert_same_up_to_rounding(pipe(x), torch.cat(contract_reference(reference, x, 2)))
    assert_same_up_to_rounding(model[1].running_mean, reference[1].running_mean)


def test_dropout_in_training_mode_verifies_against_the_seeded_reference():
    torch.manual_seed(0)
    model, x = FunctionalDropout().train(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4)
    torch.manual_seed(3)
    assert_same_up_to_rounding(pipe(x), torch.cat(contract_reference(model, x, 4, seed=3)))


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) + 0.1 * torch.randn_like(x)


def test_randomness_in_eval_mode_verifies_against_the_seeded_reference():
    model, x = Noisy().eval(), torch.randn(8, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    torch.manual_seed(5)
    assert_same_up_to_rounding(pipe(x), torch.cat(contract_reference(model, x, 2, seed=5)))


# ---- the check's tolerance -----------------------------------------------------------------

def deep_net():
    """A deep random-init ResNet whose outputs reach 1e8: summation order shows at 1e-7."""
    torch.manual_seed(0)
    model, shape = from_preset("tiny")
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.fill_(4.0)
    return model.eval(), torch.randn(4, *shape)


def test_a_deep_net_verifies_with_another_thread_count():
    model, x = deep_net()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, threads_per_stage=2, repeats=1)
    expected = model(x)
    assert_same_up_to_rounding(pipe(x), expected)      # epsilons of its largest, 1e8


def test_a_difference_names_the_output_its_size_and_how_to_relax_the_check():
    model, x = deep_net()
    with pytest.raises(fxpipe.FxpipeError, match=r"the output differs by up to .* of its largest "
                       r"magnitude [\s\S]*verify_tolerance=.*verify=False"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, threads_per_stage=2, repeats=1,
                       verify_tolerance=0.0)


# ---- item 10: the model changed after compile ----------------------------------------------

class Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_a_submodule_replaced_after_compile_is_refused():
    model, x = Layers().eval(), torch.randn(4, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    model.layers[3] = nn.Linear(16, 16)
    with pytest.raises(fxpipe.FxpipeError, match="'layers.3' was replaced after compile[\\s\\S]*compile "
                                                 "the model again"):
        pipe(x)


def test_a_parameter_replaced_on_an_export_graph_is_refused():
    model, x = Layers().eval(), torch.randn(4, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, capture="export")
    model.layers[1].weight = nn.Parameter(torch.zeros(16, 16))
    with pytest.raises(fxpipe.FxpipeError, match="'layers.1.weight' was replaced"):
        pipe(x)
    with pytest.raises(fxpipe.FxpipeError, match="'layers.1.weight' was replaced"):
        pipe.train_step(x, torch.randn(4, 16), F.mse_loss)


def test_a_parameter_replaced_inside_a_module_an_fx_stage_calls_is_followed():
    model, x = Layers().eval(), torch.randn(4, 16)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    model.layers[1].weight = nn.Parameter(torch.zeros(16, 16))
    assert_same_up_to_rounding(pipe(x), model(x))


# ---- errors that name the option and a fix that works --------------------------------------

def small():
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), torch.randn(8, 16)


def test_devices_none_is_a_device_error():
    model, x = small()
    with pytest.raises(fxpipe.DeviceError, match=r"devices=None is not a list of devices\npass one device per stage"):
        fxpipe.compile(model, None, (x,))


@pytest.mark.parametrize("link, message", [
    (lambda src, dst: 1e-5, "must return a fxpipe.Link"),
    (lambda src, dst: fxpipe.Link(1e-5, 0.0), "bytes_per_s must be a bandwidth > 0"),
    (lambda src, dst: fxpipe.Link(-2.0), "latency_s must be a finite number of seconds >= 0"),
])
def test_a_bad_link_function_is_a_cost_error_naming_what_it_returned(link, message):
    model, x = small()
    with pytest.raises(fxpipe.CostError, match=r"link\('cpu', 'cpu'\) returned .*" + message):
        fxpipe.compile(model, ["cpu"] * 2, (x,), link=link)


@pytest.mark.parametrize("memory", [-1, math.nan, "8GB"])
def test_a_bad_memory_size_is_a_device_error(memory):
    model, x = small()
    with pytest.raises(fxpipe.DeviceError, match=r"memory_bytes=.* must be a number > 0"):
        fxpipe.compile(model, [fxpipe.DeviceSpec("cpu", memory_bytes=memory)] * 2, (x,))


def test_negative_threads_per_stage_is_an_option_error_not_a_stage_failure():
    model, x = small()
    with pytest.raises(fxpipe.DeviceError, match=r"threads_per_stage=-1 is not a number of threads >= 1\nuse a number"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), threads_per_stage=-1)


def test_negative_repeats_is_a_cost_error():
    model, x = small()
    with pytest.raises(fxpipe.CostError, match=r"repeats=-1: must be a number of timed runs >= 1"):
        fxpipe.compile(model, ["cpu"] * 2, (x,), repeats=-1)


def test_a_plain_function_is_refused_with_how_to_wrap_it():
    with pytest.raises(fxpipe.TraceError, match="not an nn.Module\nwrap it in a module"):
        fxpipe.compile(torch.tanh, ["cpu"], (torch.randn(4, 4),))


def test_an_example_input_on_the_meta_device_is_refused():
    model, x = small()
    with pytest.raises(fxpipe.DeviceError, match="example input is on the meta device"):
        fxpipe.compile(model, ["cpu"] * 2, (x.to("meta"),))


@pytest.mark.parametrize("inputs", [None, "list"])
def test_example_inputs_as_a_list_or_none_is_an_input_error(inputs):
    model, x = small()
    with pytest.raises(fxpipe.InputError, match="pass the model's positional example inputs as "
                                                "a tuple"):
        fxpipe.compile(model, ["cpu"], [x] if inputs == "list" else None)


def test_an_empty_batch_is_named_not_answered_with_chunks():
    model, x = small()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    with pytest.raises(fxpipe.BatchError, match=r"the batch is empty \(0 rows\)") as error:
        pipe(x[:0])
    assert "chunks" not in str(error.value)


@pytest.mark.parametrize("value", [None, "numpy"])
def test_a_none_or_numpy_input_is_named_with_the_fix(value):
    model, x = small()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2)
    given = None if value is None else x.numpy()
    with pytest.raises(fxpipe.BatchError, match="is None" if value is None else
                       r"is a numpy array[\s\S]*torch.from_numpy") as error:
        pipe(given)
    assert "chunks=1" not in str(error.value)


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(3.0))

    def forward(self, t):
        return self.weight * t + 1


def test_a_0d_input_with_one_chunk_runs():
    model, t = Scale().eval(), torch.tensor(2.0)
    pipe = fxpipe.compile(model, ["cpu"], (t,), chunks=1)
    assert_same_up_to_rounding(pipe(torch.tensor(5.0)), model(torch.tensor(5.0)))


def test_timeline_is_an_attribute_of_the_package():
    code = "import fxpipe; print(fxpipe.timeline.write_svg.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "write_svg", done.stderr


class Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x, table):                # table: (4,), the same for every sample
        return self.fc(x) * table


def test_an_input_without_a_batch_dimension_is_given_whole_with_batch_dims_none():
    model, x, table = Table().eval(), torch.randn(8, 16), torch.rand(4)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x, table), chunks=4, batch_dims={"table": None})
    assert_same_up_to_rounding(pipe(x, table), model(x, table))


def test_batch_dims_naming_no_input_is_refused():
    model, x, table = Table().eval(), torch.randn(8, 16), torch.rand(4)
    with pytest.raises(fxpipe.BatchError, match="batch_dims names 'tabel', which is not an input"):
        fxpipe.compile(model, ["cpu"] * 2, (x, table), chunks=4, batch_dims={"tabel": None})


def test_a_pipeline_of_a_temporary_model_switches_mode():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    pipe = fxpipe.compile(DropPath().eval(), ["cpu"] * 2, (x,), chunks=2)
    eval_out = pipe(x)
    pipe.train()
    assert not torch.allclose(pipe(x), eval_out)          # the training branch runs


def test_hugging_face_clip_names_its_output_that_mixes_the_batch():
    from transformers import CLIPConfig, CLIPModel

    tiny = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2)
    config = CLIPConfig(text_config=dict(vocab_size=64, max_position_embeddings=16, bos_token_id=0,
                                         eos_token_id=1, pad_token_id=2, **tiny),
                        vision_config=dict(image_size=16, patch_size=8, **tiny), projection_dim=16)
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    inputs = dict(input_ids=torch.randint(0, 64, (4, 7)), pixel_values=torch.randn(4, 3, 16, 16))
    with pytest.raises(fxpipe.BatchError, match=r"output 'logits_per_image' of shape \(B, B\) "
                                                r"mixes the batch"):
        fxpipe.compile(model, ["cpu"] * 2, example_kwargs=inputs, chunks=2)
    pipe = fxpipe.compile(model, ["cpu"] * 2, example_kwargs=inputs, chunks=1)   # the fix works
    assert_same_up_to_rounding(pipe(**inputs).logits_per_image, model(**inputs).logits_per_image)


def test_a_negative_verify_tolerance_is_refused_with_the_alternatives():
    model, x = small()
    with pytest.raises(fxpipe.FxpipeError, match=r"verify_tolerance=-1 is not a tolerance >= 0\n"
                                                 r"use a relative tolerance >= 0, e.g. 1e-4, or "
                                                 r"verify=False"):
        fxpipe.compile(model, ["cpu"], (x,), verify_tolerance=-1)


def test_example_kwargs_that_are_not_a_dict_are_an_input_error():
    model, x = small()
    with pytest.raises(fxpipe.InputError, match="example_kwargs is a tuple, not a dict\npass the model's "
                                                "keyword example inputs as a dict"):
        fxpipe.compile(model, ["cpu"], (), (x,))
