"""A griffe extension for the API reference: the folder `passes/` installs as `fxpipe.passes`
(setup.py's `package_dir`), which griffe cannot see by reading `fxpipe/`. Once `fxpipe` is loaded,
`passes/` is loaded too and hung under it as `fxpipe.passes`, so that `fxpipe.DeviceSpec` and the
error classes (re-exported from there) resolve."""

from __future__ import annotations

from typing import Any

import griffe


class PassesAsFxpipePasses(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "fxpipe" or "passes" in pkg.members:
            return
        passes = loader.load("passes")
        passes.parent = pkg
        pkg.set_member("passes", passes)
