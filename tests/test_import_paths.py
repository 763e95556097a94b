"""Every import path the README, docs/, examples/ and benchmarks/ show keeps working, and the
old public paths the docs showed before fxpipe/ was grouped by layer (`fxpipe.saved`,
`fxpipe.schedules`, `fxpipe.reference`: each is the moved module itself, not a copy)."""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# What the docs show, each a module or a name in one (`fxpipe.weights.Init`).
DOCUMENTED = [
    "fxpipe.compile", "fxpipe.plan", "fxpipe.load_plan", "fxpipe.Pipeline", "fxpipe.Plan",
    "fxpipe.DeviceSpec", "fxpipe.tune_cpu_allocator", "fxpipe.FxpipeError", "fxpipe.TraceError",
    "fxpipe.PartitionError", "fxpipe.PlanFileError", "fxpipe.api",
    "fxpipe.distributed", "fxpipe.distributed.load", "fxpipe.distributed.measure_link",
    "fxpipe.distributed.DistributedError", "fxpipe.distributed.PeerFailedError",
    "fxpipe.distributed.WorldSizeError",
    "fxpipe.generate", "fxpipe.generate.plan_generation", "fxpipe.generate.GenerationError",
    "fxpipe.generate.save_generation", "fxpipe.generate.load_generation",
    "fxpipe.generate.loop_step_s", "fxpipe.generate_ranks", "fxpipe.generate_ranks.load_generation",
    "fxpipe.planning.generation", "fxpipe.planning.generation.decode_step_s",
    "fxpipe.planning.generation.choose_lanes",
    "fxpipe.torch_pipelining", "fxpipe.torch_pipelining.pipeline_stages",
    "fxpipe.torch_pipelining.NotAChainError",
    "fxpipe.testing", "fxpipe.testing.memory", "fxpipe.testing.synthetic_graph",
    "fxpipe.testing.assert_same_up_to_rounding", "fxpipe.testing.assert_pipeline_matches",
    "fxpipe.testing.models", "fxpipe.testing.memory.peak_bytes",
    "fxpipe.testing.memory.return_freed_memory",
    "fxpipe.timeline.write_chrome_trace", "fxpipe.timeline.write_svg",
    "fxpipe.weights", "fxpipe.weights.Init", "fxpipe.weights.Weights",
    "fxpipe.weights.open_weights", "fxpipe.weights.save_weights", "fxpipe.weights.build_on_meta",
    "fxpipe.weights.stand_in_", "fxpipe.weights.shard_layout",
    "fxpipe.runtime.memory", "fxpipe.runtime.memory.track_memory", "fxpipe.runtime.transport",
    "fxpipe.runtime.transport.ThreadTransport",
    "fxpipe.runtime.schedules", "fxpipe.runtime.schedules.format_timetable",
    "fxpipe.runtime.schedules.one_f_one_b", "fxpipe.runtime.schedules.validate",
    "fxpipe.runtime.schedules.Phase",
    "fxpipe.planning.reference.run_per_microbatch",
    "fxpipe.plans.saved.load_stage", "fxpipe.plans.saved.convert", "fxpipe.plans.report",
    "fxpipe.plans.report.cost_sources", "fxpipe.plans.report.unclaimed",
    "fxpipe.passes", "fxpipe.passes.annotate_costs", "fxpipe.passes.blocks",
    "fxpipe.passes.capture", "fxpipe.passes.cost_model", "fxpipe.passes.errors",
    "fxpipe.passes.partition", "fxpipe.passes.split_wide", "fxpipe.passes.materialize",
    "fxpipe.passes.randomness.microbatch_seeds", "fxpipe.passes.annotate_costs.annotate_costs",
    "fxpipe.passes.blocks.block_of", "fxpipe.passes.capture.trace",
    "fxpipe.passes.cost_model.CostGraph", "fxpipe.passes.cost_model.DeviceSpec",
    "fxpipe.passes.cost_model.OPTIMIZER_STATE", "fxpipe.passes.cost_model.Pricing",
    "fxpipe.passes.cost_model.cost_graph", "fxpipe.passes.cost_model.format_bytes",
    "fxpipe.passes.cost_model.stage_memory", "fxpipe.passes.cost_model.stage_nodes",
    "fxpipe.passes.partition.Method", "fxpipe.passes.partition.Partition",
    "fxpipe.passes.partition.evaluate", "fxpipe.passes.partition.partition",
    "fxpipe.passes.partition.lattice", "fxpipe.generate_lanes.lane_seeds", "fxpipe.runtime.lanes",
    "fxpipe.runtime.lanes.bubble",
    "fxpipe.passes.split_wide.split_wide",
]
# The paths the docs showed before the modules moved (docs/saved-plans.md, docs/training.md,
# docs/guarantees.md): the modules at their new paths.
OLD_PUBLIC = {
    "fxpipe.saved.load_stage": "fxpipe.plans.saved", "fxpipe.saved.convert": "fxpipe.plans.saved",
    "fxpipe.schedules.format_timetable": "fxpipe.runtime.schedules",
    "fxpipe.schedules.one_f_one_b": "fxpipe.runtime.schedules",
    "fxpipe.schedules.validate": "fxpipe.runtime.schedules",
    "fxpipe.reference.run_per_microbatch": "fxpipe.planning.reference",
}
SHOWN_IN = ["README.md", "docs/**/*.md", "examples/**/*.py", "examples/**/*.md",
            "benchmarks/**/*.py"]


def resolve(path: str):
    """The module `path` names, or the name in its longest importable module prefix."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if not ".".join(parts[:i]).startswith(e.name or "\0"):
                raise
            continue
        for name in parts[i:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(path)


def shown() -> set[str]:
    """The fxpipe paths the docs, examples and benchmarks name: dotted names, and the names
    their `from fxpipe... import a, b` lines take from a module."""
    found = set()
    for pattern in SHOWN_IN:
        for file in ROOT.glob(pattern):
            text = file.read_text()
            found.update(re.findall(r"(?<![\w./-])fxpipe(?:\.\w+)+", text))
            for module, names in re.findall(r"from (fxpipe(?:\.\w+)*) import ([\w, ]+)", text):
                found.update(f"{module}.{name.strip()}" for name in names.split(",")
                             if name.strip())
    return found


@pytest.mark.parametrize("path", DOCUMENTED)
def test_a_documented_path_imports(path):
    assert resolve(path) is not None


@pytest.mark.parametrize("path", sorted(OLD_PUBLIC))
def test_an_old_public_path_is_the_moved_module(path):
    module, _, name = path.rpartition(".")
    assert importlib.import_module(module) is importlib.import_module(OLD_PUBLIC[path])
    assert resolve(path) is getattr(importlib.import_module(OLD_PUBLIC[path]), name)


def test_every_path_the_docs_show_is_listed_here():
    unlisted = sorted(shown() - set(DOCUMENTED) - set(OLD_PUBLIC))
    assert not unlisted, (f"the docs show {unlisted}, not in DOCUMENTED: add them (this test "
                          f"imports each, so a move that breaks one fails here)")
