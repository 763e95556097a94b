import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from fxpipe.planning import build, host, measure
from fxpipe.passes.cost_model import HostCosts, NodeCost

# Two cores: one intra-op thread keeps pipeline stages from fighting over them.
torch.set_num_threads(1)

settings.register_profile(
    "ci", deadline=None, max_examples=25, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("stress", deadline=None, max_examples=400,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None, max_examples=10,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def host_reads(monkeypatch):
    """The names of the calls that read a tensor's value on the host (on a GPU, each waits
    for the GPU), recorded while the test runs (`int()` is left out: seeds are drawn with it
    from the CPU generator)."""
    reads = []

    def counted(name, original):
        def read(*args, **kwargs):
            reads.append(name)
            return original(*args, **kwargs)
        return read
    for name in ("__float__", "__bool__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "equal", counted("torch.equal", torch.equal))
    return reads


@pytest.fixture
def scripted_costs(monkeypatch):
    """`script_costs` for one test."""
    return script_costs(monkeypatch)


def script_costs(monkeypatch):
    """Node costs set by hand where compile measures them, as `annotate_costs` would leave them:
    every computing node 1 ms (forward, and backward in training), the nodes named in the
    returned dict their own ms (a name matches every node whose name starts with it); costs not
    scaled by calibration; an inference pipeline raced against the model as is runs in its
    predicted time; a call's own work and the interpreter lock not priced (`HostCosts()`, and
    no lock measured on the graph: `lock_held`), nor a training action's own
    (`train_action_s`), nor the generation loop's own (`loop_step_s`). No timing is then asserted, and plans do not
    depend on the load."""
    heavy: dict[str, float] = {}

    def annotate(gm, *args, backward=False, **kwargs):
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "get_attr", "output"):
                n.meta["cost"] = NodeCost()
                continue
            ms = next((v for k, v in heavy.items() if n.name.startswith(k)), 1.0)
            n.meta["cost"] = NodeCost(fwd_s=ms * 1e-3, bwd_s=ms * 1e-3 if backward else 0.0,
                                      out_bytes=64)
        return gm
    monkeypatch.setattr(measure, "annotate_costs", annotate)
    monkeypatch.setattr(measure, "calibrate", lambda *args, **kwargs: (1.0, 1.0))
    monkeypatch.setattr(measure, "lock_held", lambda *args, **kwargs: None)
    monkeypatch.setattr(host, "host_costs", lambda threads, cores: HostCosts())
    monkeypatch.setattr(host, "train_action_s", lambda threads, cores: 0.0)
    monkeypatch.setattr("fxpipe.generate.loop_step_s", lambda model, rows: 0.0)
    monkeypatch.setattr(build, "race", lambda plans, model, recipe: measure.Race(
        tuple(p.record.predicted_step_s for p in plans), plans[0].record.unpipelined_s, 0))
    return heavy


# Tests that start processes of torch.distributed (torchrun, gloo ranks): whole modules, and
# those elsewhere whose name says so.
DISTRIBUTED_MODULES = {"test_distributed.py", "test_distributed_hosts.py",
                       "test_torch_pipelining.py"}
DISTRIBUTED_NAMES = ("under_torchrun", "across_processes")


def pytest_collection_modifyitems(items):
    """Markers by where a test runs: `gpu` (tests/gpu/, skipped without CUDA) and
    `distributed` (see above), so that `-m "not distributed"` or `-m gpu` picks them."""
    for item in items:
        path = item.path
        if path.parent.name == "gpu":
            item.add_marker(pytest.mark.gpu)
        if path.name in DISTRIBUTED_MODULES or any(n in item.name for n in DISTRIBUTED_NAMES):
            item.add_marker(pytest.mark.distributed)
