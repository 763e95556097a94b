"""Standalone torch.fx passes, each usable on its own on any GraphModule.

capture -> functionalize -> seed_random_ops -> annotate_costs -> partition -> codegen, each
module's docstring with a runnable example; DESIGN.md is the map.

The folder `passes/` installs as this package, `fxpipe.passes` (`package_dir` in setup.py, the
one place that mapping lives), so the distribution owns no generic top-level name: code and
tests import `fxpipe.passes.capture`, never `passes.capture`. Importing a pass therefore runs
`fxpipe/__init__.py` first, which imports the passes before the rest of fxpipe: no cycle, as
long as no pass imports an fxpipe module.

Imports flow one way: `fxpipe/` builds on `passes/`, and `passes/` never imports `fxpipe/` (a
pass must be usable on its own, and a cycle between the two packages breaks at import time;
tests/test_layers.py holds it). What both need, the cost model, the device seam and the error
classes, lives here, at the bottom, and `fxpipe` re-exports what users see.
"""
