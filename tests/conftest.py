import os

import pytest
import torch
from hypothesis import HealthCheck, settings

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
