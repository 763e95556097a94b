"""Where `fxpipe.compile`'s time goes: each phase of planning, fixed and "auto", per model.

    python -m benchmarks.compile_time [--models readme,resnet50,gpt2,llama] [--devices 2]
    python -m benchmarks.compile_time --first [--runs 3]

Each model is compiled on `--devices` CPU stages twice in one process, fixed (`num_stages`
the devices, `chunks` 2 per stage) and "auto" (`num_stages="auto"`, `chunks="auto"`), after one
compile of each not counted (the first compiles of a process import and warm what any compile
needs, and measure once per process what the runtime's hand-offs cost on each layout of
threads: `--first` measures a first compile). The phases are timed by wrapping the functions that do them,
wherever fxpipe calls them from, so the script times an older fxpipe the same way:

- capture: the front-ends (`passes.capture.trace`); the column `captures` counts its calls
- functionalize: `functionalize` and `seed_random_ops`
- measure: node costs (`annotate_costs`), their calibration, the model's own time
- search: partitioning and predicting each configuration (`search.consider`)
- split: splitting nodes, cutting and placing stages (`split_chosen`, `split_stages`,
  `held_by_stages`)
- check: the model's reference runs and the plan checked against them (`reference_of`,
  `meta_reference`, `verify`)
- race: the shortlist raced against the model (`race`)
- other: the rest of `compile` (options, the Pipeline's workers)

Each cell is seconds and the phase's share of that compile. `auto/fixed` is the ratio of the
two compiles' totals. Timings on a shared machine are noisy: compare rows of one run.

`--first` starts a fresh process `--runs` times, each timing `import torch`, `import fxpipe`,
and the README model's first compile (wall seconds, and the process's CPU seconds, which a
loaded machine disturbs less), and lists what that compile imported beyond fxpipe's own
imports; the least of each is printed. The processes read compiled bytecode, as an installed
package does (written to a temporary `PYTHONPYCACHEPREFIX` by one process first, not counted,
whatever `PYTHONDONTWRITEBYTECODE` says): compiling fxpipe's sources each time would add
about 0.4 s to `import fxpipe`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch
from tabulate import tabulate
from torch import nn

PHASES = {
    "capture": ["trace"],
    "functionalize": ["functionalize", "seed_random_ops"],
    "measure": ["annotate_costs", "calibrate", "Baseline"],
    "search": ["consider"],
    "split": ["split_chosen", "split_stages", "held_by_stages"],
    "check": ["reference_of", "meta_reference", "verify"],
    "race": ["race"],
}
# The modules that call them, before planning was prepared once (`api` did) and after
# (`planning.build` conducts the steps now).
CALLERS = ("api", "planning.build", "planning.recipe", "planning.prepare", "planning.measure",
           "planning.search")


class Net(nn.Module):
    """README.md's first example."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 128)
        self.blocks = nn.ModuleList(nn.Linear(128, 128) for _ in range(4))
        self.out = nn.Linear(128, 10)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.out(h)


def build(name: str) -> tuple[nn.Module, tuple, dict]:
    """The model in eval mode, its positional and keyword example inputs."""
    torch.manual_seed(0)
    if name == "readme":
        return Net().eval(), (torch.randn(64, 32),), {}
    if name == "resnet50":
        from examples.zoo import build as zoo
        case = zoo("resnet50", size="tiny", batch=8)
        return case.model.eval(), case.example_inputs, case.example_kwargs
    from examples.zoo.hf import build_hf
    model, inputs = build_hf(name, size="tiny", batch=8)
    return model, (), inputs


class Phases:
    """Seconds spent in each phase, by wrapping the phases' functions in every fxpipe module
    that holds them (an outer call counts; one a phase makes inside another does not)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)
        self.depth = 0
        self.originals: dict[int, Callable] = {}
        for phase, names in PHASES.items():
            for name in names:
                for module in [sys.modules.get(f"fxpipe.{m}") for m in CALLERS]:
                    fn = getattr(module, name, None)
                    if callable(fn):
                        self._wrap(module, name, fn, phase)

    def _wrap(self, module: Any, name: str, fn: Callable, phase: str) -> None:
        wrapper = self.originals.get(id(fn))
        if wrapper is None:
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                if self.depth:
                    return fn(*args, **kwargs)
                self.depth += 1
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.depth -= 1
                    self.seconds[phase] += time.perf_counter() - start
                    self.calls[phase] += 1
            self.originals[id(fn)] = wrapper
        setattr(module, name, wrapper)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)


def compile_timed(phases: Phases, model: nn.Module, args: tuple, kwargs: dict, devices: int,
                  auto: bool) -> tuple[float, dict[str, float], int]:
    import fxpipe
    phases.reset()
    shapes = getattr(sys.modules.get("fxpipe.passes.partition.lattice"), "_SHAPES", {})
    shapes.clear()      # each compile lists its graph's ideals, as a first compile of it does
    options = dict(num_stages="auto", chunks="auto") if auto else dict(chunks=2 * devices)
    start = time.perf_counter()
    pipe = fxpipe.compile(model, ["cpu"] * devices, args, kwargs, **options)
    total = time.perf_counter() - start
    pipe.close()
    return total, dict(phases.seconds), phases.calls["capture"]


def by_phase(models: list[str], devices: int) -> None:
    import fxpipe.api  # noqa: F401  (the modules whose functions are wrapped, loaded)
    phases = Phases()
    rows = []
    for name in models:
        model, args, kwargs = build(name)
        for auto in (False, True):      # warm, not counted: what a process measures once
            compile_timed(phases, model, args, kwargs, devices, auto)
        totals = {}
        for auto in (False, True):
            total, seconds, captures = compile_timed(phases, model, args, kwargs, devices, auto)
            totals[auto] = total
            other = max(0.0, total - sum(seconds.values()))
            cells = [f"{s:.2f} ({s / total:.0%})" for s in [*seconds.values(), other]]
            rows.append([name, "auto" if auto else "fixed", f"{total:.2f}", captures, *cells])
        rows[-1].append(f"{totals[True] / totals[False]:.2f}x")
    print(tabulate(rows, headers=["model", "compile", "total s", "captures", *PHASES, "other",
                                  "auto/fixed"]))


FIRST = r"""
import json, sys, time
clocks = lambda: (time.perf_counter(), time.process_time())
start = clocks()
import torch
after_torch = clocks()
import fxpipe
from torch import nn
after_fxpipe = clocks()
from benchmarks.compile_time import Net
torch.manual_seed(0)
model, x = Net().eval(), torch.randn(64, 32)
before = set(sys.modules)
began = clocks()
pipe = fxpipe.compile(model, devices=["cpu"] * 4, example_inputs=(x,), chunks=8)
compiled = clocks()
pipe.close()
loaded = sorted(set(sys.modules) - before)
spans = [(after_torch, start), (after_fxpipe, after_torch), (compiled, began), (clocks(), start)]
print(json.dumps([[b[i] - a[i] for b, a in spans] for i in (0, 1)] + [loaded]))
"""


def first_compile(runs: int) -> None:
    found = []
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache
        for _ in range(runs + 1):      # the first writes the bytecode, not counted
            out = subprocess.run([sys.executable, "-c", FIRST], capture_output=True,
                                 text=True, check=True, env=env)
            found.append(json.loads(out.stdout.strip().splitlines()[-1]))
    found = found[1:]
    rows = [[clock] + [f"{min(f[c][i] for f in found):.2f}" for i in range(4)]
            for c, clock in enumerate(["wall", "CPU"])]
    loaded = found[0][2]
    heavy = sorted({".".join(m.split(".")[:2]) for m in loaded})
    print(tabulate([row + [len(loaded)] for row in rows],
                   headers=["seconds", "import torch", "import fxpipe", "first compile",
                            "process total", "modules compile imported"]))
    print("imported by the first compile:", ", ".join(heavy) or "nothing")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="readme,resnet50,gpt2,llama")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--first", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.first:
        first_compile(args.runs)
    else:
        by_phase(args.models.split(","), args.devices)


if __name__ == "__main__":
    main()
