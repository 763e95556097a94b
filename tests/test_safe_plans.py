"""A saved plan is data: loading one runs no code its directory holds, whoever wrote it.

The SHA-256 manifest catches a corrupted file, not a crafted one (whoever writes a directory
writes its digests), so every crafted plan here is re-sealed: its digests are right, and the
loader refuses it for what it holds. A payload, were it run, would create a marker file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.plans import plan_format, saved
from fxpipe.__main__ import main
from fxpipe.testing import assert_same_up_to_rounding


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x)))) * self.scale


class Gated(nn.Module):
    """A block fx cannot follow (a branch on a value): capture "fx+leaves" keeps it whole."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) if x.shape[-1] == 8 else -self.a(x)


class WithLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.head = Gated(), nn.Linear(8, 8)

    def forward(self, x):
        return self.head(torch.tanh(self.gate(x)))


class Payload:
    """Unpickled, it creates `marker`: what a crafted pickle runs."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(6, 8)
    root = tmp_path_factory.mktemp("safe") / "plan"
    fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2, capture="fx", repeats=1).save(root)
    return model, x, root


def reseal(root, changed=None, **document_changes):
    """Write `changed` files (name -> bytes) into `root` and seal plan.json over them again,
    as whoever crafts a plan directory can."""
    document = json.loads((root / "plan.json").read_text())
    document.update(document_changes)
    for name, data in (changed or {}).items():
        (root / name).write_bytes(data)
        document["files"][name] = hashlib.sha256(data).hexdigest()
    document["sha256"] = saved._content_digest(document)
    (root / "plan.json").write_text(json.dumps(document))


def crafted(planned, tmp_path):
    root = tmp_path / "crafted"
    shutil.copytree(planned[2], root)
    return root


def pickled(obj) -> bytes:
    import io
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_a_pickled_plan_resealed_is_refused_and_its_payload_never_runs(planned, tmp_path):
    root, marker = crafted(planned, tmp_path), tmp_path / "ran"
    reseal(root, {"plan.pt": pickled(Payload(marker))}, format=4)
    for load in (lambda: fxpipe.load_plan(root), lambda: saved.load_stage(root, 1)):
        with pytest.raises(fxpipe.PlanFileError, match=r"of format 4, a pickle\n.*plan.pt runs"):
            load()
    assert not marker.exists()
    # The same payload beside a plan of this format is never read.
    reseal(root, {"plan.pt": pickled(Payload(marker))}, format=saved.FORMAT)
    fxpipe.load_plan(root)
    assert not marker.exists()


def test_a_stage_file_holding_a_pickled_object_is_refused(planned, tmp_path):
    root, marker = crafted(planned, tmp_path), tmp_path / "ran"
    reseal(root, {"stage_0.pt": pickled({"a.weight": Payload(marker)})})
    with pytest.raises(fxpipe.PlanFileError, match="stage_0.pt holds more than tensors"):
        fxpipe.load_plan(root)
    assert not marker.exists()


def _node(data, op):
    return next(n for stage in data["stages"] for n in stage["module"]["graph"]["nodes"]
                if n[0] == op)


def _call_os_system(data):
    _node(data, "call_function")[2] = "os.system"


def _module_of_class_os_system(data):
    data["stages"][0]["module"]["children"]["a"]["class"] = "os.system"


def _type_os_system(data):
    data["plan"]["capture"]["data"] = "os.system"


def _read_a_method(data):       # self.a.forward: an attribute, no tensor or submodule
    node = _node(data, "call_module")
    node[0], node[2] = "get_attr", "a.forward"


def _read_a_dunder(data):
    node = _node(data, "call_module")
    node[0], node[2] = "get_attr", "a.__dict__"


def _getattr_of_a_dunder(data):
    node = _node(data, "call_module")
    node[0], node[2], node[3] = "call_function", "getattr", [{"node": "x"}, "__class__"]


def _a_starred_input(data):
    _node(data, "placeholder")[2] = "x=open('ran', 'w')"


def _a_size_rule_calling_import(data):
    data["plan"]["signature"]["fields"]["size_rules"] = [{"data": "SizeRule", "fields": {
        "code": "__import__('os').system('touch ran')", "shown": "x"}}]


@pytest.mark.parametrize("craft, refused", [
    (_call_os_system, "calls os.system, which is no torch op"),
    (_module_of_class_os_system, "calls 'a', a os.system kept whole"),
    (_type_os_system, "holds a 'os.system', no type a plan holds"),
    (_read_a_method, "reads 'a.forward', not the plan's own"),
    (_read_a_dunder, "'__dict__' names no attribute"),
    (_getattr_of_a_dunder, "reads the attribute \\('__class__',\\)"),
    (_a_starred_input, "no name an input may have"),
    (_a_size_rule_calling_import, "size rule"),
])
def test_a_plan_naming_anything_outside_the_allow_lists_is_refused(planned, tmp_path, craft,
                                                                   refused):
    root = crafted(planned, tmp_path)
    data = json.loads((root / saved.DATA_FILE).read_text())
    craft(data)
    reseal(root, {saved.DATA_FILE: json.dumps(data).encode()})
    os.chdir(tmp_path)                  # where the crafted input and rule would write
    with pytest.raises(fxpipe.PlanFileError, match=refused):
        fxpipe.load_plan(root)
    assert not (tmp_path / "ran").exists()


def test_the_plan_data_names_no_python_module_of_fxpipe(planned):
    text = (planned[2] / saved.DATA_FILE).read_text()
    assert "fxpipe.passes" not in text and "fxpipe.plans.plan_data" not in text
    assert not (planned[2] / "plan.pt").exists()


def test_a_plan_loads_in_a_process_that_unpickles_nothing_and_never_saw_the_model(planned,
                                                                                 tmp_path):
    """Equal to the model there; a plan keeping a module of the model's class whole says that
    it needs the model, and loads with it here."""
    model, x, root = planned
    torch.manual_seed(0)
    leafy, y = WithLeaf().eval(), torch.randn(6, 8)
    leaf_plan = fxpipe.plan(leafy, ["cpu"] * 2, (y,), chunks=2, capture="auto", repeats=1)
    assert "gate" in leaf_plan.capture.leaves
    leaf_plan.save(tmp_path / "leaf")
    with torch.no_grad():
        torch.save({"x": x, "y": model(x)}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import pickle, sys, torch
        load = torch.load
        def weights_only(*args, **kwargs):
            assert kwargs.get("weights_only") is True, "unpickled"
            return load(*args, **kwargs)
        def never(*args, **kwargs):
            raise AssertionError("unpickled")
        torch.load, pickle.load, pickle.loads = weights_only, never, never
        import fxpipe
        from fxpipe.testing import assert_same_up_to_rounding
        plan = fxpipe.load_plan({str(root)!r})
        io = torch.load({str(tmp_path / 'io.pt')!r}, weights_only=True)
        with fxpipe.Pipeline(plan) as pipe, torch.no_grad():
            assert_same_up_to_rounding(pipe(io["x"]), io["y"])
        try:
            fxpipe.load_plan({str(tmp_path / 'leaf')!r})
        except fxpipe.PlanFileError as e:
            print(e)
        assert not any("test_safe_plans" in name for name in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "calls 'gate', a test_safe_plans.Gated kept whole" in done.stdout
    assert "fxpipe.load_plan(path, model=model)" in done.stdout
    # Given the model, the module kept whole is the model's class, with the plan's weights.
    loaded = fxpipe.load_plan(tmp_path / "leaf", WithLeaf())
    assert type(loaded.stages[0].module.gate) is Gated or type(loaded.stages[-1].module.gate) \
        is Gated
    with fxpipe.Pipeline(fxpipe.load_plan(tmp_path / "leaf", leafy)) as pipe, torch.no_grad():
        assert_same_up_to_rounding(pipe(y), leafy(y))


def write_format_4(plan, root):
    """`plan` saved as fxpipe saved plans before format 5: the plan pickled in plan.pt."""
    plan.save(root)
    stages = saved._picklable(plan.stages)
    with saved._without_tensors([stage.module for stage in stages]):
        data = pickled(dataclasses.replace(plan, stages=stages, graph=None, link_fn=None))
    os.remove(root / saved.DATA_FILE)
    document = json.loads((root / "plan.json").read_text())
    del document["files"][saved.DATA_FILE]
    (root / "plan.json").write_text(json.dumps(document))
    reseal(root, {"plan.pt": data}, format=4)


def test_a_format_4_plan_loads_only_when_trusted_and_converts(planned, tmp_path):
    model, x, _ = planned
    old = tmp_path / "old"
    write_format_4(fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2, capture="fx", repeats=1), old)
    with pytest.raises(fxpipe.PlanFileError, match="is of format 4, a pickle"):
        fxpipe.load_plan(old)
    assert saved.plan_document(old)["format"] == 4       # `fxpipe diff` reads its plan.json
    with torch.no_grad():
        expected = model(x)
        with fxpipe.Pipeline(fxpipe.load_plan(old, trust_pickle=True)) as pipe:
            assert_same_up_to_rounding(pipe(x), expected)
        saved.convert(old, tmp_path / "new")
        assert main(["convert", str(old), str(tmp_path / "cli")]) == 0
        for new in ("new", "cli"):
            assert json.loads((tmp_path / new / "plan.json").read_text())["format"] == 5
            with fxpipe.Pipeline(fxpipe.load_plan(tmp_path / new)) as pipe:
                assert_same_up_to_rounding(pipe(x), expected)



def test_a_format_4_plan_naming_the_modules_before_the_tree_moved_loads(planned, tmp_path,
                                                                        monkeypatch):
    """A format-4 pickle names the module paths of its day (`fxpipe.plan_data.Plan`): trusted,
    it loads, though those modules now live in packages (`plan_format.MOVED_MODULES`)."""
    model, x, _ = planned
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2, capture="fx", repeats=1)
    for old, new in plan_format.MOVED_MODULES.items():      # pickled as before the move
        module = importlib.import_module(new)
        monkeypatch.setitem(sys.modules, old, module)
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == new:
                monkeypatch.setattr(value, "__module__", old)
    write_format_4(plan, tmp_path / "old")
    monkeypatch.undo()
    with zipfile.ZipFile(tmp_path / "old" / "plan.pt") as archive:
        [pickle_file] = [name for name in archive.namelist() if name.endswith("data.pkl")]
        data = archive.read(pickle_file)
    assert b"cfxpipe.plan_data\nPlan\n" in data
    assert not [new for new in plan_format.MOVED_MODULES.values() if f"c{new}\n".encode() in data]
    with torch.no_grad(), fxpipe.Pipeline(fxpipe.load_plan(tmp_path / "old",
                                                           trust_pickle=True)) as pipe:
        assert_same_up_to_rounding(pipe(x), model(x))

class Recurrent(nn.Module):
    """An LSTM keeps a list of its weights (`_flat_weights`): no attribute a plan holds as data."""

    def __init__(self):
        super().__init__()
        self.a, self.rnn, self.b = nn.Linear(8, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.rnn(torch.relu(self.a(x)))[0])


def test_a_torch_module_holding_more_than_data_comes_from_the_model(tmp_path):
    torch.manual_seed(0)
    model, x = Recurrent().eval(), torch.randn(4, 5, 8)
    fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2, capture="fx", repeats=1).save(tmp_path / "p")
    with pytest.raises(fxpipe.PlanFileError, match="calls 'rnn', a torch.nn.modules.rnn.LSTM"):
        fxpipe.load_plan(tmp_path / "p")
    with fxpipe.Pipeline(fxpipe.load_plan(tmp_path / "p", model)) as pipe, torch.no_grad():
        assert_same_up_to_rounding(pipe(x), model(x))
