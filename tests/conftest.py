import os

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
