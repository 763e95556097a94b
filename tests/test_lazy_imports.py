"""A model fx captures is compiled without importing what only torch.export needs: torch's
compiler stack (dynamo, inductor, onnx) and sympy, seconds of a fresh process's first compile;
nor what only some graphs or a printed plan need (networkx for a graph with state, tabulate for
a table), which `import fxpipe` would otherwise load in every process."""

import subprocess
import sys

COMPILE = """
import sys
import torch
from torch import nn
import fxpipe

heavy = ("torch._dynamo", "torch._inductor", "torch.onnx", "sympy", "networkx", "tabulate")
print(sorted({m.split(".")[0] for m in sys.modules if m.startswith(heavy[4:])}))
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
with fxpipe.compile(model, ["cpu"] * 2, (torch.randn(4, 8),)) as pipe:
    assert pipe.plan.capture.method == "fx"
print(sorted({m for m in sys.modules if m.startswith(heavy)}))
str(pipe.plan)
print(sorted({m.split(".")[0] for m in sys.modules if m.startswith(heavy[4:])}))
"""


def test_an_fx_compile_imports_no_compiler_stack():
    out = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    imported, compiled, printed = out.stdout.strip().splitlines()[-3:]
    assert imported == "[]"     # by `import fxpipe`
    assert compiled == "[]"     # by the compile
    assert printed == "['tabulate']"    # what printing the plan needs, loaded then


FIRST_STEP = """
import sys
import torch
import torch.nn.functional as F
from torch import nn
import fxpipe
from fxpipe.passes.recompute import checkpoint_regions

model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU()).train()
x = torch.randn(4, 8)
with fxpipe.compile(model, ["cpu"] * 2, (x,), chunks=2, verify=False) as pipe:
    for stage in pipe.plan.stages:     # every ReLU under torch.utils.checkpoint
        checkpoint_regions(stage.module, {n.name for n in stage.module.graph.nodes
                                          if n.op == "call_module"})
    before = set(sys.modules)
    pipe.train_step(x, torch.zeros(4, 8), F.mse_loss)
print(sorted(set(sys.modules) - before))
"""


def test_a_recomputing_stage_imports_nothing_in_its_first_step():
    """`torch.utils.checkpoint`'s first call imports torch._dynamo (about 70 MB resident): a
    plan with checkpointed regions imports it as they are made, so a first step's memory is the
    step's (tests/test_recompute.py measures it against the plan) and nothing is imported
    inside a step (under torchrun, while a process group lives: see
    fxpipe.distributed.stage.forget_captured_default_group)."""
    out = subprocess.run([sys.executable, "-c", FIRST_STEP], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
