"""A griffe extension for the API reference: setup.py's `package_dir` installs folders under other
names (`passes/` as `fxpipe.passes`), which griffe cannot see by reading `fxpipe/`. Once `fxpipe`
is loaded, each such folder is loaded too and hung under it by its installed name, so that
`fxpipe.DeviceSpec` and the error classes (re-exported from `fxpipe.passes`) resolve. The mapping
is read from setup.py, the one place that states it."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import griffe


def package_dir(setup: Path = Path(__file__).resolve().parent.parent / "setup.py"
                ) -> dict[str, str]:
    """setup.py's `package_dir`, installed name -> folder, read without running setup.py."""
    for node in ast.walk(ast.parse(setup.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "package_dir":
            return ast.literal_eval(node.value)
    raise LookupError(f"{setup} names no package_dir")


class PassesAsFxpipePasses(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for name, folder in package_dir().items():
            parent, _, member = name.rpartition(".")
            if pkg.name != parent or member in pkg.members:
                continue
            module = loader.load(folder)
            module.parent = pkg
            pkg.set_member(member, module)
