"""A plan saved to disk and loaded back runs as the pipeline it came from, without the model."""

import copy
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, strategies as st
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import assert_same_training, assert_same_up_to_rounding
from fxpipe.plans.saved import load_stage


class Skip(nn.Module):
    """Branches and a skip connection across stages, a tied weight, a buffer."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(8, 8)
        self.tail = nn.Linear(8, 8)
        self.tail.weight = self.head.weight       # tied
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        h = torch.relu(self.a(x))
        g = self.norm(self.b(h)) + h             # skip
        y = self.c(g) * self.scale
        return self.tail(torch.tanh(self.head(y)))


def example():
    torch.manual_seed(0)
    return Skip().eval(), torch.randn(12, 8)


def test_a_saved_plan_loads_as_the_same_pipeline(tmp_path):
    model, x = example()
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=4)
    pipe.plan.save(tmp_path / "plan")
    before = model(x).detach()
    plan = fxpipe.load_plan(tmp_path / "plan")
    assert plan.partition == pipe.plan.partition          # no measuring again
    assert [s.module.code for s in plan.stages] == [s.module.code for s in pipe.plan.stages]
    assert str(plan) == str(pipe.plan)
    loaded = fxpipe.Pipeline(plan)
    with torch.no_grad():
        assert_same_up_to_rounding(loaded(x), model(x))
    # The weights are the saved ones, not the model's: a later change to the model stays out.
    with torch.no_grad():
        model.a.weight.add_(1.0)
        torch.testing.assert_close(loaded(x), before)


def test_a_loaded_plan_trains_as_the_model_does(tmp_path):
    model, x = example()
    target = torch.randn(12, 8)
    fxpipe.plan(model, ["cpu"] * 3, (x,), chunks=4, training=True).save(tmp_path / "plan")
    loaded = fxpipe.Pipeline(fxpipe.load_plan(tmp_path / "plan"))
    loss = loaded.train_step(x, target, F.mse_loss)
    expected = F.mse_loss(model(x), target)
    expected.backward()
    assert_same_training(loaded, model, loss=(loss, expected))
    # The tied weight is one Parameter again, as in the model.
    assert loaded.module.head.weight is loaded.module.tail.weight
    # Its names are the model's: the state loads into the model.
    model.load_state_dict(loaded.state_dict())


class Drops(nn.Module):
    """Dropout, a BatchNorm and a function kept whole with torch.fx.wrap."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 8)
        self.norm, self.drop = nn.BatchNorm1d(32), nn.Dropout(0.3)

    def forward(self, x):
        return self.b(self.drop(halved(self.norm(self.a(x)))))


def halved(h):
    return h * 0.5


torch.fx.wrap("halved")


def test_a_loaded_plan_draws_the_random_numbers_the_pipeline_draws(tmp_path):
    from fxpipe.passes.recompute import checkpoint_regions
    torch.manual_seed(0)
    model, x, target = Drops().train(), torch.randn(16, 8), torch.randn(16, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=4)
    stage = pipe.plan.stages[0]         # recomputed runs round-trip too
    checkpoint_regions(stage.module, {n.name for n in stage.module.graph.nodes
                                      if n.op == "call_module" and "norm" in n.name})
    pipe.plan.save(tmp_path / "plan")
    # halved, kept whole by torch.fx.wrap, is code: the plan names it, the caller gives it.
    loaded = fxpipe.Pipeline(fxpipe.load_plan(tmp_path / "plan", functions=[halved]))
    code = "".join(s.module.code for s in loaded.plan.stages)
    assert "halved(" in code and "seeded(" in code and "recomputed_0(" in code   # kept whole
    for run in (lambda p: p(x), lambda p: p.train_step(x, target, F.mse_loss)):
        torch.manual_seed(1)
        expected = run(pipe)
        torch.manual_seed(1)
        torch.testing.assert_close(run(loaded), expected)


def loads_in_a_fresh_process(pipe, model, x, tmp_path) -> None:
    """Save `pipe`'s plan, load it in a new Python process (without the model's code) and
    check there that the loaded pipeline's output on `x` is the model's."""
    pipe.plan.save(tmp_path / "plan")
    torch.save({"x": x, "y": model(x).detach()}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import torch, fxpipe
        from fxpipe.testing import assert_same_up_to_rounding
        pipe = fxpipe.Pipeline(fxpipe.load_plan({str(tmp_path / 'plan')!r}))
        io = torch.load({str(tmp_path / 'io.pt')!r})
        with torch.no_grad():     # the model ran here on 1 thread, the stages there on theirs
            assert_same_up_to_rounding(pipe(io["x"]), io["y"])
        print("same")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "same"


def test_a_saved_plan_runs_in_a_process_without_the_models_code(tmp_path):
    model, x = example()
    loads_in_a_fresh_process(fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2), model, x,
                             tmp_path)


class Rotary(nn.Module):
    """Tensors that are no parameters: a constant computed in forward, a plain tensor attribute
    (an export constant), a non-persistent buffer (as rotary embeddings keep `inv_freq`)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.rand(8) + 0.5, persistent=False)
        self.offset = torch.linspace(-1.0, 1.0, 8)

    def forward(self, x):
        positions = torch.arange(8, dtype=torch.float32)
        h = torch.relu(self.a(x)) + positions * self.offset
        return self.b(h * self.inv_freq)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_plan_with_tensor_constants_and_non_persistent_buffers_loads_in_a_fresh_process(
        capture, tmp_path):
    torch.manual_seed(0)
    model, x = Rotary().eval(), torch.randn(6, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, capture=capture)
    loads_in_a_fresh_process(pipe, model, x, tmp_path)


def test_an_exported_plan_round_trips(tmp_path):
    model, x = example()
    pipe = fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, capture="export")
    pipe.plan.save(tmp_path / "plan")
    loaded = fxpipe.Pipeline(fxpipe.load_plan(tmp_path / "plan"))
    with torch.no_grad():
        assert_same_up_to_rounding(loaded(x), model(x))


def test_one_stage_loads_with_its_own_weights_only(tmp_path):
    model, x = example()
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=3)
    pipe.plan.save(tmp_path / "plan")
    last = len(pipe.plan.stages) - 1
    document = json.loads((tmp_path / "plan" / "plan.json").read_text())
    holders = {holder for holder, _ in document["shared"][last].values()}
    removed = [s for s in range(last) if s not in holders]
    assert removed
    for s in removed:
        os.remove(tmp_path / "plan" / f"stage_{s}.pt")     # never read
    stage = load_stage(tmp_path / "plan", last)
    original = pipe.plan.stages[last]
    assert stage.inputs == original.inputs and stage.outputs == original.outputs
    for (name, p), (_, q) in zip(stage.module.state_dict().items(),
                                 original.module.state_dict().items()):
        torch.testing.assert_close(p, q, msg=name)
    with pytest.raises(fxpipe.PlanFileError, match=f"missing stage_{removed[0]}.pt"):
        fxpipe.load_plan(tmp_path / "plan")


@pytest.fixture
def saved(tmp_path):
    model, x = example()
    fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2).save(tmp_path / "plan")
    return tmp_path / "plan"


def test_a_missing_file_is_named(saved):
    os.remove(saved / "stage_1.pt")
    with pytest.raises(fxpipe.PlanFileError, match="missing stage_1.pt"):
        fxpipe.load_plan(saved)
    with pytest.raises(fxpipe.PlanFileError, match="no saved plan"):
        fxpipe.load_plan(saved.parent / "elsewhere")


@pytest.mark.parametrize("edit", ["rename a node", "move a node to another stage"])
def test_an_edited_plan_json_is_refused_as_changed(saved, edit):
    document = json.loads((saved / "plan.json").read_text())
    stage_of = document["partition"]["stage_of"]
    first = next(iter(stage_of))
    if edit == "rename a node":
        stage_of["renamed"] = stage_of.pop(first)
    else:
        stage_of[first] = 1 - stage_of[first]
    (saved / "plan.json").write_text(json.dumps(document, indent=1))
    with pytest.raises(fxpipe.PlanFileError, match="plan.json changed since the plan was saved\n"
                                                   ".*describes the plan that runs.*\nsave the "
                                                   "plan again.*or restore"):
        fxpipe.load_plan(saved)


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    model, x = example()
    path = tmp_path_factory.mktemp("saved") / "plan"
    fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2).save(path)
    return path


def leaves(value, path=()):
    """Every (path, value) of a JSON document's scalars."""
    if isinstance(value, dict):
        return [leaf for key, v in value.items() for leaf in leaves(v, (*path, key))]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in leaves(v, (*path, i))]
    return [(path, value)]


@given(data=st.data())
def test_any_value_changed_in_plan_json_is_refused(saved_once, data):
    text = (saved_once / "plan.json").read_text()
    document = json.loads(text)
    path, value = data.draw(st.sampled_from(leaves(document)))
    changed = data.draw(st.one_of(st.integers(), st.text(max_size=3), st.booleans(), st.none())
                        .filter(lambda v: v != value or type(v) is not type(value)))
    owner = document
    for key in path[:-1]:
        owner = owner[key]
    owner[path[-1]] = changed
    try:
        (saved_once / "plan.json").write_text(json.dumps(document))
        with pytest.raises(fxpipe.PlanFileError):
            fxpipe.load_plan(saved_once)
    finally:
        (saved_once / "plan.json").write_text(text)


def test_plan_json_laid_out_anew_still_loads(saved):
    document = json.loads((saved / "plan.json").read_text())
    (saved / "plan.json").write_text(json.dumps(document, indent=4))
    model, x = example()
    with torch.no_grad():
        assert_same_up_to_rounding(fxpipe.Pipeline(fxpipe.load_plan(saved))(x), model(x))


def test_a_changed_file_is_named(saved):
    code = saved / "stage_0.py"
    code.write_text(code.read_text() + "\n# edited\n")
    with pytest.raises(fxpipe.PlanFileError, match="stage_0.py .* changed since it was saved"):
        fxpipe.load_plan(saved)


def test_a_plan_from_other_versions_says_which(saved):
    document = json.loads((saved / "plan.json").read_text())
    document["torch"] = "1.0.0"
    (saved / "plan.json").write_text(json.dumps(document))
    with pytest.raises(fxpipe.PlanFileError, match=r"torch 1\.0\.0 \(saved\) against "):
        fxpipe.load_plan(saved)


def test_a_loaded_plan_runs_only_the_mode_it_was_planned_in(saved):
    pipe = fxpipe.Pipeline(fxpipe.load_plan(saved))
    pipe.eval()                                   # the mode it was planned in: nothing to do
    with pytest.raises(fxpipe.FxpipeError, match=r"plan made in eval mode[\s\S]*model.train"):
        pipe.train()


def test_plan_json_says_what_the_plan_decided(saved):
    document = json.loads((saved / "plan.json").read_text())
    assert document["chunks"] == 2 and len(document["stages"]) == 2
    assert set(document["partition"]["stage_of"].values()) == {0, 1}
    assert document["costs"] and all(
        {"fwd_s", "out_bytes"} <= set(cost) for kinds in document["costs"].values()
        for cost in kinds.values())
    assert document["devices"][0]["name"] == "cpu"


def test_a_plan_runs_with_the_weights_of_the_model_given(saved):
    model, x = example()
    with torch.no_grad():
        model.c.weight.mul_(-2)                    # trained since the plan was saved, say
    pipe = fxpipe.Pipeline(fxpipe.load_plan(saved, model=model))
    with torch.no_grad():
        assert_same_up_to_rounding(pipe(x), model(x))


def test_a_plan_for_another_model_says_what_differs(saved):
    other = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(fxpipe.PlanFileError, match="another model\n'a.weight' is not in the model"):
        fxpipe.load_plan(saved, model=other)
    wider, _ = example()
    wider.c = nn.Linear(16, 4)
    with pytest.raises(fxpipe.PlanFileError, match=r"'c.weight' is \(4, 16\)"):
        fxpipe.load_plan(saved, model=wider)


def test_planning_again_from_saved_costs_measures_only_what_is_new(tmp_path, monkeypatch):
    import fxpipe.planning.measure

    model, x = example()
    fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2, threads_per_stage=1).save(tmp_path / "plan")
    saved = fxpipe.load_plan(tmp_path / "plan")
    measured = []
    annotate = fxpipe.planning.measure.annotate_costs
    monkeypatch.setattr(fxpipe.planning.measure, "annotate_costs",
                        lambda *a, **k: measured.append(torch.get_num_threads()) or annotate(*a, **k))
    # Three stages with one thread each, two micro-batches: all measured before.
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x,), chunks=2, threads_per_stage=1, costs=saved)
    assert measured == []
    assert pipe.plan.partition.num_stages == 3
    with torch.no_grad():
        assert_same_up_to_rounding(pipe(x), model(x))
    node = next(iter(saved.record.measurements.values())).costs
    assert {n.name: n.meta["cost"] for n in pipe.module.graph.nodes if n.op != "output"} == node
    # So is the interpreter lock on the graph, where 2 cores let two copies run at once.
    (lock,) = {m.lock for m in saved.record.measurements.values()}
    if (os.cpu_count() or 1) >= 2:
        assert lock is not None and pipe.plan.record.host.lock_s == lock[0]
    # Two threads per stage are a new kind of device: measured, once.
    fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, threads_per_stage=2, costs=saved)
    assert measured == [2]


class SharedNorm(nn.Module):
    """One BatchNorm called twice in training: both calls write its statistics."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(16, 16), nn.Linear(16, 16), nn.BatchNorm1d(16)

    def forward(self, x):
        return self.b(self.norm(self.a(self.norm(x))))


def test_a_plan_from_reused_costs_keeps_what_measuring_found_besides_times(tmp_path):
    # Which nodes write a buffer (they share a stage, so its writes keep micro-batch order)
    # and which keep their output for the backward (memory): a plan from costs= had neither,
    # and split the two BatchNorm calls over two stages.
    torch.manual_seed(0)
    model, x = SharedNorm().train(), torch.randn(32, 16)
    options = dict(num_stages=2, chunks=2, training=True, optimizer="sgd", repeats=1)
    measured = fxpipe.plan(model, ["cpu"] * 2, (x,), **options)
    marks = lambda plan: {n.name: (n.meta.get("state"), n.meta.get("output_kept"))
                          for n in plan.graph.graph.nodes}
    for costs in (fxpipe.load_plan(measured.save(tmp_path / "plan")), measured):
        reused = fxpipe.plan(model, ["cpu"] * 2, (x,), costs=costs, **options)
        assert marks(reused) == marks(measured)
        assert reused.partition.stage_of["norm"] == reused.partition.stage_of["norm_1"]
        assert [c.memory_bytes for c in reused.partition.stages] == \
            [c.memory_bytes for c in measured.partition.stages]
    # and it trains as the model does on the same micro-batches, statistics included
    reference, target = copy.deepcopy(model), torch.randn(32, 16)
    with fxpipe.Pipeline(reused) as pipe:
        loss = pipe.train_step(x, target, F.mse_loss)
    expected = sum(F.mse_loss(reference(xc), tc) / 2
                   for xc, tc in zip(x.tensor_split(2), target.tensor_split(2)))
    expected.backward()
    assert_same_training(pipe, reference, loss=(loss, expected), buffers=True)


def test_saved_costs_of_another_model_are_refused(saved):
    other = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()    # the mode the costs are for
    with pytest.raises(fxpipe.CostError, match="measured on another graph"):
        fxpipe.compile(other, ["cpu"] * 2, (torch.randn(12, 8),), chunks=2,
                       costs=fxpipe.load_plan(saved))
    with pytest.raises(fxpipe.CostError, match="costs=str"):
        fxpipe.compile(other, ["cpu"] * 2, (torch.randn(12, 8),), costs="plan.json")


class TiedEnds(nn.Module):
    """The first node's weight read again by the last one: stage 0 and the last hold it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, ids):
        return F.linear(self.b(torch.relu(self.a(self.emb(ids)))), self.emb.weight)


def test_shared_tensors_names_every_tensor_several_stages_hold(tmp_path):
    """`shared_tensors` (read off plan.json) agrees with the stages' own tensors by identity."""
    from fxpipe.plans.saved import shared_tensors
    torch.manual_seed(0)
    pipe = fxpipe.compile(TiedEnds(), ["cpu"] * 3, (torch.randint(0, 20, (8, 5)),), chunks=2)
    pipe.plan.save(tmp_path / "plan")
    held: dict[int, dict[int, str]] = {}
    first: dict[int, tuple[int, str]] = {}
    for stage in pipe.plan.stages:
        for name, t in [*stage.module.named_parameters(remove_duplicate=False),
                        *stage.module.named_buffers(remove_duplicate=False)]:
            first.setdefault(id(t), (stage.index, name))
            held.setdefault(id(t), {}).setdefault(stage.index, name)
    expected = {first[i]: stages for i, stages in held.items() if len(stages) > 1}
    assert expected == {(0, "emb.weight"): {0: "emb.weight", 2: "emb.weight"}}
    assert shared_tensors(tmp_path / "plan") == expected


class Filled(nn.Module):
    """An export graph names the example's device in an op reading a value (`full_like`)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h * torch.full_like(h, 2.0, device=h.device))


def test_a_plan_loads_on_the_devices_given(tmp_path):
    torch.manual_seed(0)
    model, x = Filled().eval(), torch.randn(6, 8)
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2, capture="export")
    # As a plan made on another device would, the stages' code names that device.
    for stage in plan.stages:
        for n in stage.module.graph.nodes:
            n.kwargs = {k: torch.device("meta") if isinstance(v, torch.device) else v
                        for k, v in n.kwargs.items()}
        stage.module.recompile()
    plan.save(tmp_path / "plan")
    assert "device = device(type='meta')" in "".join(
        (tmp_path / "plan" / f"stage_{s}.py").read_text() for s in range(2))
    roomy = fxpipe.DeviceSpec("cpu", memory_bytes=1e12)
    loaded = fxpipe.load_plan(tmp_path / "plan", devices=["cpu", roomy])
    # A CPU named without a thread count keeps the stage's planned threads.
    assert loaded.partition.devices == (fxpipe.DeviceSpec("cpu", threads=plan.threads[0]),
                                        dataclasses.replace(roomy, threads=plan.threads[1]))
    assert "meta" not in "".join(stage.module.code for stage in loaded.stages)
    with torch.no_grad():
        assert_same_up_to_rounding(fxpipe.Pipeline(loaded)(x), model(x))
    stage = load_stage(tmp_path / "plan", 1, device="cpu")
    assert "meta" not in stage.module.code and stage.device == torch.device("cpu")


def test_a_stage_too_big_for_its_new_device_is_refused_by_name(tmp_path):
    model, x = example()
    plan = fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2)
    plan.save(tmp_path / "plan")
    need = [cost.memory_bytes for cost in plan.partition.stages]
    small = fxpipe.DeviceSpec("cpu", memory_bytes=need[1] - 1)
    with pytest.raises(fxpipe.DeviceError, match="stage 1 of the plan .* needs .*; cpu has"):
        load_stage(tmp_path / "plan", 1, device=small)
    # Stages put on one device share its memory.
    shared = fxpipe.DeviceSpec("cpu", memory_bytes=sum(need) - 1)
    with pytest.raises(fxpipe.DeviceError, match="stages 0 and 1 of the plan .* need "):
        fxpipe.load_plan(tmp_path / "plan", devices=[shared, shared])
    roomy = fxpipe.DeviceSpec("cpu", memory_bytes=sum(need))
    fxpipe.load_plan(tmp_path / "plan", devices=[roomy, roomy])
    with pytest.raises(fxpipe.DeviceError, match="names 1 devices for the 2 stages"):
        fxpipe.load_plan(tmp_path / "plan", devices=["cpu"])



def test_a_rank_runs_a_gpu_stage_on_its_local_gpu(monkeypatch):
    from fxpipe.distributed import rank_device
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device(torch.device("cuda:0")) == torch.device("cuda:3")
    assert chosen == [torch.device("cuda:3")]
    assert rank_device(torch.device("cpu")) == torch.device("cpu")
    assert rank_device(torch.device("cuda:0"), "cpu") == "cpu"
    monkeypatch.delenv("LOCAL_RANK")
    assert rank_device(torch.device("cuda:1")) == torch.device("cuda:1")
    assert chosen == [torch.device("cuda:3"), torch.device("cuda:1")]


def test_stages_loaded_onto_devices_with_other_threads_run_with_those(tmp_path):
    """A stage's threads live on its device, once: a plan saved on two 1-thread stages and
    loaded onto 2-thread devices says (2, 2), and each stage runs with 2 intra-op threads."""
    model, x = Counting().eval(), torch.randn(12, 8)
    fxpipe.plan(model, ["cpu"] * 2, (x,), chunks=2, threads_per_stage=1).save(tmp_path / "plan")
    saved = fxpipe.load_plan(tmp_path / "plan", functions=[threads_seen])
    assert saved.threads == (1, 1)
    two = fxpipe.DeviceSpec("cpu", threads=2)
    loaded = fxpipe.load_plan(tmp_path / "plan", devices=[two, two], functions=[threads_seen])
    assert loaded.threads == (2, 2) and [d.threads for d in loaded.partition.devices] == [2, 2]
    with torch.no_grad():
        expected = model(x)
    THREADS_SEEN.clear()
    with fxpipe.Pipeline(loaded) as pipe, torch.no_grad():
        assert_same_up_to_rounding(pipe(x), expected)
        workers = []
        with pipe._runtime.workers.run(lambda i: workers.append(torch.get_num_threads()),
                                       lambda error: None) as jobs:
            jobs.wait()
    assert THREADS_SEEN == [2] * 4          # 2 stages' calls x 2 micro-batches, each on 2 threads
    assert workers == [2, 2]                                       # each stage's worker


THREADS_SEEN: list[int] = []


def threads_seen(x):
    THREADS_SEEN.append(torch.get_num_threads())
    return x


torch.fx.wrap("threads_seen")


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(threads_seen(torch.tanh(self.a(threads_seen(x)))))
