"""A model fx captures is compiled without importing what only torch.export needs: torch's
compiler stack (dynamo, inductor, onnx) and sympy, seconds of a fresh process's first compile."""

import subprocess
import sys

COMPILE = """
import sys
import torch
from torch import nn
import fxpipe

model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
with fxpipe.compile(model, ["cpu"] * 2, (torch.randn(4, 8),)) as pipe:
    assert pipe.plan.capture.method == "fx"
heavy = ("torch._dynamo", "torch._inductor", "torch.onnx", "sympy")
print(sorted({m for m in sys.modules if m.startswith(heavy)}))
"""


def test_an_fx_compile_imports_no_compiler_stack():
    out = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
